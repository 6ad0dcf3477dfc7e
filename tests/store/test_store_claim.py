"""S2 on the store side: right before every send the claimer rechecks that its claim still holds (the store's ETag,
the monotonic deadline); a job or a request that raises leaves the event in a clean state, retried with backoff."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from datetime import datetime, timedelta
from types import SimpleNamespace

import pytest

import tests.needs_azure  # noqa: F401 - skips this module without the azure extra
from agent.clock import FakeClock
from agent.coordination.approver import Approver, Order
from agent.coordination.coordination_settings import AzureBlobConfig
from agent.coordination.store.store_backend import StoreBackend
from agent.coordination.store.store_protocol import (
    CLAIMED,
    READY,
    Item,
    Step,
    StoreError,
    approval_blob,
    approval_record,
)
from agent.health.health_store import HealthStore
from agent.model.gate_specs import NO_GATES
from agent.telemetry.metrics import Metrics
from tests.azurite import azurite  # noqa: F401 - the fixture
from tests.stopping import stopped_at_end
from tests.store.test_store_exchange import EVENT, MemoryStore, Rig

ME, TAKER = "web_a", "web_b"


def backend(clock: FakeClock, blobs: MemoryStore, metrics: Metrics | None = None) -> StoreBackend:
    b = StoreBackend(AzureBlobConfig(account_url="https://a.blob.core.windows.net"), token=lambda r, c: b"",
                     clock=clock, metrics=metrics or Metrics(), health=HealthStore(clock),
                     secret=lambda key, path: None, on_change=lambda: None, takeover_after=lambda: 60.0)
    stopped_at_end(b)
    b.exchange.client.open_store = lambda: blobs
    return b


def approver_like(b: StoreBackend, attempts: list[Callable[[], bool]], sent: list[str],
                  refused: list[str]) -> Callable[[float], bool]:
    """What the approver does with `post(within)`: each attempt (the first and each retry) is sent only if the
    backend says the claim still holds right before it; an attempt returns whether IMDS took it."""
    def post(within: float) -> bool:
        for attempt in attempts:
            why = b.claim_still_holds(EVENT)
            if why is not None:
                refused.append(why)
                return False
            sent.append(ME)
            if attempt():
                return True
        return False
    return post


def claim_and_post(b: StoreBackend, step: Step, retry_for: float, post: Callable[[float], bool]) -> None:
    """The real approver's steps 2 to 5 (`Approver._approve`) on the store backend: take the right (the claim),
    post within it with `post` (unless it came too late; a failed send's time is 0.0), settle it (`approved` or
    `released`)."""
    approver = SimpleNamespace(backend=b, _post=lambda order, within: None if post(within) else 0.0)
    order = Order(EVENT, ME, step.reason, NO_GATES, (ME,), step, None, retry_for, False)
    Approver._approve(approver, order)  # type: ignore[arg-type]


def take_over(blobs: MemoryStore) -> None:
    """Another VM rewrites the record with If-Match on the claimer's ETag (it found the claim takeover_after old)."""
    etag = blobs.blobs[approval_blob(EVENT)][1]
    assert blobs.replace(approval_blob(EVENT), approval_record(EVENT, TAKER, CLAIMED, 2), etag)


@pytest.mark.parametrize("paused, why", [(120, "past 30.0s"), (0, "another VM took the claim over")])
def test_a_claimer_paused_inside_its_retry_backoff_does_not_post_again_after_the_taker(
        clock: FakeClock, paused: float, why: str) -> None:
    """The first POST gets an IMDS 500; the claimer is paused for 2 x takeover_after inside its backoff while
    another VM takes the claim over (and posts). Resumed, it sends nothing more: one POST from it, the one IMDS
    refused (today: a second POST at +40 s). Caught by the monotonic deadline, or, for a freeze the monotonic
    clock did not count (0 s here), by the record's ETag."""
    blobs = MemoryStore()
    b = backend(clock, blobs)
    sent: list[str] = []
    refused: list[str] = []

    def imds_500_then_pause() -> bool:
        clock.advance(paused)
        take_over(blobs)
        return False

    claim_and_post(b, Step("claim", "every VM named is ready"), 60,
                   approver_like(b, [imds_500_then_pause, lambda: True], sent, refused))
    assert sent == [ME]
    assert len(refused) == 1 and why in refused[0]
    assert blobs.blobs[approval_blob(EVENT)][0]["by"] == TAKER


def test_a_claim_past_its_deadline_is_not_sent_even_if_nobody_took_it_yet(clock: FakeClock) -> None:
    """Paused 31 s after its claim (takeover_after 60 s) and the store still shows its claim: past half of
    takeover_after on the monotonic clock, so no send (a taker may be about to)."""
    blobs = MemoryStore()
    b = backend(clock, blobs)
    sent: list[str] = []
    refused: list[str] = []

    def pause() -> bool:
        clock.advance(31)
        return False

    claim_and_post(b, Step("claim", "ready"), 60, approver_like(b, [pause, lambda: True], sent, refused))
    assert sent == [ME] and "past 30.0s" in refused[0]
    assert blobs.blobs[approval_blob(EVENT)][0]["state"] == "released"


