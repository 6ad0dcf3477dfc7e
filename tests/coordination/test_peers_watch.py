"""The peers file is watched, not re-read: the coordination tick takes the watcher's last look (an
immutable map) and never stats, opens or reads the file; the watcher's thread follows changes."""

from __future__ import annotations

import gc
import os
import threading
from types import MappingProxyType

from agent.coordination.coordination_settings import CoordinationConfig
from agent.coordination.peers.peer_directory import PeerDirectory
from agent.coordination.peers.peers_file import PeersWatch
from tests.imds_server import wait_for
from tests.stopping import stopped_at_end


def test_the_loops_refresh_never_touches_the_peers_file(tmp_path, monkeypatch):
    """refresh() on the loop's thread makes no stat or open; a change arrives through the watcher's thread."""
    path = tmp_path / "peers.yaml"
    path.write_text("web_1: http://10.0.0.4:8088\n")
    directory = PeerDirectory(lambda: CoordinationConfig(peers_file=str(path)), None)
    on_loop: list[str] = []
    for name in ("stat", "open", "lstat"):
        real = getattr(os, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            if threading.current_thread() is threading.main_thread():
                on_loop.append(_name)
            return _real(*args, **kwargs)
        monkeypatch.setattr(os, name, spy)
    wait_for(directory.refresh)
    path.write_text("web_1: http://10.0.0.9:8088\nweb_2: http://10.0.0.5:8088\n")
    wait_for(directory.refresh, 3)
    for _ in range(1000):
        directory.refresh()
    assert directory.address("web_2").url == "http://10.0.0.5:8088"
    assert on_loop == []


def test_a_look_is_handed_over_whole_and_a_dropped_watch_ends_its_thread(tmp_path):
    """The map in force is read-only (the watcher replaces it, never changes it); a watch dropped on a
    reload that changed the path leaves no thread behind."""
    path = tmp_path / "peers.yaml"
    path.write_text("web_1: http://10.0.0.4:8088\n")
    before = set(threading.enumerate())
    watch = PeersWatch(str(path), every=0.01)
    mine = set(threading.enumerate()) - before
    wait_for(lambda w=watch: w.latest.version)
    assert isinstance(watch.latest.peers, MappingProxyType) and dict(watch.latest.peers) == {"web_1": "http://10.0.0.4:8088"}
    del watch
    gc.collect()
    assert mine and wait_for(lambda: not any(t.is_alive() for t in mine), 2)


def test_a_peers_file_another_user_could_change_is_not_used(tmp_path):
    """A peers file others can write (or one in a directory they can) steers where the peer token goes: it is
    refused, naming the component and the fix, and the last good map stays in force."""
    from agent.coordination.peers.peers_file import PeersFile

    path = tmp_path / "peers.yaml"
    path.write_text("web_1: http://10.0.0.5:8088\n")
    os.chmod(path, 0o644)
    peers = PeersFile(str(path))
    assert peers.current() == ({"web_1": "http://10.0.0.5:8088"}, True)
    path.write_text("web_1: http://attacker.example:8088\n")
    os.chmod(path, 0o666)
    mapped, changed = peers.current()
    assert changed and mapped == {"web_1": "http://10.0.0.5:8088"}
    problem = peers.problem or ""
    assert "writable by group or others" in problem and "chmod go-w" in problem


def test_a_freshly_started_coordinator_asks_peers_where_the_peers_file_says_from_its_first_pass(
        tmp_path, clock, monkeypatch, logs):
    """At start, however late the watcher's thread gets the CPU (a loaded VM), the first coordination pass
    already has the peers file's map: vm2 is asked at the file's address, never at the `peer_url`
    template's, and no `peer.bad_address` or unreachable peer is reported."""
    import time

    import requests
    import responses

    from agent.coordination.coordinator import Coordinator
    from agent.coordination.peers import peers_file
    from agent.state.state_store import Store
    from agent.telemetry.metrics import Metrics
    from tests.coordination.test_coordinator import step, tracked, view

    real = peers_file.first_problem

    def late(path: str) -> str | None:  # the watcher's thread is scheduled half a second late
        if threading.current_thread() is not threading.main_thread():
            time.sleep(0.5)
        return real(path)
    monkeypatch.setattr(peers_file, "first_problem", late)
    path = tmp_path / "peers.yaml"
    path.write_text("vm2: http://10.0.0.5:8088\n")
    os.chmod(path, 0o600)
    sent: list[list[str]] = []
    with responses.RequestsMock(assert_all_requests_are_fired=False) as peers:
        peers.add(responses.GET, "http://10.0.0.5:8088/v1/events/E1", json=view("vm2"))
        peers.add(responses.GET, "http://vm2.template.invalid:8088/v1/events/E1",
                  body=requests.ConnectionError("no such host"))
        coord = Coordinator(CoordinationConfig(peers_file=str(path), peer_url="http://{name}.template.invalid:8088"),
                            approve=sent.append, store=Store(tmp_path, clock), clock=clock, metrics=Metrics(),
                            poll_interval=1.0)
        stopped_at_end(coord)
        t = tracked(clock, ["vm1", "vm2"])
        step(coord, t, "vm1")
        clock.advance(1)
        step(coord, t, "vm1")
        asked = [c.request.url for c in peers.calls]
    assert asked == ["http://10.0.0.5:8088/v1/events/E1"]
    assert sent == [["E1"]], "vm2 answered ready at its real address on the first pass"
    assert not [e for e in logs if e["event"] in ("peer.bad_address", "peer.unreachable")]


def test_a_reload_to_another_peers_file_keeps_the_last_map_until_the_new_file_is_read(tmp_path):
    """A reload names another peers file: until the watcher's first look at it, peers are still asked at the
    old file's addresses, never at the template's; then at the new file's."""
    old, new = tmp_path / "old.yaml", tmp_path / "new.yaml"
    old.write_text("vm2: http://10.0.0.5:8088\n")
    new.write_text("vm2: http://10.0.0.9:8088\n")
    settings = [CoordinationConfig(peers_file=str(old), peer_url="http://{name}.template.invalid:8088")]
    directory = PeerDirectory(lambda: settings[0], None)
    assert directory.refresh() and directory.address("vm2").url == "http://10.0.0.5:8088"
    settings[0] = CoordinationConfig(peers_file=str(new), peer_url="http://{name}.template.invalid:8088")
    seen = {directory.address("vm2").url for _ in range(3) if not directory.refresh()}
    wait_for(lambda: directory.refresh() or directory.address("vm2").url == "http://10.0.0.9:8088")
    assert seen <= {"http://10.0.0.5:8088", "http://10.0.0.9:8088"}
