"""Coordination through Azure Blob Storage with real agents and a real Azurite: no peers, no addressing."""

from __future__ import annotations

import json
import os
import socket
import socketserver
import threading
from pathlib import Path
from typing import Any

import pytest

from tests.azurite import Azurite, azurite, start  # noqa: F401 - the fixture
from tests.cli.test_cli import maintd
from tests.e2e.harness import Agent, wait_until

pytestmark = pytest.mark.e2e

FLEX = ["web_3f2a9c1b", "web_7c0d11e4", "web_90ab12cd", "web_0e5f7a21", "web_c4d3b2a1"]
"""Flexible scale-set names: computer names cannot be derived from them."""
HOOK = 'sleep "$SLEEP"; date +%s.%N > "$DIR/$MAINTD_VM_NAME.done"'
GATED = 'while [ ! -e "$DIR/go" ]; do sleep 0.05; done; date +%s.%N > "$DIR/$MAINTD_VM_NAME.done"'
"""A hook that ends only once the test creates `go` in its directory."""


def store_config(server: Azurite, container: str, workdir: Path, **coordination: Any) -> dict[str, Any]:
    """The coordination section for the store backend over a 0600 connection-string file."""
    conn = workdir / "storage.conn"
    workdir.mkdir(parents=True, exist_ok=True)
    conn.write_text(server.connection_string())
    os.chmod(conn, 0o600)
    return {"coordination": {"backend": "azure_blob", "takeover_after": "4s", **coordination,
                             "azure_blob": {"container": container, "connection_string_file": str(conn)}}}


def hook(sleep: float, directory: Path) -> dict[str, Any]:
    return {"handlers": [{"name": "checkpoint", "type": "exec", "phases": ["scheduled"], "timeout": "60s",
                          "command": ["/bin/sh", "-c", HOOK], "env": {"SLEEP": str(sleep), "DIR": str(directory)}}]}


