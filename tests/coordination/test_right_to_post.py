"""S2: immediately before every send of StartRequests, the first and each retry, the approver rechecks
that its right to post still holds: the deadline (a pause past it sends nothing), the event still
Scheduled in this VM's last poll, and the backend's check (issue 27)."""

from __future__ import annotations

from agent.clock import FakeClock
from agent.coordination.approval_gates import GateChecker
from agent.coordination.approver import Approver, Order
from agent.coordination.backend import Right
from agent.coordination.coordination_settings import CoordinationConfig
from agent.coordination.coordinator import Coordinator
from agent.coordination.peers.peer_client import PeerClient
from agent.coordination.store.store_protocol import Step
from agent.errors import ImdsUnavailable
from agent.loop.tick import Tick
from agent.model.gate_specs import NO_GATES
from agent.state.state_store import Store
from agent.telemetry.metrics import Metrics
from tests.coordination.test_coordinator import step, tracked
from tests.stopping import stopped_at_end


class PausingClock(FakeClock):
    """The injected clock; `pause` seconds are added to the next sleep (a SIGSTOP, a frozen VM)."""

    pause = 0.0
    during_pause = staticmethod(lambda: None)

    def wait(self, event, seconds: float) -> bool:
        extra, self.pause = self.pause, 0.0
        if extra:
            self.during_pause()
        return super().wait(event, seconds + extra)


def failing_once(clock: PausingClock, pause: float, posts: list[float]):
    """IMDS answers the first POST 500; the process is then paused `pause` s inside the retry backoff."""
    def approve(ids: list[str]) -> None:
        posts.append(clock.monotonic())
        if len(posts) == 1:
            clock.pause = pause
            raise ImdsUnavailable("IMDS answered 500", 500)
    return approve


def test_a_leader_paused_in_its_retry_backoff_past_the_deadline_sends_nothing_more(tmp_path, logs):
    """The first POST gets a 500, then the VM freezes for 100 s (takeover_after 60 s): no second POST."""
    clock, posts = PausingClock(), []
    store = Store(tmp_path, clock)
    coord = Coordinator(CoordinationConfig(takeover_after=60.0, approval_retry_for=300.0),
                        approve=failing_once(clock, 100.0, posts), store=store, clock=clock, metrics=Metrics())
    stopped_at_end(coord)
    step(coord, tracked(clock, ["vm1"]), "vm1")
    assert len(posts) == 1
    withheld = [e for e in logs if e["event"] == "approval.withheld"]
    assert len(withheld) == 1 and "deadline" in withheld[0]["reason"]
    assert store.result("E1", "approval")["status"] == "failed"


def test_an_event_started_in_the_poll_during_the_backoff_is_not_posted_again(tmp_path, logs):
    """The first POST gets a 500 (it may have landed); the next poll shows the event Started: no retry."""
    clock, posts = PausingClock(), []
    coord = Coordinator(CoordinationConfig(), approve=failing_once(clock, 0.1, posts), store=Store(tmp_path, clock),
                        clock=clock, metrics=Metrics())
    stopped_at_end(coord)
    clock.during_pause = lambda: coord.tick(Tick.of(tracked(clock, ["vm1"], status="Started"), "vm1", _auto(), False,
                                            lambda t: [],
                                                    now=clock.now(), monotonic=clock.monotonic()))
    step(coord, tracked(clock, ["vm1"]), "vm1")
    assert len(posts) == 1
    assert "no longer Scheduled" in next(e for e in logs if e["event"] == "approval.withheld")["reason"]


def _auto():
    from agent.policy.approval_policy import Profile
    return Profile(name="default", approval="auto")


class LostClaim:
    """A store backend whose claim is won, then lost (its record rewritten by a taker) before the send."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    def take_right(self, event_id, vm_name, step, retry_for) -> Right:
        return Right(retry_for)

    def settle(self, event_id, vm_name, right, sent) -> None:
        pass

    def right_to_post(self, event_id, resources, vm_name, mode, step) -> str | None:
        self.asked.append(event_id)
        return "the approval record is no longer at this VM's ETag"


def test_the_store_backends_claim_check_runs_before_the_send_and_stops_it(tmp_path, clock, logs):
    """The backend's `right_to_post` (the store's: its claim still holds) runs before the send: a lost claim means
    no POST."""
    posts: list[list[str]] = []
    claim = LostClaim()
    approver = Approver(approve=posts.append, store=Store(tmp_path, clock), clock=clock, metrics=Metrics(),
                        gate_checker=GateChecker(PeerClient(lambda: None, 1.0, 1), lambda n: None, dict, 1,
                                                 Metrics()),
                        backend=claim, done=lambda: None)  # type: ignore[arg-type]
    stopped_at_end(approver)
    approver.submit(Order("E1", "vm1", "every affected VM is ready", NO_GATES, ("vm1",), Step("claim", ""), None,
                          60.0, False))
    assert approver.wait_idle(5)
    assert posts == [] and claim.asked == ["E1"]
    assert any(e["event"] == "approval.withheld" for e in logs)
