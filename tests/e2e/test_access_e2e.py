"""The access table with a real daemon (issue 35 #5): with coordination.token_file set, the hints between peers
from 127.0.0.1 need the peers' token (they answered 202 without it); the server's token does too; reads stay open
to loopback."""

from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.e2e

PEER_TOKEN = "peer-s3cret-token"


def test_hints_from_loopback_need_the_peers_token(start_emulator, start_agent, tmp_path):
    peer_file = tmp_path / "peer-token"
    peer_file.write_text(PEER_TOKEN + "\n")
    os.chmod(peer_file, 0o600)
    emu = start_emulator(["vm-1"])
    agent = start_agent(emu, "vm-1", {"coordination": {"token_file": str(peer_file)}})
    eid = emu.add_event(event_type="Reboot", resources=["vm-1"], notice=600)
    agent.wait_log("event.appeared", event_id=eid)
    peer = {"Authorization": f"Bearer {PEER_TOKEN}"}
    for path, body in ((f"/v1/events/{eid}/peer-ready", {"vm": "vm-1"}), ("/v1/budget/wake", {"vm": "vm-1"})):
        refused = agent.http.post(agent.base + path, json=body, timeout=5)
        assert refused.status_code == 401 and "coordination.token_file" in refused.json()["error"], path
        assert refused.headers["WWW-Authenticate"] == "Bearer"
        taken = agent.http.post(agent.base + path, json=body, headers=peer, timeout=5)
        assert taken.status_code in (202, 409), path  # 409: no disruption budget on this VM, said after admission
        assert agent.post(path, body).status_code in (202, 409), path  # the server token
    assert agent.get(f"/v1/events/{eid}").status_code == 200  # reads: loopback is an operator
    assert agent.http.post(agent.base + "/v1/drain", json={"reason": "x"}, headers=peer, timeout=5).status_code == 403