def metric(agent: Agent, name: str, **labels: str) -> float:
    """The sum of a counter's series whose labels include `labels`, from the agent's /metrics."""
    text = agent.get("/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()))


def test_five_flexible_vms_that_cannot_reach_each_other_send_one_post_after_the_slowest_hook(
        start_emulator, start_agent, azurite: Azurite, tmp_path: Path) -> None:
    """5 agents with Flexible names, no peers map or file (the default peer template points nowhere): one
    StartRequests POST in all, after the slowest hook ended; no request to any peer; the fleet view shows
    every VM ready and who approved. The slowest hook (web_90ab12cd) ends only once the test has seen the fleet
    midway: with a fixed sleep, a slow `maintd fleet` on a loaded host could see it ready already."""
    container = azurite.new_container()
    emu = start_emulator(FLEX)
    done = tmp_path / "done"
    done.mkdir()
    sleeps = dict(zip(FLEX, (1.0, 2.0, 3.5, 1.5, 2.5), strict=True))
    hooks = {vm: hook(sleeps[vm], done) for vm in FLEX}
    hooks[FLEX[2]]["handlers"][0]["command"] = ["/bin/sh", "-c", GATED]
    agents = {vm: start_agent(emu, vm, {**store_config(azurite, container, tmp_path / f"{vm}-conf"),
                                        **hooks[vm]}) for vm in FLEX}
    eid = emu.add_event(event_type="Reboot", resources=FLEX, notice=300)

    def states() -> dict[str, str]:
        fleet = json.loads(maintd("fleet", "--url", agents[FLEX[0]].base, "--json").stdout)
        return {v["name"]: v["state"] for e in fleet["events"] if e["event_id"] == eid for v in e["vms"]}

    midway = wait_until(lambda: (s := states()).get(FLEX[0]) == "ready" and s, 30, "web_3f2a9c1b ready in its view")
    assert midway[FLEX[2]] in ("preparing", "not seen")
    (done / "go").touch()
    wait_until(lambda: [a for vm in FLEX for a in emu.approvals(vm)], 60, "the approval")
    approvals = [a for vm in FLEX for a in emu.approvals(vm)]
    slowest = max(float((done / f"{vm}.done").read_text()) for vm in FLEX)
    assert len(approvals) == 1, approvals
    posted = [e for a in agents.values() for e in a.events("approval.sent") if e.get("event_id") == eid]
    assert len(posted) == 1
    assert approvals[0]["time"] >= slowest
    for agent in agents.values():
        assert metric(agent, "maintd_peer_requests_total") == 0
    fleet = json.loads(maintd("fleet", "--url", agents[posted[0]["by"]].base, "--json").stdout)
    event = next(e for e in fleet["events"] if e["event_id"] == eid)
    assert {v["name"]: v["state"] for v in event["vms"]} == {vm: "ready" for vm in FLEX}
    assert event["approval"]["by"] == posted[0]["by"] and event["approval"]["state"] == "approved"
    shown = maintd("fleet", "--url", agents[posted[0]["by"]].base).stdout
    assert f"approval: approved by {posted[0]['by']}" in shown and "web_c4d3b2a1" in shown


class ConnectProxy:
    """An HTTPS proxy on 127.0.0.1 (CONNECT tunnels only) that records where each tunnel went."""

    def __init__(self) -> None:
        self.targets: list[str] = []
        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def _handler(self) -> type[socketserver.BaseRequestHandler]:
        proxy = self

        class Tunnel(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                line = self.rfile.readline().decode("latin-1").split()
                while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                    pass
                if len(line) < 2 or line[0] != "CONNECT":
                    self.wfile.write(b"HTTP/1.1 405 Method Not Allowed\r\nContent-Length: 0\r\n\r\n")
                    return
                proxy.targets.append(line[1])
                host, port = line[1].rsplit(":", 1)
                upstream = socket.create_connection((host, int(port)), timeout=10)
                self.wfile.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
                self.wfile.flush()
                pipe = threading.Thread(target=_pump, args=(upstream, self.connection), daemon=True)
                pipe.start()
                _pump(self.connection, upstream)
                pipe.join(10)

        return Tunnel

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass


def test_the_managed_identity_path_over_https(start_emulator, start_agent, tmp_path: Path) -> None:
    """The default credential: each agent gets its token from the emulated IMDS token endpoint (never through
    the proxy) and talks to Azurite over HTTPS in OAuth mode (self-signed certificate trusted through
    REQUESTS_CA_BUNDLE) through HTTPS_PROXY: one POST, tokens cached."""
    server = start(tmp_path, oauth=True)
    proxy = ConnectProxy()
    try:
        container = server.new_container()
        vms = FLEX[:2]
        emu = start_emulator(vms)
        env = {"REQUESTS_CA_BUNDLE": str(server.cert), "HTTPS_PROXY": proxy.url, "HTTP_PROXY": proxy.url}
        agents = [start_agent(emu, vm, {"coordination": {"backend": "azure_blob", "azure_blob": {
            "account_url": server.url, "container": container}}}, env=env) for vm in vms]
        eid = emu.add_event(event_type="Reboot", resources=vms, notice=300)
        wait_until(lambda: [a for vm in vms for a in emu.approvals(vm)], 30, "the approval")
        assert len([a for vm in vms for a in emu.approvals(vm)]) == 1
        tokens = [r for vm in vms for r in emu.requests(vm) if r["path"] == "/metadata/identity/oauth2/token"]
        assert 1 <= len(tokens) <= 2 * len(vms), "tokens are cached"
        status = agents[0].get("/v1/status").json()["coordination"]
        assert status["backend"] == "azure_blob" and status["store_last_answer"] == "ok"
        assert eid
        assert proxy.targets and set(proxy.targets) == {f"127.0.0.1:{server.port}"}, proxy.targets
    finally:
        proxy.stop()
        server.stop()


def test_no_store_traffic_while_no_event_names_the_vm(start_emulator, start_agent, azurite: Azurite,
                                                      tmp_path: Path) -> None:
    """Idle agents make no store request at all; an event naming only web_3f2a9c1b costs web_7c0d11e4
    nothing either, while web_3f2a9c1b (alone in Resources) claims and posts."""
    container = azurite.new_container()
    vms = FLEX[:2]
    emu = start_emulator(vms)
    agents = {vm: start_agent(emu, vm, store_config(azurite, container, tmp_path / f"{vm}-conf")) for vm in vms}
    # a few polls (counted, not slept for: a loaded host polls less often): the store client is opened in the
    # background, nothing is sent
    seen = {vm: len(emu.requests(vm)) for vm in vms}
    wait_until(lambda: all(len(emu.requests(vm)) >= seen[vm] + 15 for vm in vms), 20, "15 more polls of each VM")
    assert [metric(a, "maintd_store_requests_total") for a in agents.values()] == [0, 0]
    eid = emu.add_event(event_type="Reboot", resources=[vms[0]], notice=300)
    wait_until(lambda: emu.approvals(vms[0]), 30, "the approval")
    assert metric(agents[vms[1]], "maintd_store_requests_total") == 0
    assert metric(agents[vms[0]], "maintd_store_requests_total", op="create", outcome="ok") == 1
    assert eid
