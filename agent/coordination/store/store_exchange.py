"""This VM's requests to the blob store for each event it coordinates: its marker, the event's listing, the claim.

One owner per piece of state: the loop owns every `EventState` (only `run`, `apply` and `verdict`
touch them, all on the loop's thread). Requests run on worker lanes, one lane per event so an
event's requests go in order, and hand back an immutable `Result` through a queue; `on_change`
wakes the loop, which applies the results on its tick. The claim, the confirmation and the
release run on the approver thread (right before and after the POST) and hand their results back
the same way (`store_claim`). The API reads `snapshot`, an immutable value the loop replaces on each tick. The
loop never waits on the store: `run` only queues.

Traffic (see DESIGN.md, "Coordinating through a blob store"): a VM writes its marker when it first
sees an event naming it (`preparing`) and when it becomes ready; once ready (and allowed to
approve) it lists the event's folder after its write and again in the background, backing off from
RECHECK_FIRST to `recheck_delay`'s cap, until the event is approved; the claim and its
confirmation. Nothing at all for events that do not name it.
"""

from __future__ import annotations

import dataclasses
import functools
import queue
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from agent.clock import Clock
from agent.coordination.store.store_answers import PROBE_EVERY_S, SharedClient, affordable_wait
from agent.coordination.store.store_answers import Store as Store  # re-exported: every path names it here
from agent.coordination.store.store_protocol import (
    APPROVED,
    Approval,
    Listing,
    Step,
    StoreError,
    event_folder,
    fleet_health,
    marker_blob,
    marker_record,
    next_step,
    not_ready,
    parse_listing,
    recheck_delay,
    retry_delay,
    same_etag,
    takeover_check_delay,
    vm_state,
)
from agent.lanes import Lanes
from agent.telemetry import logs

Mark = tuple[str, str]
"""A marker's content: (state, health)."""
STORE, RECORDS, FORGED = "store", "store_records", "store_marker"
"""The health reports (source `coordination`): the store's last answer, records the protocol did not write, and a
marker under this VM's name that it did not write (an Error: it holds the fleet gate)."""
Report = Callable[[str, bool, str], None]
"""(property, ok, description): a Warning when not ok (an Error for FORGED)."""
OTHER = "(another VM)"
"""Who holds a claim this VM just lost, until the next listing says."""


def internal_error(exc: Exception) -> StoreError:
    """An exception no store code turned into a StoreError, as one."""
    return StoreError("internal_error", f"internal error ({type(exc).__name__}: {str(exc)[:200]}); see maintd's log "
                                        "(lane.internal_error); retried")


@dataclass
class EventState:
    """What this VM knows of one event in the store (the loop's own)."""

    resources: tuple[str, ...] = ()
    me: str = ""
    wanted: bool = False
    marker: Mark | None = None
    busy: bool = False
    listing: Listing | None = None
    due: float = float("-inf")
    retry_at: float = float("-inf")
    checks: int = 0
    failures: int = 0
    error: StoreError | None = None
    problems: frozenset[str] = frozenset()
    odd: int = 0
    own_etag: str | None = None
    """The ETag of this VM's last marker write for the event (None: unknown, e.g. after a failed request)."""
    forged: str | None = None
    time_left: float | None = None
    """Seconds to the event's NotBefore at the last tick (None: not known): how much of a Retry-After it affords."""
    early_from: float = float("inf")
    """From when an answer on any path may end a Retry-After's wait (B6: one of PROBE_EVERY_S or less is kept)."""
    answered_mark: int | None = None
    """`Answers.count` at `early_from`: any answer after it ends the wait."""
    probe_at: float = float("-inf")


@dataclass(frozen=True)
class Result:
    """What one request (or the approver's claim) came to, handed from a worker to the loop."""

    event_id: str
    at: float
    sync: bool = True
    marker: Mark | None = None
    listing: Listing | None = None
    approval: Approval | None = None
    error: StoreError | None = None
    relist: bool = False
    own_etag: str | None = None
    seen: str | None = None
    """This VM's marker as its own read found it, while preparing: its ETag, "" when absent (None: not read)."""
    probe: bool = False
    """A read sent during a Retry-After's wait to learn whether the fault is over (B6)."""


