"""`pacemaker`: move a Pacemaker cluster's resources off this node before maintenance, never take the
last nodes, and report ready the moment the node is empty (so the POST follows the move).

`scheduled`: under the cluster-wide lock (a CIB element with a fixed id, which one `cibadmin
--create` wins; decision 0240), check that `min_online` other nodes stay online (standby, offline,
maintenance mode and nodes another maintd claimed do not count), then claim the node for the event
and put it in standby (`--lifetime reboot`), and release the lock. Ready once no resource is active
on the node and each one that ran there runs elsewhere. While `min_online` would break, it holds:
no standby, a Warning and a `pacemaker.hold` line, tried again each second until NotBefore (where
the platform goes ahead anyway). An event naming every node is an Error, and nothing is put in
standby. A resource that cannot leave within `move_timeout` (capped by NotBefore), or whose stop
failed, is an Error naming it: the node comes out of standby again (the resource runs until the
platform takes the node) and there is no early approval.

`completed` (or the event canceled): out of standby, wait until the node is online and may run
resources again, then release the claim. The keeper (`keep`) brings the node back when maintd finds
its own claim for an event that is gone (a restart after the reboot), renews the claim while the
event lasts, clears another node's standby whose claim lapsed (its maintd is gone for good), and
keeps the node's cluster state in health (`pacemaker`, `<name>/node`) and metrics.
"""

from __future__ import annotations

import secrets
import threading
from dataclasses import dataclass
from typing import Any

from agent.errors import kept_in_memory
from agent.handlers.base import CANCELED, FAILED, OK, Context, Handler, Result, Services, Settings
from agent.handlers.pacemaker_cli import Cluster, CommandError
from agent.handlers.pacemaker_state import (
    LOCK_TTL,
    NODE_NAME,
    Claim,
    ClusterView,
    Lock,
    Verdict,
    claim_expiry,
    decide,
    live,
    moved,
    safe_event_id,
    summary,
)
from agent.handlers.silences import impact
from agent.health.health_store import HealthState
from agent.model.config_schema import duration, integer, opt, text
from agent.telemetry import logs

SOURCE = "pacemaker"
"""The health SourceId of the handler's reports (`maintd health`, `maintd status`)."""
RETRY = 1.0
"""Seconds between tries while holding (min_online) or while another node holds the lock."""
POLL = 0.1
"""Seconds between looks at the cluster while resources move or the node comes back."""
KEEP_INTERVAL = 10.0
"""Seconds between the keeper's looks at the cluster (state in health, claims renewed or swept)."""
_LOCKS: dict[tuple[str, str], threading.Lock] = {}
_LOCKS_LOCK = threading.Lock()


def _event_lock(handler: str, event_id: str) -> threading.Lock:
    """One lock per (handler, event): a `scheduled` run's take and a `completed` run's release never interleave."""
    with _LOCKS_LOCK:
        return _LOCKS.setdefault((handler, event_id), threading.Lock())


def _node_name(value: Any) -> str:
    if value == "auto":
        return "auto"
    return str(text(NODE_NAME, "auto, or the node's name in the cluster (crm_node -n)")(value))


@dataclass(frozen=True)
class PacemakerOptions:
    node: str = opt(_node_name, "auto", "this node's name in the cluster; auto: what `crm_node -n` says")
    min_online: int = opt(integer(0, 100), 1, "cluster nodes that must stay online besides this one, or maintd holds")
    move_timeout: float = opt(duration(1, 86400), 600.0,
                              "longest wait for the resources to leave the node (capped by NotBefore)")


