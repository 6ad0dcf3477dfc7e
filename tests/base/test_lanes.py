"""Serial lanes: order within a key, parallelism across keys, threads bounded by busy keys."""

from __future__ import annotations

import threading

from agent.lanes import Lanes


def test_a_burst_for_one_key_runs_in_order_on_one_thread():
    """Fifty jobs queued at once for one key run in submission order, all on the same worker."""
    lanes = Lanes(8, "t")
    gate = threading.Event()
    seen: list[tuple[int, str]] = []
    lanes.submit("peer", gate.wait)
    for i in range(50):
        lanes.submit("peer", lambda i=i: seen.append((i, threading.current_thread().name)))
    gate.set()
    assert lanes.wait_idle(5)
    assert [i for i, _ in seen] == list(range(50))
    assert len({name for _, name in seen}) == 1
    lanes.shutdown()


def test_different_keys_run_in_parallel():
    """A job stuck in one lane does not hold up another key's jobs."""
    lanes = Lanes(4, "t")
    release, other_ran = threading.Event(), threading.Event()
    lanes.submit("slow", lambda: release.wait(5))
    lanes.submit("fast", other_ran.set)
    assert other_ran.wait(5), "the second key waited for the first"
    release.set()
    assert lanes.wait_idle(5) and lanes.busy() == []
    lanes.shutdown()


def test_a_failing_job_does_not_stop_its_lane():
    """An exception is logged and the key's next job still runs."""
    lanes = Lanes(2, "t")
    ran = threading.Event()
    lanes.submit("k", lambda: 1 / 0)
    lanes.submit("k", ran.set)
    assert ran.wait(5)
    lanes.shutdown()


def test_work_submitted_after_shutdown_is_dropped_quietly():
    """A stopping daemon drops new work without an exception, and nothing stays busy."""
    lanes = Lanes(2, "t")
    lanes.shutdown()
    lanes.submit("k", lambda: None)
    assert lanes.wait_idle(1) and lanes.busy() == []


def test_shutdown_drops_the_jobs_queued_behind_a_running_one_and_the_lanes_end():
    """A stopped lane finishes the job it is running and no other: its key's queue used to run on to the end,
    so a stopped coordinator went on asking peers (and its threads outlived the test that stopped it)."""
    lanes = Lanes(2, "t")
    started, release = threading.Event(), threading.Event()
    ran: list[int] = []
    lanes.submit("k", lambda: (started.set(), release.wait(5)))
    for i in range(5):
        lanes.submit("k", lambda i=i: ran.append(i))
    lanes.submit("other", lambda: None)
    assert started.wait(5)
    lanes.shutdown()
    release.set()
    assert lanes.wait_idle(5) and lanes.busy() == []
    assert ran == []


def test_a_job_that_raises_runs_its_failed_callback_and_is_counted(logs: list[dict]) -> None:
    """The job's `failed` callback gets the exception (so its user can clear a busy flag and retry), the error is
    counted and logged once as lane.internal_error; a callback that raises too does not stop the lane."""
    errors: list[int] = []
    lanes = Lanes(2, "t", lambda: errors.append(1))
    got: list[Exception] = []
    ran = threading.Event()
    lanes.submit("k", lambda: 1 / 0, got.append)
    lanes.submit("k", lambda: [][1], lambda exc: 1 / 0)
    lanes.submit("k", ran.set)
    assert ran.wait(5) and lanes.wait_idle(5)
    assert [type(e) for e in got] == [ZeroDivisionError]
    assert len(errors) == 3
    assert [e.get("where") for e in logs if e["event"] == "lane.internal_error"] == ["job", "job", "failed callback"]
    lanes.shutdown()


def test_a_peer_ask_that_raises_is_asked_again_not_stuck_in_flight(clock) -> None:
    """The peer lane's user puts its state back: an ask that raised leaves the peer askable at the next liveness
    interval, and the error is counted (today: the peer stays `in_flight` and is never asked again)."""
    from agent.coordination.coordination_settings import CoordinationConfig
    from agent.coordination.peers.peer_exchange import Exchange, PeerExchange
    from agent.telemetry.metrics import Metrics

    metrics = Metrics()
    peers = PeerExchange(lambda: CoordinationConfig(), lambda: 1.0, clock, token_reader=lambda: None,
                         metrics=metrics, on_change=lambda: None, health=None)
    asked: list[str] = []

    def address(name: str):
        asked.append(name)
        raise RuntimeError("a bug in addressing")

    peers.address = address  # type: ignore[method-assign]
    ex = Exchange()
    for _ in range(3):
        peers.run("e1", ex, "web_b", ["web_a"], [], False, False, clock.monotonic())
        assert peers.wait_idle(5)
        clock.advance(60)
    assert asked == ["web_a"] * 3
    assert metrics.lane_errors.labels("peer")._value.get() == 3
    peers.stop()