@dataclass(frozen=True)
class EventView:
    event_id: str
    vms: tuple[tuple[str, str], ...]
    health: tuple[tuple[str, str], ...]
    approval: Approval | None
    error: str | None
    problems: tuple[str, ...]


@dataclass(frozen=True)
class Snapshot:
    """The store as the loop last saw it, for `maintd status`, `maintd fleet` and /v1/fleet."""

    store: str
    last_outcome: str = "no request yet"
    last_answer_at: float | None = None
    events: tuple[EventView, ...] = ()


class StoreExchange:
    """Sends each event's store requests and keeps what they said; see the module docstring for who owns what."""

    def __init__(self, open_store: Callable[[], Store], describe: str, clock: Clock, *,
                 on_change: Callable[[], None], report: Report, takeover_after: Callable[[], float],
                 count_error: Callable[[], None] = lambda: None, max_workers: int = 4) -> None:
        self.client = SharedClient(open_store)
        self.takeover_after = takeover_after
        self.clock = clock
        self.on_change = on_change
        self.report = report
        self.log = logs.get("coordinator")
        self.snapshot = Snapshot(describe)
        self._results: queue.SimpleQueue[Result] = queue.SimpleQueue()
        self._events: dict[str, EventState] = {}
        self.count_error = count_error
        self._lanes = Lanes(max_workers, "store", count_error)
        self._last: tuple[str, float | None] = ("no request yet", None)
        self._healthy: bool | None = None
        self.answers = self.client.answers
        """Answers from the store by any path through `store` (B6: the first ends every Retry-After's wait)."""

    # --- worker side -----------------------------------------------------------------------

    def store(self) -> Store:
        """The store client every path shares (`SharedClient`: opened on first use, on a worker)."""
        return self.client.get()

    def warm(self) -> None:
        """Open the store client on a worker now (the SDK's import, ~0.25 s of CPU), so the first event does not
        wait for it; no request is sent. A failure here is told by the first real request."""
        def open_quietly() -> None:
            try:
                self.store()
            except StoreError:
                pass

        self._lanes.submit("", open_quietly)

    def _sync(self, event_id: str, resources: tuple[str, ...], me: str, write: Mark | None, lists: bool,
              reads: bool, probe: bool = False) -> None:
        written = etag = seen = None
        try:
            store = self.store()
            if write is not None:
                etag = store.put(marker_blob(event_id, me), marker_record(event_id, me, *write))
                written = write
            listing = None
            if lists:
                items, server_time = store.list_folder(event_folder(event_id))
                listing = parse_listing(event_id, items, server_time, resources)
            elif reads:
                found = store.read(marker_blob(event_id, me))
                seen = "" if found is None else found[1]
            self.hand(Result(event_id, self.clock.monotonic(), marker=written, listing=listing, own_etag=etag,
                             seen=seen, probe=probe))
        except StoreError as exc:
            self.hand(Result(event_id, self.clock.monotonic(), marker=written, error=exc, probe=probe))

    def hand(self, result: Result) -> None:
        """Give the loop one result (from a worker lane or the approver thread) and wake it."""
        self._results.put(result)
        self.on_change()

    # --- loop side ---------------------------------------------------------------------------

    def run(self, event_id: str, resources: Sequence[str], me: str, marker: Mark, listing_wanted: bool,
            now: float, time_left: float | None = None) -> None:
        """Queue this tick's request for one event: write the marker if it changed; list after it and when due,
        but only while `listing_wanted` (this VM could claim); a VM still preparing reads its own marker when due
        instead, to notice one it did not write."""
        st = self._events.setdefault(event_id, EventState())
        st.resources, st.me, st.time_left = tuple(resources), me, time_left
        if listing_wanted and not st.wanted:
            st.due = float("-inf")  # it may claim now (ready, or an operator's go): look at once
        st.wanted = listing_wanted
        if st.busy:
            return
        if self._held_back(st, now) > 0:
            if now >= st.early_from and now >= st.probe_at:  # is the fault over? one cheap read tells
                st.probe_at, st.busy = now + PROBE_EVERY_S, True
                self._lanes.submit(event_id, functools.partial(self._sync, event_id, st.resources, me, None, False,
                                                               True, True), functools.partial(self._crashed, event_id))
            return
        write = marker if marker != st.marker else None
        settled = st.listing is not None and st.listing.approval is not None and st.listing.approval.state == APPROVED
        lists = listing_wanted and not settled and (write is not None or now >= st.due)
        reads = not listing_wanted and write is None and st.own_etag is not None and now >= st.due
        if write is None and not lists and not reads:
            return
        st.busy = True
        self._lanes.submit(event_id, functools.partial(self._sync, event_id, st.resources, me, write, lists, reads),
                           functools.partial(self._crashed, event_id))

    def _crashed(self, event_id: str, exc: Exception) -> None:
        """A request job raised (a bug, or an answer nothing foresaw): hand back a failure like any store error, so
        the loop clears the busy flag, reports it and retries with backoff (the marker is written again)."""
        self.hand(Result(event_id, self.clock.monotonic(), error=internal_error(exc)))

    def apply(self, now: float) -> None:
        """Take in every result handed back since the last tick; report failures and recoveries."""
        while True:
            try:
                r = self._results.get_nowait()
            except queue.Empty:
                break
            st = self._events.get(r.event_id)
            if st is None:
                continue
            if r.sync:
                st.busy = False
            st.marker = r.marker or st.marker
            if r.error is not None and r.probe:
                continue  # the fault goes on: the wait its Retry-After set stays as it was (said once already)
            if r.error is not None:
                st.own_etag = None if r.sync else st.own_etag  # a write may have landed unseen
                self._failed(r.event_id, st, r.error, now)
                continue
            self._answered(st, r)
            st.own_etag = r.own_etag or st.own_etag
            if r.listing is not None:
                self._listed(r.event_id, st, r.listing, now)
            elif r.sync:
                self._own_marker(r.event_id, st, r.seen, now)
            if r.approval is not None and st.listing is not None:
                st.listing = dataclasses.replace(st.listing, approval=r.approval)
            if r.relist:
                st.due = float("-inf")

    def _answered(self, st: EventState, r: Result) -> None:
        if self._healthy is False:
            self.log.info("store.recovered", previous=self._last[0])
        if self._healthy is not True:
            self.report(STORE, True, "the store answers")
        st.error, st.failures, self._healthy = None, 0, True
        self._last = ("ok", r.at)

    def _failed(self, event_id: str, st: EventState, error: StoreError, now: float) -> None:
        st.failures += 1
        asked = affordable_wait(error.retry_after, st.time_left)  # the store's Retry-After, as far as the event affords
        st.retry_at = now + max(retry_delay(st.failures), asked)
        st.early_from = now + min(asked, PROBE_EVERY_S) if asked else float("inf")
        st.answered_mark, st.probe_at = None, st.early_from
        if st.error is None or str(st.error) != str(error):
            self.log.warning("store.request_failed", event_id=event_id, outcome=error.outcome, error=str(error),
                             retry_in=round(st.retry_at - now, 1),
                             **({"retry_after_asked": error.retry_after, "retry_after_honoured": round(asked, 1)}
                                if error.retry_after else {}),
                             effect="this VM approves nothing it has not read from the store")
        self.report(STORE, False, f"{error.outcome}: {error}")
        st.error, self._healthy = error, False
        self._last = (f"{error.outcome}: {error}", self._last[1])

    def _listed(self, event_id: str, st: EventState, listing: Listing, now: float) -> None:
        st.listing = listing
        ready = len(st.resources) - len(not_ready(listing, st.resources))
        self.log.debug("store.listed", event_id=event_id, ready=ready, of=len(st.resources),
                       approval=listing.approval.state if listing.approval else None)
        st.checks += 1
        n = len(st.resources)
        takeover = takeover_check_delay(listing, st.me, self.takeover_after(), n, random.random())
        st.due = now + min(recheck_delay(st.checks, n), takeover if takeover is not None else float("inf"))
        own = listing.markers.get(st.me.casefold())
        if own is not None and own.etag:
            self._own_marker(event_id, st, own.etag, None)
        if st.marker is not None and (own is None or (own.state, own.health) != st.marker):
            self.log.warning("store.marker_missing", event_id=event_id, expected=st.marker[0],
                             found=own.state if own else None, effect="written again")
            st.marker = None  # the store lost it (emptied, deleted by hand): the next tick writes it again
        if listing.odd and (frozenset(listing.problems), listing.odd) != (st.problems, st.odd):
            self.log.warning("store.invalid_record", event_id=event_id, count=listing.odd,
                             problem=listing.problems[0], more=list(listing.problems[1:]),
                             effect="not counted as ready or approved")
        st.problems, st.odd = frozenset(listing.problems), listing.odd

    def _own_marker(self, event_id: str, st: EventState, seen: str | None, now: float | None) -> None:
        """This VM's marker as the store showed it (its ETag; "" absent): one it did not write is forged. The
        marker is written again and an Error holds the fleet gate until the event ends. `now`: after a read or
        a write alone, when to read again (the listing's schedule otherwise)."""
        if now is not None:
            st.checks += 1
            st.due = now + recheck_delay(st.checks, len(st.resources))
        if seen is None or (st.own_etag is not None and same_etag(seen, st.own_etag)):
            return
        st.marker = None  # written again on the next tick
        if seen == "" or st.own_etag is None:
            return
        st.forged = f"event {event_id}: a marker under this VM's name that it did not write was found and rewritten"
        self.log.error("store.marker_forged", event_id=event_id, vm=st.me, expected_etag=st.own_etag, found_etag=seen,
                       effect="rewritten; Error health coordination/store_marker holds the fleet gate",
                       hint="see README 'Per-VM identity' (an ABAC condition per VM)")
        self.report(FORGED, False, st.forged)
        st.own_etag = None

    def verdict(self, event_id: str, resources: Sequence[str], me: str, takeover_after: float,
                need_all_ready: bool = True) -> tuple[list[str], Step]:
        """Who is not recorded ready, and the protocol's next step, from what the store last said.

        A failing store, or no listing yet, means wait: this VM never approves on a guess. So does a failure's
        backoff while it lasts (a claim is a request like any other); a Retry-After's part of it ends at the first
        answer from the store by any path (B6).
        """
        st = self._events.get(event_id)
        if st is None or st.listing is None or st.error is not None:
            why = f"store: {st.error}" if st is not None and st.error is not None else "no answer from the store yet"
            return list(resources), Step("wait", why)
        if (left := self._held_back(st, self.clock.monotonic())) > 0:
            return not_ready(st.listing, resources), Step("wait", f"store: asked again in {left:.1f}s after a failure")
        return not_ready(st.listing, resources), next_step(st.listing, resources, me, takeover_after, need_all_ready)

    def _held_back(self, st: EventState, now: float) -> float:
        """Seconds this event's requests still wait after a failure: a Retry-After's wait ends at the first answer
        from the store by any path once PROBE_EVERY_S of it (or all of a shorter one) passed (B6)."""
        if now >= st.early_from:
            if st.answered_mark is None:
                st.answered_mark = self.answers.count  # the answers from now on end it
            elif self.answers.since(st.answered_mark):
                st.retry_at, st.early_from, st.answered_mark = float("-inf"), float("inf"), None
        return st.retry_at - now

    def forget(self, keep: set[str]) -> None:
        """Drop the events no longer pending (the loop's prune)."""
        for event_id in [e for e in self._events if e not in keep]:
            if self._events.pop(event_id).forged and not any(st.forged for st in self._events.values()):
                self.report(FORGED, True, "no marker under this VM's name that it did not write")

    def publish(self) -> Snapshot:
        """Replace the immutable snapshot the API reads."""
        views = tuple(EventView(event_id, tuple((n, vm_state(st.listing, n)) for n in st.resources),
                                tuple(fleet_health(st.listing, st.resources).items()),
                                st.listing.approval if st.listing else None,
                                str(st.error) if st.error else None, tuple(sorted(st.problems)))
                      for event_id, st in self._events.items())
        odd = next((f"event {v.event_id}: {v.problems[0]}" for v in views if v.problems), None)
        self.report(RECORDS, odd is None, odd or "every store record read is one the protocol wrote")
        self.snapshot = Snapshot(self.snapshot.store, self._last[0], self._last[1], views)
        return self.snapshot

    def wait_idle(self, timeout: float) -> bool:
        """Block until no store request is under way (tests, benchmarks)."""
        return self._lanes.wait_idle(timeout)

    def stop(self) -> None:
        self._lanes.shutdown()
        self.client.close()
