"""Why a VM is not ready, as the operator reads it: `/v1/events/{id}`, `/v1/status`, `maintd events`."""

from __future__ import annotations

from datetime import timedelta

import pytest

from agent.cli.cliviews import events_text
from agent.config.config import loads
from agent.loop.daemon import Daemon
from agent.systemd import Notifier
from tests.e2e.harness import http
from tests.imds_server import FakeImds

WAY_OUT = "ckpt failed (exit status 1); on_failure: block — approve by hand with `maintd approve E1`"


@pytest.fixture
def api(tmp_path, clock):
    """A daemon whose only scheduled hook fails, polled once from a mocked IMDS, its API on loopback."""
    nb = (clock.now() + timedelta(minutes=15)).strftime("%a, %d %b %Y %H:%M:%S GMT")
    document = {"DocumentIncarnation": 1, "Events": [
        {"EventId": "E1", "EventType": "Reboot", "ResourceType": "VirtualMachine", "Resources": ["vm1"],
         "EventStatus": "Scheduled", "NotBefore": nb, "Description": "", "EventSource": "Platform",
         "DurationInSeconds": -1}]}
    imds = FakeImds()
    imds.get("/metadata/scheduledevents", json=document)
    cfg = loads(f"identity: {{name: vm1}}\nstate: {{dir: {tmp_path}}}\n"
                "server: {listen: '127.0.0.1:0', unix_socket: null}\n"
                f"imds: {{endpoint: '{imds.url}'}}\n"
                "handlers:\n  - {name: ckpt, type: exec, phases: [scheduled], command: [/bin/false]}\n")
    try:
        d = Daemon(cfg, clock, boot_id="boot-1", notifier=Notifier({}))
        d.start()
        d.tick()
        assert d.runner.wait_idle(10)
        d.serve()
        session = http()
        yield lambda path: session.get(d.server.url + path, timeout=5).json()
        d.shutdown()
    finally:
        imds.close()


def test_a_blocking_failure_says_how_to_get_out(api):
    """A failed hook under on_failure: block: the event view, the status and `maintd events` name the way out."""
    view = api("/v1/events/E1")
    assert view["ready"] is False and view["not_ready"] == [WAY_OUT]
    assert api("/v1/status")["not_ready"] == {"E1": [WAY_OUT]}
    assert f"E1 not ready: {WAY_OUT}" in events_text(api("/v1/events")).splitlines()
