"""B6, a Retry-After ends with the fault: the store answers 503 with Retry-After 86400 for 8 s and is then healthy
again; the approval comes within the fault and a few seconds, on the coordination path alone and with a disruption
budget sharing the store (a fake store, a fake clock, one tick a second as the loop ticks)."""

from __future__ import annotations

from datetime import timedelta

import tests.needs_azure  # noqa: F401 - skips this module without the azure extra
from agent.clock import FakeClock
from agent.coordination.coordination_settings import AzureBlobConfig, BudgetConfig, CoordinationConfig
from agent.coordination.coordinator import Coordinator
from agent.coordination.store.store_answers import RETRY_AFTER_CAP_S, affordable_wait
from agent.coordination.store.store_backend import StoreBackend
from agent.fleet.budget import Budget, Want
from agent.health.health_store import HealthStore
from agent.loop.tick import Tick
from agent.model.events import Event
from agent.model.tracker import Tracked
from agent.policy.approval_policy import Profile
from agent.state.state_store import Store
from agent.telemetry.metrics import Metrics
from tests.budget_fakes import WholeStore
from tests.stopping import stopped_at_end

EVENT = "5F1E2B0C-9A4D-4C61-8E2F-1A2B3C4D5E6F"
ME = "web_3f2a9c1b"
FAULT = 8.0


def rig(tmp_path, clock: FakeClock, store: WholeStore, budget: bool):
    sent: list[tuple[float, list[str]]] = []
    cfg = CoordinationConfig(backend="azure_blob", azure_blob=AzureBlobConfig(account_url="https://a.blob.core.windows.net"),
                             takeover_after=60.0)
    health = HealthStore(clock)
    backend = StoreBackend(cfg.azure_blob, token=lambda r, c: b"", clock=clock, metrics=Metrics(), health=health,
                           secret=lambda key, path: None, on_change=lambda: None, takeover_after=lambda: 60.0,
                           local_health=lambda: health.to_json(False))
    stopped_at_end(backend)
    backend.exchange.client.open_store = lambda: store
    places = Budget(BudgetConfig(group="web"), store=backend.exchange.store, describe="fake", clock=clock,
                    on_change=lambda: None, health=lambda *_: None, metrics=Metrics(), needs=lambda: 30.0,
                    lead_time=lambda: 0.0, answers=backend.exchange.answers) if budget else None
    if places is not None:
        stopped_at_end(places)
        places.identify(ME, "1", "0", "")
    coord = Coordinator(cfg, approve=lambda ids: sent.append((clock.monotonic(), ids)), store=Store(tmp_path, clock),
                        clock=clock, metrics=Metrics(), poll_interval=1.0, backend=backend, health=health,
                        local_health=lambda: health.to_json(False), budget=places)
    stopped_at_end(coord)
    return coord, places, sent


def run_until_approved(coord: Coordinator, places: Budget | None, clock: FakeClock, sent: list, limit: float) -> float:
    """Tick once a second (the budget first, as the loop does) until the POST went out; its time since the start."""
    start = clock.monotonic()
    event = Event(EVENT, "Reboot", "Scheduled", (ME,), not_before=clock.now() + timedelta(minutes=15))
    tracked = {EVENT: Tracked(event, True, clock.now(), "b", False)}
    while not sent and clock.monotonic() - start < limit:
        if places is not None:
            places.tick([Want(EVENT, "Reboot", event.not_before)], False)
            assert places.wait_idle(5)
        coord.tick(Tick.of(tracked, ME, Profile(name="default", approval="auto"), False, lambda t: [],
                           now=clock.now(), monotonic=clock.monotonic()))
        assert coord.wait_idle(5)
        clock.advance(1)
    assert sent, f"no approval within {limit:g}s"
    return sent[0][0] - start


def test_retry_after_a_day_for_8s_the_approval_comes_within_the_fault_and_a_few_seconds(tmp_path, clock) -> None:
    """Coordination alone (no budget): no path but the exchange's asks the store; its wait is capped and a cheap read
    every few seconds learns that the fault is over. Few requests are spent on the store while it throttles."""
    store = WholeStore(clock)
    store.throttle_until = clock.monotonic() + FAULT
    coord, _, sent = rig(tmp_path, clock, store, budget=False)
    took = run_until_approved(coord, None, clock, sent, limit=120)
    assert took <= FAULT + 8, took
    assert len(sent) == 1
    during = [op for op, at in zip(store.ops, store.at, strict=True) if at < store.throttle_until]
    assert len(during) <= 4, during  # the first try and a read every few seconds, not one a second


def test_with_a_budget_the_first_answer_on_any_path_ends_the_coordination_wait(tmp_path, clock) -> None:
    """The budget and the exchange share the store client: once the budget's own retry is answered, the event's
    marker, listing and claim go at once instead of after the store's day."""
    store = WholeStore(clock)
    store.throttle_until = clock.monotonic() + FAULT
    coord, places, sent = rig(tmp_path, clock, store, budget=True)
    took = run_until_approved(coord, places, clock, sent, limit=120)
    assert took <= FAULT + 8, took
    assert places is not None and places.reason_for(EVENT) == "chosen"


def test_a_retry_after_is_honoured_only_as_far_as_the_event_can_afford() -> None:
    """At most RETRY_AFTER_CAP_S, and never past a quarter of the time left to NotBefore; a short one as asked."""
    assert affordable_wait(86400, None) == RETRY_AFTER_CAP_S
    assert affordable_wait(86400, 3600) == RETRY_AFTER_CAP_S
    assert affordable_wait(60, 40) == 10
    assert affordable_wait(3, 3600) == 3
    assert affordable_wait(60, -5) == 0 and affordable_wait(None, 100) == 0


def test_a_short_retry_after_is_honoured_in_full_and_a_long_one_ends_at_another_paths_answer(clock) -> None:
    """Retry-After 3 s on an event's request: nothing more for that event before the 3 s, however soon another
    path is answered; Retry-After 86400: once 5 s of it passed, another path's answer ends it at the next tick."""
    from tests.store.test_store_exchange import EVENT as EXCHANGE_EVENT
    from tests.store.test_store_exchange import Rig

    for asked, quiet in ((3.0, 3.0), (86400.0, 5.0)):
        store = WholeStore(clock)
        rig = Rig(store, clock)  # type: ignore[arg-type]
        store.throttle_until = clock.monotonic() + 1000
        store.retry_after = asked
        rig.sync(("vm-a",), "vm-a", "ready")
        store.throttle_until = None
        sent = len(store.ops)
        for _ in range(int(quiet * 2) - 1):
            clock.advance(0.5)
            rig.exchange.store().read_body("budget/web/places")  # another path, answered
            rig.sync(("vm-a",), "vm-a", "ready")
            assert [op for op in store.ops[sent:] if op != "read"] == [], (asked, store.ops[sent:])
            sent = len(store.ops)
        clock.advance(1.0)
        rig.exchange.store().read_body("budget/web/places")
        rig.sync(("vm-a",), "vm-a", "ready")
        rig.sync(("vm-a",), "vm-a", "ready")
        assert "put" in store.ops[sent:], (asked, store.ops[sent:])
        assert rig.exchange.verdict(EXCHANGE_EVENT, ("vm-a",), "vm-a", 60)[1].action == "claim"
