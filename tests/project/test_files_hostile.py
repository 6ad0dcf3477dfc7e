"""Every file maintd reads at start, fuzzed with BYTES (state file, audit journal, config), and the
daemon's handling of damaged token and config files.

Whatever the bytes, the state store starts (fresh when they are not a state) and stays usable, the
journal reader yields only objects, and the config loader answers a Config or a ConfigError.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.clock import FakeClock
from agent.config.config import load, loads
from agent.coordination.peers.peer_client import PeerClient
from agent.errors import ConfigError
from agent.health.health_store import HealthState
from agent.loop.daemon import Daemon
from agent.state.journal import read_journal
from agent.state.state_store import Store
from agent.systemd import Notifier
from tests.imds_server import FakeImds

VALID_STATE = json.dumps({"version": 1, "events": {"E1": {
    "event": {"EventId": "E1", "EventType": "Reboot", "EventStatus": "Scheduled", "Resources": ["vm1"]},
    "names_self": True, "first_seen": "2026-01-01T00:00:00Z", "history": []}},
    "results": {"E1": {"approval": {"status": "sent"}}}, "flags": {}}).encode()


def _mutations(base: bytes) -> st.SearchStrategy[bytes]:
    """`base` cut, with bytes flipped, inserted or replaced: what a torn write or a bad sector leaves."""
    cut = st.integers(0, len(base)).map(lambda n: base[:n])
    flipped = st.tuples(st.integers(0, len(base) - 1), st.integers(0, 255)).map(
        lambda f: base[:f[0]] + bytes([f[1]]) + base[f[0] + 1:])
    spliced = st.tuples(st.integers(0, len(base)), st.binary(max_size=40)).map(
        lambda s: base[:s[0]] + s[1] + base[s[0]:])
    return st.one_of(cut, flipped, spliced)


state_bytes = st.one_of(st.binary(max_size=400), _mutations(VALID_STATE))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(state_bytes)
def test_any_state_file_bytes_start_the_store(data):
    """Loaded as a state or moved aside with a problem; either way the store reads and writes afterwards."""
    with tempfile.TemporaryDirectory() as d:
        Path(d, "state.json").write_bytes(data)
        store = Store(d, FakeClock())
        report = store.load()
        assert (report.problem is None) == (report.moved_aside is None)
        store.tracked(), store.results("E1"), store.event_records(), store.flag("drains")
        store.record("E2", "approval", {"status": "sent"})
        assert Store(d, FakeClock()).load().problem is None


journal_bytes = st.lists(st.one_of(st.binary(max_size=80), _mutations(b'{"t":"2026-01-01T00:00:00Z","kind":"x"}')),
                         max_size=8).map(b"\n".join)


@settings(max_examples=300, deadline=None)
@given(journal_bytes, journal_bytes)
def test_any_journal_bytes_give_only_entries(current, rotated):
    """`maintd events --history` on any bytes: only JSON objects come out, nothing is raised."""
    with tempfile.TemporaryDirectory() as d:
        Path(d, "journal.jsonl").write_bytes(current)
        Path(d, "journal.jsonl.1").write_bytes(rotated)
        assert all(isinstance(e, dict) for e in read_journal(d))


config_bytes = st.one_of(st.binary(max_size=300),
                         _mutations(b"imds:\n  poll_interval: 2s\nhandlers:\n  - name: d\n"
                                    b"    type: drain\nprofiles: [{name: a, approval: auto}]\n"))


@settings(max_examples=400, deadline=None)
@given(config_bytes)
def test_any_config_file_bytes_give_a_config_or_a_config_error(data):
    """Whatever the file holds: a Config, or a ConfigError naming the file (exit 78, never a traceback)."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d, "maintd.yaml")
        path.write_bytes(data)
        os.chmod(path, 0o600)
        try:
            load(path)
        except ConfigError as exc:
            assert str(exc).startswith(str(path)) and exc.message


