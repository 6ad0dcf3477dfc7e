"""Holds each event's scheduled-phase work until the time its plan (`agent.prepare.prepare_plan`)
says, then hands it on: the one way into the runner (`Runs`: the handler runner's `submit`, `resume`
and `restore`), each called from one place here (`_hand_on`, `resume`, `_restore`).

The daemon gives every transition to `submit`: a Scheduled event naming this VM that appears before
its preparation time is held; everything else (started and completed phases, events for other VMs,
events due at once) is handed on at once. After a restart the daemon gives the events it knew to
`resume`, which holds what is not due and hands the rest to the runner's `resume`. `tick`, once per
loop pass with the pass's `Tick` (its clock reading, tracked events and profile in force: the ones
the coordinator decides on), re-plans the pending events when the config was reloaded, the profile
in force changed or an event's NotBefore moved, and releases what is due. The loop's calls take the
time from the pass (`submit`, `resume` and `wanting` are handed its `now`); only an operator's
`release`, on the API's thread, reads the clock. An event whose preparation started is never held
again: re-planning only updates its approval side. The start is recorded in the state store (result
key `preparation`), so a restart holds what was held and resumes what had started; a held event that
starts or vanishes drops its held work. Plans and each change of them go to the audit journal.
An event the disruption budget revokes (its place was lost, `LeaveGate.revoked`) returns the VM to rotation as
after a cancel (the runner's `restore`: the completed phase) and is held again in a new round (`run_records`):
once it may leave again its scheduled phase runs anew.
Every record and journal line goes through the store's background writer: the loop never waits on
the disk (a failed write is kept in memory and reported by the loop's `state/write` health).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping
from datetime import datetime
from typing import Protocol

from agent.clock import Clock
from agent.loop.tick import Tick
from agent.model.approval import ApprovalView
from agent.model.budget_gate import NO_BUDGET, LeaveGate
from agent.model.events import SCHEDULED, Event
from agent.model.outcomes import PHASE_SCHEDULED, PREPARATION_HELD, PREPARATION_STARTED
from agent.model.timefmt import iso_z, parse_iso
from agent.model.tracker import APPEARED, VANISHED, Tracked, Transition
from agent.policy.approval_policy import NOW, Profile
from agent.prepare.prepare_plan import Plan, PlanView, PrepareConfig, make_plan, with_coordination
from agent.prepare.run_records import ROUND_KEY, RunKey, restoring, round_of
from agent.state.state_store import Store
from agent.telemetry import logs
from agent.telemetry.metrics import Metrics

PREPARATION_KEY = "preparation"


def _pending(event_status: str, names_self: bool) -> bool:
    return names_self and event_status == SCHEDULED


def _same_open_window(a: Plan, b: Plan, now: datetime) -> bool:
    """Both plans find the same window open now (one open "always" starts when it was planned)."""
    return a.window is not None and b.window is not None and a.window.start <= now and b.window.start <= now \
        and (a.window.profile, a.window.end) == (b.window.profile, b.window.end)


class Runs(Protocol):
    """The handler runner as the preparation hands it work (`handler_runner.Runner`); nothing else does."""

    def submit(self, tr: Transition) -> None:
        """Queue the phase a transition starts."""

    def resume(self, tracked: dict[str, Tracked]) -> None:
        """After a restart: settle interrupted runs and queue the phase each event is in."""

    def restore(self, event: Event, names_self: bool, rnd: int) -> None:
        """A lost budget place (B2): cut the scheduled work and return to rotation, in round `rnd`."""


class Preparation:
    """Held scheduled-phase work and the plan of every pending event naming this VM; thread-safe views."""

    def __init__(self, *, store: Store, clock: Clock, metrics: Metrics, runner: Runs,
                 profiles: tuple[Profile, ...], prepare: PrepareConfig, budget: bool = False) -> None:
        """`runner`: where the work goes, once due (`Runs`)."""
        self.store = store
        self.clock = clock
        self.metrics = metrics
        self.runner = runner
        self.profiles = profiles
        self.prepare = prepare
        self.log = logs.get("preparation")
        self._lock = threading.Lock()
        self._held: dict[str, Transition] = {}
        self._plans: dict[str, Plan] = {}
        self._profile: str | None = None
        self._reconfigured = False
        self._gate = LeaveGate(True) if budget else NO_BUDGET
        """The disruption budget's last word (`tick`): until the first, nothing leaves rotation early."""

    # --- the daemon's calls ---------------------------------------------------------------

    def configure(self, profiles: tuple[Profile, ...], prepare: PrepareConfig) -> None:
        """A reloaded config: pending events are re-planned on the next tick."""
        if (profiles, prepare) != (self.profiles, self.prepare):
            self.profiles, self.prepare, self._reconfigured = profiles, prepare, True

    def submit(self, transitions: list[Transition], now: datetime) -> None:
        """Hold or pass on each transition (the daemon's transition listener; `now`: the pass's clock reading)."""
        for tr in transitions:
            eid = tr.event.event_id
            if tr.kind == APPEARED and _pending(tr.event.status, tr.names_self):
                plan = self._replan(tr.event, APPEARED, now)
                if plan.due(now) and self._gate.lets(eid):
                    self._start(tr, plan, "due", now, held=False)
                else:
                    with self._lock:
                        self._held[eid] = tr
                continue
            if tr.kind == VANISHED or tr.event.status != SCHEDULED:
                self._forget(eid, VANISHED if tr.kind == VANISHED else f"event is {tr.event.status}")
            self._hand_on(tr)
        self._export()

    def resume(self, tracked: Mapping[str, Tracked], now: datetime) -> None:
        """After a restart: the events whose work resumes now go to the runner's `resume`; the others are held. A
        return to rotation for a lost place (its round's `completed` phase) runs again first, for what a restart cut
        of it."""
        out: dict[str, Tracked] = {}
        for eid, t in tracked.items():
            if _pending(t.event.status, t.names_self) and (rnd := restoring(self.store.results(eid))) is not None:
                self._restore(t.event, t.names_self, rnd)  # a return to rotation a restart cut: what is left of it
            if _pending(t.event.status, t.names_self) and not self.started(eid):
                plan = self._replan(t.event, "restart", now)
                if not plan.due(now) or not self._gate.lets(eid):
                    with self._lock:
                        self._held[eid] = Transition(APPEARED, t.event, True, t.first_seen)
                    continue
                self._record_start(eid, plan, "due", now)
            elif _pending(t.event.status, t.names_self):
                self._plans[eid] = self._as_started(eid, make_plan(t.event, self.profiles, self.prepare, now))
            out[eid] = t
        self._export()
        self.runner.resume(out)

    def wanting(self, now: datetime) -> list[Event]:
        """The held events whose plan says preparation is due: what the disruption budget is asked a place for."""
        with self._lock:
            return [tr.event for eid, tr in self._held.items()
                    if (plan := self._plans.get(eid)) is not None and plan.due(now)]

    def tick(self, tick: Tick, gate: LeaveGate = NO_BUDGET) -> None:
        """Re-plan what changed, release what is due (and, under a disruption budget, let leave rotation by
        `gate`, the budget's word handed from the loop's thread), export the next preparation times."""
        tracked, now, profile = tick.tracked, tick.now, tick.profile.name
        self.revoke(gate, tracked, now)
        cause = "reload" if self._reconfigured else "profile" if profile != self._profile and self._profile else None
        self._reconfigured, self._profile = False, profile
        with self._lock:
            held = dict(self._held)
        for eid, tr in held.items():
            t = tracked.get(eid)
            if t is None:
                continue
            if t.event != tr.event:  # a NotBefore moved, Resources changed
                with self._lock:
                    if eid in self._held:  # not released by an operator meanwhile
                        self._held[eid] = dataclasses.replace(tr, event=t.event)
                if cause is None:
                    self._replan(t.event, "event_changed", now)
        if cause is not None:
            for eid, t in tracked.items():
                if eid in self._plans and _pending(t.event.status, t.names_self):
                    self._replan(t.event, cause, now)
        for eid, tr in held.items():
            plan = self._plans.get(eid)
            if eid in tracked and plan is not None and plan.due(now) and gate.lets(eid):
                self._start(dataclasses.replace(tr, event=tracked[eid].event), plan, "due", now, held=True)
        self._export()

    def revoke(self, gate: LeaveGate, tracked: Mapping[str, Tracked], now: datetime) -> None:
        """Take the budget's word (the loop's thread, first in every pass, and in `tick`): each event it revokes
        whose preparation started in this round returns the VM to rotation as after a cancel and is held again,
        in a new round, until the budget lets it leave again (B2)."""
        self._gate = gate
        for eid in sorted(gate.revoked):
            t = tracked.get(eid)
            if t is None or not _pending(t.event.status, t.names_self) or not self.started(eid):
                continue
            rnd = round_of(self.store.results(eid))
            self.log.warning("preparation.returned", event_id=eid, round=rnd, reason="its place in the disruption "
                             "budget was lost", action="back in rotation as after a cancel; prepared again (round "
                             f"{rnd + 1}) once it may leave")
            # the new round and the restore it owes first: any later write of the state (the restore's own
            # `running` record) carries them, so a restart after a kill -9 runs the restore again
            self.store.record(eid, ROUND_KEY, {"round": rnd + 1, "at": iso_z(now), "reason": "place lost",
                                               "restore": rnd}, journal="preparation.returned", wait=False)
            self._restore(t.event, t.names_self, rnd)
            with self._lock:
                self._held[eid] = Transition(APPEARED, t.event, True, t.first_seen)
        if gate.revoked:
            self._export()

    def release(self, event_id: str, reason: str) -> bool:
        """Start a held event's preparation now (an operator approved it); False when none is held."""
        with self._lock:
            tr, plan = self._held.get(event_id), self._plans.get(event_id)
        if tr is None or plan is None:
            return False
        now = self.clock.now()
        plan = dataclasses.replace(plan, prepare_at=now, prepare_reason=reason,
                                   prepare_detail=f"{reason}: preparation started at once")
        started = self._start(tr, plan, reason, now, held=True)
        self._export()
        return started

    def started(self, event_id: str) -> bool:
        """Whether preparation for the event has started in its round (recorded, or a scheduled handler has run)."""
        results = self.store.results(event_id)
        rnd, rec = round_of(results), results.get(PREPARATION_KEY)
        return (rec is not None and rec.get("round", 1) == rnd) or any(
            (run := RunKey.parse(k)) is not None and run.phase == PHASE_SCHEDULED and run.round == rnd for k in results)

    def view(self, event_id: str, coordination: ApprovalView) -> PlanView | None:
        """The `plan` object of /v1/events/{id}: the plan, whether work is held, what holds the approval."""
        with self._lock:
            plan = self._plans.get(event_id)
            held = event_id in self._held
        if plan is None:
            return None
        return {**with_coordination(plan.to_json(), coordination),
                "preparation": PREPARATION_HELD if held else PREPARATION_STARTED}

    # --- inside ---------------------------------------------------------------------------

    def _replan(self, event: Event, cause: str, now: datetime) -> Plan:
        """A fresh plan; an event already preparing keeps its preparation side. Logged and journaled when it changed."""
        eid = event.event_id
        try:
            plan = make_plan(event, self.profiles, self.prepare, now)
        except Exception as exc:  # never lose an event to a planning bug: prepare at once, as without a plan
            self.log.error("plan.failed", event_id=eid, error=repr(exc), exc_info=True, action="prepare at once")
            plan = Plan(now, "now", f"planning failed ({type(exc).__name__}): prepare at once", None, "no_window",
                        "planning failed: see the plan.failed log line", event.not_before, NOW, None)
        with self._lock:
            previous = self._plans.get(eid)
            if previous is not None and eid not in self._held:
                plan = dataclasses.replace(plan, prepare_at=previous.prepare_at, prepare_reason=previous.prepare_reason,
                                           prepare_detail=previous.prepare_detail, lead_time=previous.lead_time)
            if previous is not None and _same_open_window(previous, plan, now):  # not a change: when it was seen
                plan = dataclasses.replace(plan, window=previous.window, approve_not_before=previous.approve_not_before,
                                           approve_detail=previous.approve_detail)
            self._plans[eid] = plan
        if previous is None or previous.to_json() != plan.to_json():
            fields = {"event_id": eid, "event_type": event.event_type, "cause": cause, **plan.to_json()}
            self.log.info("plan.made" if previous is None else "plan.changed", **fields)
            self.store.journal("plan.made" if previous is None else "plan.changed", wait=False, **fields)
        return plan

    def _as_started(self, event_id: str, plan: Plan) -> Plan:
        """`plan` with the preparation side recorded when the event's preparation started (if it was)."""
        rec = self.store.result(event_id, PREPARATION_KEY)
        if rec is None:
            return plan
        try:
            planned = parse_iso(rec["planned_at"])
        except (KeyError, TypeError, ValueError, AttributeError):  # a record of any shape: not started as planned
            return plan
        return dataclasses.replace(plan, prepare_at=planned, prepare_reason=str(rec.get("reason", "")),
                                   prepare_detail=str(rec.get("detail", "")),
                                   lead_time=rec.get("lead_time", plan.lead_time))

    def _start(self, tr: Transition, plan: Plan, reason: str, now: datetime, *, held: bool) -> bool:
        """Hand the work to the runner; a held one only by the thread that takes it out (loop or API)."""
        eid = tr.event.event_id
        with self._lock:
            if held and self._held.pop(eid, None) is None:
                return False
            self._plans[eid] = plan
        self._record_start(eid, plan, reason, now)
        self._hand_on(tr)
        return True

    def _hand_on(self, tr: Transition) -> None:
        """The one way a transition's work reaches the runner: passed straight on (`submit`), or started once due
        (`_start`: from `submit`, `tick` or an operator's `release`)."""
        self.runner.submit(tr)

    def _restore(self, event: Event, names_self: bool, rnd: int) -> None:
        """The one way a lost place's return to rotation reaches the runner (`revoke`, or `resume` after a
        restart)."""
        self.runner.restore(event, names_self, rnd)

    def _record_start(self, event_id: str, plan: Plan, reason: str, now: datetime) -> None:
        record = {"status": "started", "at": iso_z(now), "planned_at": iso_z(plan.prepare_at),
                  "reason": plan.prepare_reason, "detail": plan.prepare_detail, "lead_time": plan.lead_time,
                  "by": reason, **({"round": rnd} if (rnd := round_of(self.store.results(event_id))) > 1 else {})}
        self.log.info("preparation.started", event_id=event_id, reason=plan.prepare_reason, by=reason,
                      late_seconds=round(max(0.0, (now - plan.prepare_at).total_seconds()), 1))
        self.store.record(event_id, PREPARATION_KEY, record, journal="preparation.started", wait=False)

    def _forget(self, event_id: str, why: str) -> None:
        with self._lock:
            held = self._held.pop(event_id, None)
            if why == VANISHED:
                self._plans.pop(event_id, None)
        if held is not None:
            self.log.info("preparation.dropped", event_id=event_id, reason=why)
            self.store.journal("preparation.dropped", wait=False, event_id=event_id, reason=why)

    def _export(self) -> None:
        """maintd_event_prepare_timestamp_seconds: the earliest held preparation time per event type."""
        nxt: dict[str, datetime] = {}
        with self._lock:
            for eid, tr in self._held.items():
                plan = self._plans.get(eid)
                if plan is not None:
                    label = tr.event.type_label
                    nxt[label] = min(nxt.get(label, plan.prepare_at), plan.prepare_at)
        self.metrics.swap(self.metrics.event_prepare, {(label,): when.timestamp() for label, when in nxt.items()})