def test_a_claim_that_holds_is_confirmed_with_one_read_per_send(clock: FakeClock) -> None:
    """Nothing changed: the send goes out, after one read of the record (a listing of it: its ETag, its
    Last-Modified and the store's Date), and the record says approved."""
    blobs = MemoryStore()
    b = backend(clock, blobs)
    sent: list[str] = []
    refused: list[str] = []
    claim_and_post(b, Step("claim", "ready"), 60, approver_like(b, [lambda: True], sent, refused))
    assert (sent, refused) == ([ME], [])
    assert blobs.ops == ["create", "list", "replace"]
    assert blobs.blobs[approval_blob(EVENT)][0]["state"] == "approved"
    assert b.claim_still_holds(EVENT) == "this VM holds no claim on the event"


def test_a_claimer_whose_clock_missed_a_pause_sends_nothing_once_the_store_says_the_claim_is_old(
        clock: FakeClock) -> None:
    """A pause this VM's monotonic clock did not count (a suspend, a hypervisor freeze): by its own deadline no
    time passed, but by the store's clock the claim is takeover_after old and another VM may be taking it over
    right now, its write not landed yet. Nothing is sent (the model checker's freeze, tests/model)."""
    blobs = MemoryStore()
    b = backend(clock, blobs)
    sent: list[str] = []
    refused: list[str] = []
    listing = blobs.list_folder

    def frozen_for_a_minute(prefix: str) -> tuple[list[Item], datetime]:
        items, date = listing(prefix)
        return [replace(i, last_modified=date - timedelta(seconds=60)) for i in items], date

    def freeze() -> bool:
        blobs.list_folder = frozen_for_a_minute  # type: ignore[method-assign]
        return False

    claim_and_post(b, Step("claim", "ready"), 60, approver_like(b, [freeze, lambda: True], sent, refused))
    assert sent == [ME] and "60s old on the store's clock" in refused[0]


def test_a_store_that_cannot_confirm_the_claim_means_no_send(clock: FakeClock) -> None:
    """The store fails right before the send: no confirmation, no POST (the claim is taken over later)."""
    blobs = MemoryStore()
    b = backend(clock, blobs)
    sent: list[str] = []
    refused: list[str] = []

    def break_store() -> bool:
        blobs.fail = StoreError("unreachable", "store unreachable")
        return False

    claim_and_post(b, Step("claim", "ready"), 60, approver_like(b, [break_store, lambda: True], sent,
                                                                          refused))
    assert sent == [ME] and "cannot confirm the claim" in refused[0]


def test_a_listing_that_raises_clears_the_busy_flag_warns_and_is_retried(clock: FakeClock, logs: list[dict]) -> None:
    """A bug (or an answer nothing foresaw) raises inside a store job: the failure is counted and reported as a
    Warning, the event is retried after the backoff and settles (today: the event never sends another request)."""
    class Once(MemoryStore):
        raised = False

        def list_folder(self, prefix: str):
            if not self.raised:
                self.raised = True
                raise TypeError("'NoneType' object is not subscriptable")
            return super().list_folder(prefix)

    blobs = Once()
    errors: list[int] = []
    rig = Rig(blobs, clock)
    rig.exchange.count_error = lambda: errors.append(1)
    rig.exchange._lanes.on_error = rig.exchange.count_error
    vm = ("web_a",)
    rig.sync(vm, "web_a", READY)
    step = rig.exchange.verdict(EVENT, vm, "web_a", 60)[1]
    assert step.action == "wait" and "internal error" in step.reason
    assert rig.reports[-1][:2] == ("store", False) and "internal_error" in rig.reports[-1][2]
    assert errors == [1] and any(e["event"] == "lane.internal_error" for e in logs)
    clock.advance(1)
    rig.sync(vm, "web_a", READY)
    assert blobs.ops == ["put", "put", "list"]  # the marker again: the job that raised may not have written it
    assert rig.exchange.verdict(EVENT, vm, "web_a", 60)[1].action == "claim"
    assert rig.reports[-1] == ("store", True, "the store answers")


def test_against_azurite_a_claim_taken_over_with_the_listings_etag_is_no_longer_held(azurite, clock) -> None:
    """Against a real store: the claimer's check holds while the record is its own (a put's quoted ETag and the
    listing's bare one are the same version), and says why not once another VM took it over with If-Match on the
    ETag its listing showed."""
    from agent.coordination.store.store_claim import StoreClaims
    from agent.coordination.store.store_protocol import event_folder, parse_listing
    from tests.store.test_blob_store import open_store

    store = open_store(azurite)
    rig = Rig(store, clock)  # type: ignore[arg-type]
    claims = StoreClaims(rig.exchange)
    claim = claims.claim(EVENT, ME, Step("claim", "ready"))
    assert claim.won
    claims.hold(EVENT, claim)
    assert claims.holds(EVENT, 30) is None
    items, now = store.list_folder(event_folder(EVENT))
    seen = parse_listing(EVENT, items, now, (ME, TAKER)).approval
    assert seen is not None
    assert store.replace(approval_blob(EVENT), approval_record(EVENT, TAKER, CLAIMED, 2), seen.etag)
    assert "another VM took the claim over" in (claims.holds(EVENT, 30) or "")
    claims.let_go(EVENT)
    assert claims.holds(EVENT, 30) == "this VM holds no claim on the event"
    store.close()