class PacemakerHandler(Handler):
    type_name = "pacemaker"
    Options = PacemakerOptions
    defaults = {"timeout": 3600.0}
    """A hold lasts until NotBefore: the run's budget is the time left before it (the runner caps it)."""

    def __init__(self, spec: Any, services: Services, cluster: Cluster | None = None) -> None:
        super().__init__(spec, services)
        self.cluster = cluster or Cluster()
        self.log = logs.get("pacemaker")
        self._me: str | None = None
        self._last_keep = float("-inf")
        services.metrics.init_pacemaker(spec.name)

    def minimum_timeout(self, settings: Settings) -> float:
        return float(self.options.move_timeout) + 5.0

    def wanted_timeout(self, settings: Settings, configured: float) -> float:
        """A hold may last until NotBefore: only a budget under the move's own time is short."""
        return self.minimum_timeout(settings)

    # --- who and what -------------------------------------------------------------------------

    def me(self) -> str:
        if self._me is None:
            name = self.options.node if self.options.node != "auto" else self.cluster.node_name()
            _node_name(name)  # crm_node's answer is held to the same pattern before it reaches a command line
            self._me = name
        return self._me

    def _fail(self, reason: str, event_id: str, detail: str) -> Result:
        self.services.metrics.pacemaker_errors.labels(self.spec.name, reason).inc()
        self.services.health.set(SOURCE, f"{self.spec.name}/event", HealthState.ERROR, f"event {event_id}: {detail}")
        self.log.error(f"pacemaker.{reason}", handler=self.spec.name, event_id=event_id, detail=detail)
        return Result(FAILED, detail)

    def _note(self, eid: str, **fields: Any) -> None:
        with kept_in_memory():
            self.set_note(eid, {**(self.note(eid) or {}), **fields})

    # --- scheduled ------------------------------------------------------------------------------

    def scheduled(self, ctx: Context) -> Result:
        eid = ctx.event.event_id
        clock = self.services.clock
        end = clock.monotonic() + max(0.0, ctx.timeout - 1.0)
        try:
            me = self.me()
            verdict, before = self._take_until(ctx, me, end)
        except CommandError as exc:
            return self._command_failed(eid, exc)
        if verdict is None:
            return Result(CANCELED, "the event left the document before the node was taken out")
        if verdict.action == "whole_cluster":
            return self._fail("whole_cluster", eid, verdict.reason + "; nothing was put in standby")
        if verdict.action == "hold":
            detail = (f"held until NotBefore: {verdict.reason}; the platform goes ahead at NotBefore, with "
                      "this node's resources still on it")
            self.services.metrics.pacemaker_errors.labels(self.spec.name, "held").inc()
            self.services.health.set(SOURCE, f"{self.spec.name}/hold", HealthState.WARNING, f"event {eid}: {detail}")
            self.log.warning("pacemaker.held", handler=self.spec.name, event_id=eid, detail=detail)
            return Result(FAILED, detail)
        return self._wait_moved(ctx, me, before, min(end, clock.monotonic() + float(self.options.move_timeout)))

    def _take_until(self, ctx: Context, me: str, end: float) -> tuple[Verdict | None, tuple[str, ...]]:
        """Try the take each RETRY until it is done, refused for good, or `end`; (None, ()) when cut short."""
        eid, held = ctx.event.event_id, ""
        verdict = Verdict("hold", "another node's maintd held the cluster's lock all along")
        while True:
            with _event_lock(self.spec.name, eid):
                if ctx.cancel.is_set():
                    return None, ()
                got = self._try_take(ctx, me)
            if got is not None:
                verdict, before = got
                if verdict.action != "hold":
                    self.services.health.remove(SOURCE, f"{self.spec.name}/hold")
                    return verdict, before
                if verdict.reason != held:
                    held = verdict.reason
                    self._hold(eid, verdict.reason)
            if self.services.clock.monotonic() + RETRY > end:
                return verdict, ()
            if ctx.sleep(RETRY if got is not None else POLL):
                return None, ()

    def _hold(self, eid: str, reason: str) -> None:
        self.services.metrics.pacemaker_holds.labels(self.spec.name).inc()
        self.services.health.set(SOURCE, f"{self.spec.name}/hold", HealthState.WARNING,
                                 f"event {eid}: holding, not in standby: {reason}; tried again every {RETRY:g}s "
                                 "until NotBefore, when the platform goes ahead")
        self.log.warning("pacemaker.hold", handler=self.spec.name, event_id=eid, reason=reason,
                         action="not in standby; tried again until NotBefore, when the platform goes ahead")
        self._note(eid, state="holding", summary=f"holding: {reason}")

    def _try_take(self, ctx: Context, me: str) -> tuple[Verdict, tuple[str, ...]] | None:
        """One try under the cluster's lock; None when another node holds the lock now. A look without the lock
        comes first: a hold writes nothing to the CIB (every change in crm_config makes the scheduler run)."""
        wall = self.services.clock.now().timestamp()
        ev = ctx.event
        seen = self.cluster.view()
        show(self.services, self.spec.name, me, seen)
        first = decide(seen, self.cluster.claims(), me, safe_event_id(ev.event_id), ev.resources,
                       self.options.min_online, wall)
        if first.action in ("hold", "whole_cluster"):
            return first, ()
        lock = Lock(me, secrets.token_hex(4), wall + LOCK_TTL)
        if not self.cluster.take_lock(lock):
            sweep_lock(self.cluster, self.log, self.spec.name, wall)
            return None
        try:
            view, claims = self.cluster.view(), self.cluster.claims()
            sid = safe_event_id(ev.event_id)
            verdict = decide(view, claims, me, sid, ev.resources, self.options.min_online, wall)
            if verdict.action == "resume":
                self.log.info("pacemaker.resumed", handler=self.spec.name, event_id=ev.event_id, node=me,
                              reason="the node was already taken out for this event (an earlier run was cut short)")
                return verdict, tuple((self.note(ev.event_id) or {}).get("before") or ())
            if verdict.action != "take":
                return verdict, ()
            not_before = ev.not_before.timestamp() if ev.not_before else None
            claim = Claim(me, sid, claim_expiry(not_before, wall, impact(ev.event_type, ev.duration_seconds)))
            if not self.cluster.put_claim(claim):  # a lapsed claim of ours for another event: make it this one
                self.cluster.renew_claim(claim)
            before = view.on(me)
            self._note(ev.event_id, state="taking", node=me, before=list(before), summary="going into standby")
            self.cluster.standby(me, True)
            self.services.metrics.pacemaker_standby_total.labels(self.spec.name).inc()
            self.log.info("pacemaker.standby", handler=self.spec.name, event_id=ev.event_id, node=me,
                          resources=list(before), reason=verdict.reason)
            return verdict, before
        finally:
            self.cluster.drop_lock(lock)

    def _wait_moved(self, ctx: Context, me: str, before: tuple[str, ...], end: float) -> Result:
        eid, clock = ctx.event.event_id, self.services.clock
        t0 = clock.monotonic()
        while True:
            view = self.cluster.view()
            show(self.services, self.spec.name, self._me or "", view)
            state = moved(view, me, before)
            if state.failed:
                return self._cannot_leave(ctx, me, state.failed, "its stop failed or it is blocked or unmanaged")
            if state.done:
                took = clock.monotonic() - t0
                self.services.metrics.pacemaker_move_seconds.labels(self.spec.name).observe(took)
                where = ", ".join(f"{r} to {'/'.join(view.running(r, me)) or '-'}" for r in before) or "none were here"
                detail = f"{me} in standby and empty: resources moved ({where})"
                self._note(eid, state="out", summary=detail)
                self.services.health.remove(SOURCE, f"{self.spec.name}/event")
                self.log.info("pacemaker.moved", handler=self.spec.name, event_id=eid, node=me,
                              seconds=round(took, 3), resources=list(before))
                return Result(OK, detail)
            if clock.monotonic() >= end:
                names = state.on_node + state.stuck
                return self._cannot_leave(ctx, me, names, "it did not leave within move_timeout "
                                          f"({self.options.move_timeout:g}s, capped by NotBefore): pinned by a "
                                          "location constraint, or it cannot start elsewhere")
            if ctx.sleep(POLL):
                return Result(CANCELED, "the event left the document while the resources moved")

    def _cannot_leave(self, ctx: Context, me: str, names: tuple[str, ...], why: str) -> Result:
        eid = ctx.event.event_id
        with _event_lock(self.spec.name, eid):
            self._bring_back(me, eid, wait=0.0)
        return self._fail("cannot_leave", eid, f"resource {', '.join(names)} cannot leave {me}: {why}; {me} is out "
                          "of standby again (its resources run until the platform takes the node), no early approval")

    def _command_failed(self, eid: str, exc: CommandError) -> Result:
        self.services.metrics.pacemaker_command_failures.labels(self.spec.name, exc.command).inc()
        return self._fail("command_failed", eid, f"a cluster command failed: {exc}")

    # --- completed --------------------------------------------------------------------------------

    def completed(self, ctx: Context) -> Result:
        eid = ctx.event.event_id
        for prop in ("hold", "event"):
            self.services.health.remove(SOURCE, f"{self.spec.name}/{prop}")
        try:
            me = self.me()
            with _event_lock(self.spec.name, eid):
                back = self._bring_back(me, eid, wait=min(ctx.timeout, float(self.options.move_timeout)),
                                        cancel=ctx.cancel)
        except CommandError as exc:
            return self._command_failed(eid, exc)
        if back is None:
            return Result(OK, f"{me} was not taken out for this event")
        if not back:
            return Result(FAILED, f"{me} is out of standby but not online again yet; the claim is kept until it is")
        why = " (the event was canceled)" if ctx.outcome == CANCELED else ""
        return Result(OK, f"{me} back: online and out of standby, its resources may return{why}")

    def _bring_back(self, me: str, eid: str, wait: float, cancel: threading.Event | None = None) -> bool | None:
        """Out of standby, then (once the node is online and not in standby) release the claim; None when this
        node holds no claim for the event, False when it is not online again within `wait`."""
        sid = safe_event_id(eid)
        claim = self.cluster.claims().by_node.get(me)
        noted = (self.note(eid) or {}).get("state") in ("taking", "out")
        if (claim is None or claim.event != sid) and not noted:
            return None
        self.cluster.standby(me, False)
        clock = self.services.clock
        end = clock.monotonic() + wait
        while True:
            view = self.cluster.view()
            show(self.services, self.spec.name, self._me or "", view)
            node = view.nodes.get(me)
            if node is not None and node.online and not node.standby:
                break
            if clock.monotonic() >= end or clock.wait(cancel or threading.Event(), POLL):
                return False
        if claim is not None and claim.event == sid:
            self.cluster.drop_claim(claim)
        self._note(eid, state="back", summary=f"{me} back in the cluster")
        self.log.info("pacemaker.back", handler=self.spec.name, event_id=eid, node=me)
        return True

    # --- the keeper ---------------------------------------------------------------------------------

    def keep(self) -> float | None:
        """The node's state in health and metrics; our claim renewed while its event lasts, or the node brought
        back when the event is gone (maintd was down when it ended); another node's lapsed claim swept. Called
        right after each run too, when the approval is under way: a look less than KEEP_INTERVAL after the last
        waits (the runs show the node's state themselves), so it never competes with the POST."""
        mono = self.services.clock.monotonic()
        if mono - self._last_keep < KEEP_INTERVAL:
            return self._last_keep + KEEP_INTERVAL - mono
        self._last_keep = mono
        try:
            me = self.me()
            view, claims = self.cluster.view(), self.cluster.claims()
        except CommandError as exc:
            self.services.metrics.pacemaker_command_failures.labels(self.spec.name, exc.command).inc()
            self.services.health.set(SOURCE, f"{self.spec.name}/node", HealthState.WARNING,
                                     f"cannot read the cluster: {exc}")
            return KEEP_INTERVAL
        show(self.services, self.spec.name, self._me or "", view)
        wall = self.services.clock.now().timestamp()
        tracked = self.services.store.tracked()
        by_sid = {safe_event_id(eid): t for eid, t in tracked.items()}
        for node, claim in claims.by_node.items():
            try:
                if node == me:
                    self._keep_mine(me, claim, by_sid, wall)
                elif not live(claim, wall):
                    self.log.warning("pacemaker.lapsed_claim", handler=self.spec.name, node=node,
                                     claim_event=claim.event,
                                     action="its standby cleared and the claim released (its maintd is gone?)")
                    self.cluster.standby(node, False)
                    self.cluster.drop_claim(claim)
            except CommandError as exc:
                self.services.metrics.pacemaker_command_failures.labels(self.spec.name, exc.command).inc()
        return KEEP_INTERVAL

    def _keep_mine(self, me: str, claim: Claim, by_sid: dict[str, Any], wall: float) -> None:
        t = by_sid.get(claim.event)
        if t is None:
            eid = next((e for e, note in self.notes().items() if safe_event_id(e) == claim.event), claim.event)
            with _event_lock(self.spec.name, eid):
                if claim.event not in {safe_event_id(e) for e in self.services.store.tracked()}:
                    self.log.info("pacemaker.event_gone", handler=self.spec.name, event_id=eid, node=me,
                                  action="bringing the node back (the event ended while maintd was not running)")
                    self._bring_back(me, eid, wait=float(self.options.move_timeout))
            return
        ev = t.event
        nb = ev.not_before.timestamp() if ev.not_before else None
        want = claim_expiry(nb, wall, impact(ev.event_type, ev.duration_seconds))
        if want - claim.expires > KEEP_INTERVAL * 6:
            self.cluster.renew_claim(Claim(me, claim.event, want))


def show(services: Services, name: str, me: str, view: ClusterView) -> None:
    """The node's cluster state as health (`pacemaker`, `<name>/node`) and the `maintd_pacemaker_*` gauges."""
    node = view.nodes.get(me)
    m = services.metrics
    m.pacemaker_online.labels(name).set(1 if node is not None and node.online else 0)
    m.pacemaker_standby.labels(name).set(1 if node is not None and node.standby else 0)
    m.pacemaker_resources.labels(name).set(len(view.on(me)))
    m.pacemaker_nodes_online.labels(name).set(sum(1 for v in view.nodes.values() if v.online and not v.standby))
    state = HealthState.OK if node is not None and node.online else HealthState.WARNING
    services.health.set(SOURCE, f"{name}/node", state, summary(view, me))


def sweep_lock(cluster: Cluster, log: Any, name: str, wall: float) -> None:
    """A lock whose holder is gone past its time is removed (only that very lock)."""
    held = cluster.claims().lock
    if held is not None and held.expires < wall:
        log.warning("pacemaker.stale_lock", handler=name, holder=held.holder,
                    reason="the lock's holder did not release it in time (crashed?)")
        cluster.drop_lock(held)
