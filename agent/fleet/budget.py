"""The disruption budget as this VM takes part in it: one place in the group's record, taken before maintd
chooses to leave rotation, released once the VM is back (the rules are `budget_rules`, pure).

One owner: the loop owns everything here (`tick`, `gate`, `approval_blocked`, the views' snapshot). Each
store step (read the record, decide with the pure rules, write it back with If-Match, again on a conflict)
runs on a worker lane and hands an immutable `Outcome` back through a queue; the loop takes it in on its
next tick. The loop hands preparation an immutable `LeaveGate`: which pending events may leave rotation now
(this VM holds a place, or is forced) and which must return to it (a lost place). The store down means no place:
wait, and still prepare at the last safe moment (forced), with a Warning naming the store.

A place is held within its lease only, checked first in every loop pass (`look`); a lost one is revoked in the
gate, and `send_blocked` (the approver's recheck) reads the `hold` the loop publishes (B2, B3: `budget_lease`).

A release hands the freed place to the next waiter in the same write (`budget_rules.grant`); the worker then
sends that member a wake hint (`budget_wake`), and a hint received here (`wake`, an API thread) only raises a
flag: the loop reads the record on its next tick, at most once per WAKE_GAP. A waiter's own reads are the
fallback for a lost hint (`coordination.budget.fallback_poll`).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

from agent.clock import Clock
from agent.coordination.coordination_settings import BudgetConfig
from agent.coordination.store.store_answers import Answers, RetryWait
from agent.fleet.budget_lease import (
    Hold,
    Mine,
    approval_held,
    forced_by,
    forced_reason,
    health_words,
    lease_end,
    lease_margin,
    send_held,
)
from agent.fleet.budget_lease import Want as Want
from agent.fleet.budget_poll import Every, time_left, waiter_poll
from agent.fleet.budget_rules import (
    CHOSEN,
    FORCE,
    FORCED,
    READ,
    RELEASE,
    RENEW,
    TAKE,
    Action,
    Me,
    Places,
    capacity,
    counts,
    places_view,
)
from agent.fleet.budget_step import BudgetStore, Steps
from agent.fleet.budget_step import Outcome as Outcome
from agent.fleet.budget_step import step as step
from agent.fleet.budget_wake import WAKE_GAP, Hinter, WakeAnswer
from agent.model.budget_gate import LeaveGate
from agent.telemetry import logs

HEALTH = "budget"


class Budget:
    """This VM's place in its group's budget; thread use as in the module docstring."""

    def __init__(self, config: BudgetConfig, *, store: Callable[[], BudgetStore], describe: str, clock: Clock,
                 on_change: Callable[[], None], health: Callable[[str, str, str], None],
                 metrics: Any, needs: Callable[[], float], lead_time: Callable[[], float],
                 wake_sender: Hinter | None = None, url: str = "", answers: Answers | None = None,
                 rejoin_wait: Callable[[], float] = lambda: 0.0) -> None:
        """`url`: what this member writes as its address (shown only; "" none); `wake_sender` sends hints;
        `answers`: the store's answers on every path (B6: the first ends a Retry-After's wait); `rejoin_wait`: how
        long a member back in rotation keeps its place (B7)."""
        self.config, self.open_store, self.describe, self.clock = config, store, describe, clock
        self.on_change, self.health, self.metrics = on_change, health, metrics
        self.needs, self.lead_time, self.rejoin_wait = needs, lead_time, rejoin_wait
        self.log = logs.get("budget")
        self.me: Me | None = None
        self.group: str | None = config.group
        self.places: Places | None = None
        self.mine = Mine()
        self._said: set[str] = set()
        self.steps = Steps(config, lambda: self.open_store(), clock, metrics, health, on_change, wake_sender)
        self._results = self.steps.results
        self.wake_sender, self.url = wake_sender, url
        self._woken = threading.Event()
        self.snapshot: dict[str, Any] = {}
        self.hold = Hold()
        """This VM's place for the approver's recheck (`send_blocked`), replaced whole by the loop."""
        self._wants: tuple[Want, ...] = ()
        self._stamp = Every(config.member_ttl / 3, clock.monotonic())
        self._retry = RetryWait(answers)
        self._started: tuple[Want, ...] = ()
        self._lost_at: dict[str, datetime] = {}
        """When each place was lost (wall clock), for the fleet view."""

    def identify(self, vm: str, zone: str, fault_domain: str, scale_set: str) -> None:
        """This VM's name and topology, once IMDS told them; the group defaults to the scale set."""
        self.me = Me(vm, zone, fault_domain, self.url)
        self.group = self.config.group or scale_set or None
        if self.group is None:
            self.log.error("budget.no_group", reason="coordination.budget.group is required on a VM outside a scale "
                                                     "set", effect="no place can be taken: prepared at the last safe "
                                                                   "moment")

    # --- the loop -----------------------------------------------------------------------------------

    def look(self) -> LeaveGate:
        """B2, first in every loop pass (a VM resumed from a pause acts on nothing before it looked): the store's
        answers taken in, a place whose lease ended lost; what may leave rotation and what must return to it."""
        now = self.clock.monotonic()
        self._absorb(now)
        self._check_lease(now)
        return self._gate(self._wants, now)

    def tick(self, wants: Sequence[Want], out: bool, started: Sequence[Want] = ()) -> LeaveGate:
        """Take in the store's answers, send the next step, and say which events may leave rotation now (and which
        must return to it). `wants`: events whose preparation is due; `out`: this VM is out of rotation;
        `started`: the events it is out for (their preparation started; `committed` when the platform acts on one
        now: a place lost for it keeps the VM out, forced)."""
        now, wall = self.clock.monotonic(), self.clock.now()
        self._absorb(now)
        self._check_lease(now)
        self._wants, self._started = tuple(wants), tuple(started)
        m = self.mine
        if m.rejoin(out, now):
            self.log.info("budget.rejoining", event_id=m.event or min(m.forced, default=""), group=self.group,
                          seconds=self.rejoin_wait(), effect="back in rotation; keeps its place until the load "
                                                             "balancer can send it traffic again")
        if self._woken.is_set():
            self._woken.clear()
            if m.why is None and m.waiting_since is not None:  # a release may have handed this VM the place
                at = max(now, m.woken + WAKE_GAP)
                if at < m.due:
                    m.due = m.woken = at
        for w in m.note(wants, started, now, forced_by(self.needs(), self.lead_time(), wall)):
            self.log.warning("budget.forced", event_id=w.event_id, group=self.group,
                             reason=forced_reason(w.event_type, w.not_before))
        if self._retry.ended(now):
            m.due = min(m.due, now)  # B6: the store answered another path: the Retry-After's wait is over
        action, event = self._next(wants, out)
        if action and not m.busy and now >= m.due and self.me is not None and self.group is not None:
            m.busy = True
            self.steps.submit(self.group, action, self.me, event)
        self.health(HEALTH, *health_words(m, self.group, wants, self.describe))
        return self._gate(wants, now)

    def deadline(self) -> float:
        """When the loop must run its next pass at the latest (monotonic; inf: no need): `Mine.deadline`."""
        return self.mine.deadline(self.clock.monotonic(), self.rejoin_wait())

    def _gate(self, wants: Sequence[Want], now: float) -> LeaveGate:
        gate = self.mine.gate(wants, now)
        self.hold = self.mine.hold()
        return gate

    def _next(self, wants: Sequence[Want], out: bool) -> tuple[Action | None, str]:
        m = self.mine
        if (m.why is not None or m.waiting_since is not None or m.forced) and not wants and not out \
                and self.clock.monotonic() >= m.release_due(self.rejoin_wait()):
            if not m.failures:  # not the next poll: at once (a failed step keeps its backoff)
                m.due = min(m.due, self.clock.monotonic())
            # back in rotation, or no longer waiting: leave the record
            return RELEASE, m.event or m.waiting_for or min(m.forced, default="")
        if m.why is None and m.forced:
            return FORCE, min(m.forced)  # B3: written as forced, again until it lands
        if m.why is not None and self.clock.monotonic() >= m.renew_at:
            return (FORCE if m.why == FORCED else RENEW), m.event  # a forced holder renews by forcing again
        if m.why is not None:
            look, m.look = m.look, False
            return (READ, m.event) if look else (None, "")
        if self.places is None:
            return READ, ""  # once after a start: be counted among the members, find a place held before it
        held = self.places.holder(self._name())
        if m.waiting_for and held is not None and held.why == CHOSEN and held.event == m.waiting_for:
            return TAKE, m.waiting_for  # listed by another's write (a start finds it seated): confirm it (B1)
        if wants:
            return TAKE, wants[0].event_id
        return (READ, "") if self._stamp.due(self.clock.monotonic()) else (None, "")  # B5: counted while idle

    def _absorb(self, now: float) -> None:
        m = self.mine
        while True:
            try:
                o = self._results.get_nowait()
            except queue.Empty:
                return
            m.busy = False
            if o.error is not None:
                m.failures, m.failed_at = m.failures + 1, now
                left = time_left((w.not_before for w in self._wants), self.clock.now())
                m.due = now + self._retry.after_failure(o.error, m.failures, left, now)
                if m.error is None or str(m.error) != str(o.error):
                    self.log.warning("budget.store_failed", store=self.describe, outcome=o.error.outcome,
                                     error=str(o.error), effect="no place: this VM waits, and prepares at the last "
                                                                "safe moment")
                m.error = o.error
                continue
            m.failures, m.error, self.places = 0, None, o.places
            for vm in (v for v in o.freed if v.casefold() != self._name().casefold()):  # its own: budget.lost
                self.log.warning("budget.released", vm=vm, reason="did not renew its place for release_after "
                                                                  "(store time): never came back", by=self._name())
            self._took(o, now)

    def _took(self, o: Outcome, now: float) -> None:
        m = self.mine
        held = o.places.holder(self._name()) if o.places is not None else None
        lease = lease_end(o.sent_at, held.renewed, o.date, self.config.release_after) \
            if held is not None and o.date is not None else float("-inf")
        if m.why is None and o.result == "read" and not m.lost:  # after a start: out for what the record says
            m.out_seen = held is not None  # B7: it may have been out before it stopped; back now, it keeps the place
            if held is not None and held.why == CHOSEN:  # B1: maybe seated by another's write while it was down
                m.waiting_since, m.waiting_for = now, held.event  # confirmed by a TAKE of its own before it is out
            elif held is not None:  # forced before it: within what its entry's age leaves of the lease
                m.why, m.event, m.since, m.renew_at, m.lease_end = held.why, held.event, now, now, lease
                m.reasons.setdefault(held.event, held.why)
            for w in (w for w in self._started if held is None or held.event != w.event_id):
                self._lose("dropped", "after a start, the record does not list it for the event it is out for",
                           now, w.event_id)
            return
        if m.why == FORCED and o.result != "released" and (held is None or held.why != FORCED):
            m.renew_at = now  # a forced holder no longer listed: written again at once (B3)
        if m.why == CHOSEN and o.result != "released" and (held is None or held.event != m.event):
            return self._lose("dropped", "its entry is no longer in the record: another member dropped it after "
                                         "release_after without a renewal", now)
        if o.result in ("acquired", "forced") and m.why is None:
            waited = now - m.waiting_since if m.waiting_since is not None else 0.0
            m.seat(CHOSEN if o.result == "acquired" else FORCED, o.event, now, lease)
            self.metrics.budget_wait.observe(waited)
            if o.result == "acquired":  # a forced member said so when its last safe moment came
                self.log.info("budget.acquired", event_id=o.event, group=self.group, waited_seconds=round(waited, 1),
                              reason=o.reason)
            m.renew_at = now + self.config.release_after / 4
        elif o.result == "waiting":
            if m.waiting_since is None or m.waiting_for != o.event:
                m.waiting_since = m.waiting_since if m.waiting_since is not None else now
                self.log.info("budget.waiting", event_id=o.event, group=self.group, reason=o.reason,
                              effect="stays in rotation; prepares at its last safe moment if no place frees")
            m.waiting_for = o.event
            m.due = now + waiter_poll(self.config, o.places, self._name())  # B4: the head every second
        elif o.result == "released":
            if m.why is not None:
                self.log.info("budget.released", event_id=o.event, group=self.group, vm=self._name(),
                              held_seconds=round(now - (m.since or now), 1), was=m.why)
            m.clear()
        elif o.result in ("renewed", "acquired", "forced") and m.why is not None:
            m.renew_at, m.lease_end = now + self.config.release_after / 4, max(m.lease_end, lease)
        elif o.result == "read" and m.why is not None:
            m.due = now + 2.0  # a holder looking at the others' places for its event's approval

    def _check_lease(self, now: float) -> None:
        m = self.mine
        if m.why == CHOSEN and now >= m.lease_end:
            ra = self.config.release_after
            self._lose("lease_ended", f"no renewal confirmed its place within its lease (release_after {ra:g} s "
                                      f"less {lease_margin(ra):g} s, on this VM's clock)", now)

    def _lose(self, kind: str, reason: str, now: float, event: str | None = None) -> None:
        """B2: the place (for `event`, default its own) is lost. The event returns to rotation (the gate revokes
        it) and the member queues again, unless its last safe moment has come: then it stays out, forced (B3)."""
        m, event = self.mine, self.mine.event if event is None else event
        self.metrics.budget_lost.labels(kind).inc()
        self._lost_at[event] = self.clock.now()
        want = m.known.get(event)
        forced = m.lose(now, forced_by(self.needs(), self.lead_time(), self.clock.now()), reason, event)
        why = "the event is Started or approved: the platform acts now" if want is not None and want.committed \
            else "its last safe moment has come"
        self.log.warning("budget.lost", event_id=event, group=self.group, reason=reason, effect=(
            f"stays out of rotation, forced ({why}); written as forced" if forced else
            "returns to rotation (the completed phase runs), never approves on this place, queues again"))
        self.hold = m.hold()

    def _name(self) -> str:
        return self.me.vm if self.me else ""

    # --- the coordinator ------------------------------------------------------------------------------

    def approval_blocked(self, event_id: str, resources: Sequence[str]) -> str | None:
        """Why this event may not be approved early yet (None: it may); said once when it names more members
        than the budget has places (they are forced at their last safe moment; approval waits for them)."""
        m = self.mine
        cap = capacity(self.config.max_unavailable, len(self.places.members) if self.places else 1)
        if len(resources) > cap and event_id not in self._said:
            self._said.add(event_id)
            self.log.warning("budget.event_too_large", event_id=event_id, members=len(resources), places=cap,
                             effect="the members beyond the budget prepare at their last safe moment; early approval "
                                    "waits for every member to hold a place or be forced")
        why = approval_held(resources, event_id, self.places, self._name(), self.hold, self.clock.monotonic())
        if why is not None and m.why is not None:
            m.look = True  # look again (the "read" answer paces it): the others' places
        return why

    def send_blocked(self, event_id: str, resources: Sequence[str]) -> str | None:
        """The approver's recheck immediately before every send (its thread; reads the `hold` snapshot): None
        unless this VM is named and no longer holds its place for the event within its lease (B2)."""
        return send_held(resources, event_id, self._name(), self.hold, self.clock.monotonic())

    def reason_for(self, event_id: str) -> str | None:
        """`chosen` or `forced`: why this VM left rotation for the event (None: the budget did not govern it)."""
        return self.mine.reasons.get(event_id)

    def publish(self) -> dict[str, Any]:
        """The group for `maintd fleet` and /v1/fleet (an immutable copy the API reads)."""
        places = self.places or Places()
        view = {"group": self.group, "max_unavailable": self.config.max_unavailable,
                "places": capacity(self.config.max_unavailable, len(places.members) or 1),
                "spread": self.config.spread, "members_known": len(places.members), **places_view(places),
                "store_error": str(self.mine.error) if self.mine.error else None,
                "lost": self.mine.lost_view(self._lost_at), "odd_records": self.steps.records.counted}
        for state, n in counts(places).items():
            self.metrics.budget_members.labels(state).set(n)
        self.snapshot = view
        return view

    def wake(self, body: Any) -> WakeAnswer:
        """A wake hint (an API thread): read the record on the next tick if waiting. It carries no authority and
        is checked for nothing but its shape; a flood costs at most one read per WAKE_GAP."""
        vm = body.get("vm") if isinstance(body, dict) else None
        if body is not None and (not isinstance(body, dict) or not isinstance(vm, (str, type(None)))):
            raise ValueError('body must be {"group": "...", "vm": "this VM\'s name"} or empty')
        mine = vm is None or vm.casefold() == self._name().casefold()
        if mine:
            self.metrics.budget_wake.labels("received").inc()
            self._woken.set()
            self.on_change()
        return {"woken": mine}

    def wait_idle(self, timeout: float) -> bool:
        return self.steps.wait_idle(timeout)

    def stop(self) -> None:
        self.steps.stop()
