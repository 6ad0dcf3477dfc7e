"""probe.mode: tcp — the port accepts while in rotation and refuses while out."""

from __future__ import annotations

import socket
import time

import pytest

from agent.health.health_store import HealthState, HealthStore
from agent.health.rotation import Rotation
from agent.health.tcp_probe import TcpProbe
from agent.state.state_store import Store


def connects(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except (ConnectionRefusedError, ConnectionResetError):  # reset: it reached the backlog as the port closed
        return False


def test_port_follows_rotation_and_refuses_while_drained():
    state = {"in": True}
    probe = TcpProbe("127.0.0.1:0", lambda: state["in"])
    probe.step()
    assert probe.listening and connects(probe.port)
    probe.step()  # accepts and closes the waiting connection

    state["in"] = False
    probe.step()
    assert not probe.listening
    assert not connects(probe.port), "a drained VM must refuse the LB's TCP probe at once"

    state["in"] = True
    probe.step()
    assert connects(probe.port), "back in rotation: the same port accepts again"
    probe.stop()


def test_served_on_a_thread_until_stopped():
    probe = TcpProbe("127.0.0.1:0", lambda: True)
    probe.start()
    try:
        assert connects(probe.port)
    finally:
        probe.stop()
    assert not connects(probe.port)


def test_a_port_in_use_is_logged_not_raised(logs):
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    try:
        probe = TcpProbe(f"127.0.0.1:{holder.getsockname()[1]}", lambda: True)
        probe.step()
        assert not probe.listening
        assert any(e["event"] == "probe.tcp_bind_failed" for e in logs)
    finally:
        holder.close()



# --- following the rotation without polling --------------------------------------------------

def until(predicate, seconds: float = 3.0) -> bool:
    """Whether `predicate` holds within `seconds` (another thread acts on what the test did)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


@pytest.fixture
def rotation(tmp_path, clock):
    return Rotation(Store(tmp_path / "state", clock), HealthStore(clock), ["*"])


@pytest.fixture
def served(rotation):
    calls = []

    def in_rotation() -> bool:
        calls.append(1)
        return rotation.verdict().in_rotation

    probe = TcpProbe("127.0.0.1:0", in_rotation, watch=rotation)
    probe.start()
    yield probe, calls
    probe.stop()


def test_a_drain_closes_the_port_at_once_and_an_undrain_opens_it(served, rotation, clock):
    """`maintd drain` refuses the LB's next connect without waiting for a poll; undrain accepts again."""
    probe, _ = served
    assert connects(probe.port)
    rotation.drain("manual", "maintenance", clock.now())
    assert until(lambda: not connects(probe.port)), "a drained VM must refuse the LB's TCP probe"
    rotation.undrain("manual")
    assert until(lambda: connects(probe.port)), "back in rotation: the port accepts again"


def test_a_health_error_takes_the_port_down_and_its_removal_brings_it_back(served, rotation):
    """Health changes count like drains: an Error report takes the VM out, its removal brings it back."""
    probe, _ = served
    rotation.health.set("app", "db", HealthState.ERROR, "replica lag")
    assert until(lambda: not connects(probe.port))
    rotation.health.remove("app", "db")
    assert until(lambda: connects(probe.port))


def test_the_probe_sleeps_while_nothing_changes(served):
    """No periodic wake-up: idle, the verdict is not looked at again (the old probe looked 5 times a second)."""
    probe, calls = served
    assert until(lambda: connects(probe.port))
    seen = settled(calls, quiet=0.5)  # the accept's wake-up done (a fixed 0.3 s raced it on a loaded host)
    time.sleep(0.6)
    assert len(calls) == seen


def settled(calls: list, quiet: float, limit: float = 10.0) -> int:
    """How many calls there were once none came for `quiet` seconds (within `limit`)."""
    deadline, seen, since = time.monotonic() + limit, len(calls), time.monotonic()
    while time.monotonic() - since < quiet:
        assert time.monotonic() < deadline, f"calls kept coming for {limit:.0f}s"
        time.sleep(0.01)
        if len(calls) != seen:
            seen, since = len(calls), time.monotonic()
    return seen


def test_it_wakes_when_a_health_reports_ttl_runs_out(rotation, clock):
    """An Ok report with a TimeToLive counts as Error once it expires, with no call to announce it:
    the probe's next look is due exactly then."""
    rotation.health.set("app", "heartbeat", HealthState.OK, ttl=30)
    clock.advance(12)
    assert rotation.recheck_in() == pytest.approx(18)
    clock.advance(18)
    assert rotation.recheck_in() is None and not rotation.verdict().in_rotation