def test_the_daemon_reports_unusable_token_files_and_never_opens_reads(tmp_path, clock):
    """Wired into the daemon: a non-UTF-8 peer token (which used to raise on every request) and a
    world-readable server token both fail closed and show as config/<key> Error."""
    peer, server = tmp_path / "peer-token", tmp_path / "server-token"
    peer.write_bytes(b"\xff\xfe\xfd")
    os.chmod(peer, 0o600)
    server.write_text("s3cret\n")
    os.chmod(server, 0o644)
    cfg = loads(f"identity: {{name: vm1}}\nstate: {{dir: {tmp_path / 'state'}}}\n"
                f"coordination: {{token_file: {peer}}}\nserver: {{token_file: {server}}}\n")
    d = Daemon(cfg, clock, boot_id="b", notifier=Notifier({}))
    assert d.parts.peer_token() is not None and d.parts.server_token() not in (None, "s3cret")
    errors = {e.report.property for e in d.health.snapshot()
              if e.report.source_id == "config" and e.state == HealthState.ERROR}
    assert errors == {"coordination.token_file", "server.token_file"}


def test_refused_token_files_send_nothing_a_replay_could_use(tmp_path, clock):
    """Both token files refused (mode 644): a peer asked by this VM is sent no token, and replaying whatever it
    was sent (and the old placeholder, if any) from another address is refused for drain and approve."""
    peer_file, server_file = tmp_path / "peer-token", tmp_path / "server-token"
    for f in (peer_file, server_file):
        f.write_text("s3cret\n")
        os.chmod(f, 0o644)
    imds, peer = FakeImds(), FakeImds()
    imds.get("/metadata/scheduledevents", json={"DocumentIncarnation": 1, "Events": [
        {"EventId": "E1", "EventType": "Reboot", "ResourceType": "VirtualMachine", "Resources": ["vm1", "vm2"],
         "EventStatus": "Scheduled", "NotBefore": "", "Description": "", "EventSource": "Platform",
         "DurationInSeconds": -1}]})
    peer.get("/v1/events/E1", json={"EventId": "E1", "ready": False})
    cfg = loads(f"identity: {{name: vm1}}\nstate: {{dir: {tmp_path / 'state'}}}\nimds: {{endpoint: '{imds.url}'}}\n"
                f"server: {{listen: '127.0.0.1:0', unix_socket: null, token_file: {server_file}}}\n"
                f"coordination: {{token_file: {peer_file}, peers: {{vm2: '{peer.url}'}}}}\n")
    d = Daemon(cfg, clock, boot_id="b", notifier=Notifier({}))
    try:
        d.start()
        d.tick()
        PeerClient(d.parts.peer_token, 5, 1).ask(peer.url, "E1", "vm2", 2)
        sent = {c.headers.get("authorization") for c in peer.calls}
        assert sent == {None}, "a refused token file must send no token"
        d.serve()
        remote = requests.Session()
        remote.trust_env = False
        adapter = requests.adapters.HTTPAdapter()
        adapter.init_poolmanager(2, 2, source_address=("127.0.0.2", 0))
        remote.mount("http://", adapter)
        for header in sent | {f"Bearer {d.parts.peer_token()}", f"Bearer {d.parts.server_token()}", "Bearer "}:
            headers = {"Authorization": header} if header else {}
            assert remote.post(d.server.url + "/v1/drain", json={"reason": "x"}, headers=headers,
                               timeout=5).status_code in (401, 403)
            assert remote.post(d.server.url + "/v1/events/E1/approve", headers=headers,
                               timeout=5).status_code in (401, 403)
        assert d.parts.rotation.verdict().in_rotation
    finally:
        d.shutdown()
        imds.close()
        peer.close()


def test_a_reload_onto_a_damaged_config_file_keeps_the_running_config(tmp_path, clock):
    """SIGHUP after the file was replaced by garbage: refused, reported, the old config keeps running."""
    path = tmp_path / "maintd.yaml"
    path.write_text(f"identity: {{name: vm1}}\nstate: {{dir: {tmp_path / 'state'}}}\nimds: {{poll_interval: 2s}}\n")
    os.chmod(path, 0o600)
    d = Daemon(load(path), clock, boot_id="b", notifier=Notifier({}), config_path=str(path))
    path.write_bytes(os.urandom(64) + b"\xff")
    assert d.reload() is False and d.config.imds.poll_interval == 2
    assert any(e.report.source_id == "config" and e.report.property == "reload" for e in d.health.snapshot())
