"""The peer backend as a model: three VMs that ask each other for readiness, one of which approves.

What each step calls of the real code:
- who a VM asks: `coordination_rules.watch_chain` (the leader chain it watches) and, while it leads or
  is about to (`leads_soon`), the peers ranked after it not yet ready (`readiness_due`'s rule);
- what an answer or a silence does to its knowledge: `failed_since`, on a real `PeerState`;
- which peers block it and whether a lower-ranked one is still present: the real
  `PeerBackend.inputs` (bound to a stand-in that hands it the model's `PeerState`s);
- whether it approves: `approval_policy.decide`, with the coordinator tick's own rules around it
  (an unconfirmed `sending` record waits `RETRY_FAILED_AFTER`, a failed POST too);
- when the POST's retries give up: the real `agent.retry.retrying` on the model's clock.

Abstracted away: the asking cadence (any due ask may happen at any moment), pushes (a push only
makes the leader ask sooner, and asks happen at any moment already), gates, addressing, the token.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Mapping
from types import SimpleNamespace
from typing import NamedTuple

from agent.coordination.coordination_rules import PeerState, failed_since, leads_soon, watch_chain
from agent.coordination.coordination_settings import CoordinationConfig
from agent.coordination.coordinator import RETRY_FAILED_AFTER, Coordinator
from agent.coordination.peers.peer_backend import PeerBackend
from agent.model.approval import AUTO, FAILED, SENDING, SENT
from agent.model.events import SCHEDULED
from agent.policy.approval_policy import decide
from tests.model.common import (
    CRASH,
    DOWN,
    EVENT_ID,
    LOST_ANSWER,
    LOST_MESSAGE,
    MAX_FAULTS,
    NOW,
    PAUSE,
    PAUSED,
    POST_ERROR,
    RESTART,
    SETTINGS,
    TAKEOVER,
    TICK,
    TIME_PASSES,
    UP,
    VMS,
    WEDGE,
    Imds,
    ModelClock,
    age_of,
    at,
    imds_steps,
    lapsed,
    older,
    order,
    post_outcomes,
    retry_refuses,
    retry_stops,
    s1,
    s2,
    spend,
)

KINDS = (CRASH, PAUSE, LOST_ANSWER, LOST_MESSAGE, RESTART, POST_ERROR, WEDGE)
"""The faults of this model (an odd record is the store's). A wedge: the VM's server stops answering its peers
for good (a poisoned request, a flood, a one-way partition) while its own loop, hooks and approver run on."""
WEDGED = "wedged"
IGNORE = dataclasses.replace(SETTINGS, unreachable_peers="ignore", peer_timeout=TAKEOVER)
"""The opt-out of S1: a peer silent for `peer_timeout` (here as long as takeover_after, so within the ages the
model counts) is not waited for. S2 must hold under it too."""
settings = SETTINGS
"""The configuration the model's VMs run (the cached functions read it; `PeerModel` sets it and empties them)."""


class Known(NamedTuple):
    """What a VM knows of one peer (the fields of `PeerState` the rules read), as ages in ticks."""

    ready: bool = False
    ok_age: int | None = None
    failing_age: int | None = None

    def real(self) -> PeerState:
        return PeerState(ready=self.ready, last_ok=at(self.ok_age), failing_since=at(self.failing_age))

    def older(self) -> Known:
        return Known(self.ready, older(self.ok_age), older(self.failing_age))


class Vm(NamedTuple):
    run: str = UP
    prepared: bool = False
    know: tuple[Known | None, ...] = (None,) * len(VMS)
    sending: tuple[int, int | None, int] | None = None
    """The approver's POST under way: (ticks since the decision, since its retries began or None before the first
    send, attempts so far)."""
    record: str | None = None
    """The approval record in this VM's state store (survives a restart): sending, sent, failed."""
    failed_age: int | None = None
    seen: str = SCHEDULED
    """The event's status in this VM's last poll."""
    wedged: bool = False
    """Its server answers no peer (it runs on); a restart mends it."""

    def older(self) -> Vm:
        return _older(self)


@functools.cache
def _older(v: Vm) -> Vm:
    """The VM one tick later (its loop has not run yet)."""
    return v._replace(know=tuple(k and k.older() for k in v.know), failed_age=older(v.failed_age),
                      sending=v.sending and (older(v.sending[0]) or 0, older(v.sending[1]), v.sending[2]))


class State(NamedTuple):
    vms: tuple[Vm, ...]
    imds: Imds
    faults: tuple[str, ...]


def _peers(vm: Vm) -> dict[str, PeerState]:
    return {VMS[i]: k.real() for i, k in enumerate(vm.know) if k is not None}


@functools.cache
def peer_inputs(i: int, vm: Vm) -> tuple[list[str], list[str]]:
    """(peers not ready, lower-ranked peers still present) as the real coordinator computes them."""
    peers = _peers(vm)
    stand_in = SimpleNamespace(settings=lambda: settings, _silent=lambda *args: None, _events={}, _health=None,
                               peers=SimpleNamespace(run=lambda *args: None, peers_now=lambda exchange: peers))
    event = SimpleNamespace(resources=VMS, status=vm.seen)
    given = PeerBackend.inputs(stand_in, EVENT_ID, event, VMS[i], [] if vm.prepared else ["hook"],  # type: ignore[arg-type]
                               AUTO, False, vm.record == SENT, NOW)
    return given.waiting, given.reachable


@functools.cache
def withheld(i: int, know: tuple[Known | None, ...], seen: str, decided: int, started: int) -> str | None:
    """Why the real approver withholds the POST right before a send (`Approver.lapsed`, with the coordinator's
    `still_right` on this VM's last poll and its peer knowledge now), or None: it sends."""
    peers = {VMS[j]: k.real() for j, k in enumerate(know) if k is not None}
    coordinator = SimpleNamespace(scheduled=frozenset({EVENT_ID}) if seen == SCHEDULED else frozenset(), budget=None)
    backend = SimpleNamespace(published={EVENT_ID: object()}, settings=lambda: settings, clock=ModelClock(),
                              peers=SimpleNamespace(peers_now=lambda exchange: peers))
    check = SimpleNamespace(right_to_post=lambda *args: PeerBackend.right_to_post(backend, *args))  # type: ignore[arg-type]
    return lapsed(order(VMS[i], AUTO, decided), started, SETTINGS.approval_retry_for,
                  lambda o: Coordinator.still_right(coordinator, o), check)  # type: ignore[arg-type]


@functools.cache
def ask_targets(i: int, vm: Vm) -> list[int]:
    """The peers this VM asks in one turn: its leader chain, and while it leads (or soon will) the ones after it
    not known ready (the cadence is abstracted: every one due is asked in every turn)."""
    if vm.seen != SCHEDULED or vm.record == SENT:
        return []
    peers = _peers(vm)
    lower, higher = list(VMS[:i]), list(VMS[i + 1:])
    names = watch_chain(lower, peers)
    if leads_soon(lower, peers, NOW, TAKEOVER):
        names += [n for n in higher if not (n in peers and peers[n].ready)]
    return [VMS.index(n) for n in names]


@functools.cache
def turn(i: int, v: Vm, world: tuple[tuple[str, bool], ...], status: str,
         may_lose: bool) -> tuple[tuple[str, Vm, bool], ...]:
    """One turn of VM `i`'s loop: it polls IMDS (`status`), asks every peer due at once (each answers, as `world`
    says it runs and is prepared, or is silent), then decides; with `may_lose`, also each outcome where one
    answer is lost. (label, the VM after, whether a message was lost) for each outcome."""
    v = v._replace(seen=status)
    targets = ask_targets(i, v)
    out = []
    for lost in [None] + ([j for j in targets if world[j][0] == UP] if may_lose else []):
        know, heard = list(v.know), []
        for j in targets:
            old = know[j] or Known()
            run, prepared = world[j]
            if run == UP and j != lost:
                know[j] = Known(old.ready or prepared, 0, None)
                heard.append(f"{VMS[j]} {'ready' if prepared else 'not ready'}")
            else:
                know[j] = old._replace(failing_age=age_of(failed_since(old.real(), NOW)))
                heard.append(f"{VMS[j]} silent" + (" (FAULT: message lost)" if j == lost else f" ({run})"))
        label, after = decision(i, v._replace(know=tuple(know)))
        out.append((f"{VMS[i]} polls, {'asks ' + ', '.join(heard) if heard else 'asks nobody'}{label}", after,
                    lost is not None))
    return tuple(out)


def decision(i: int, v: Vm) -> tuple[str, Vm]:
    """The coordinator's tick for this VM: `approval_policy.decide` on the real inputs, and the tick's own rules
    around it (an unconfirmed `sending` record waits RETRY_FAILED_AFTER, so does a failed POST)."""
    if v.sending is not None or v.record == SENT:
        return "", v
    waiting, reachable = peer_inputs(i, v)
    d = decide(mode=AUTO, status=v.seen, already_sent=v.record == SENT, manual_requested=False,
               local_pending=[] if v.prepared else ["hook"], peers_not_ready=waiting,
               lower_ranked_reachable=reachable, dry_run=False)
    if not d.approve:
        return f"; holds ({d.reason})", v
    if v.record == SENDING and v.failed_age is None:  # a previous run sent it and stopped before the answer
        return "; finds its unconfirmed approval and waits", v._replace(failed_age=0)
    if v.failed_age is None or NOW - (at(v.failed_age) or 0.0) >= RETRY_FAILED_AFTER:
        return f"; approves ({d.reason})", v._replace(sending=(0, None, 0))
    return "; waits to retry", v


class PeerModel:
    """Three VMs of the peer backend, one event naming them all, approval `auto`, the default configuration (or
    `config`). Build and explore one at a time: the configuration and the caches are the module's."""

    name = "peers"

    def __init__(self, max_faults: int = MAX_FAULTS, kinds: tuple[str, ...] = KINDS,
                 config: CoordinationConfig = SETTINGS) -> None:
        global settings
        self.max_faults, self.kinds = max_faults, kinds
        settings = config
        if config.unreachable_peers == "ignore":
            self.name = "peers_ignore"
        for cached in (peer_inputs, withheld, ask_targets, turn, _older):
            cached.cache_clear()  # they remember what the real functions said: ask them afresh

    def initial(self) -> Iterable[State]:
        yield State((Vm(),) * len(VMS), Imds(), ())

    def properties(self) -> Mapping[str, Callable[[State], str | None]]:
        if settings.unreachable_peers == "ignore":  # S1 is what `ignore` gives up, knowingly; S2 it does not
            return {"S2": lambda s: s2(s.imds)}
        return {"S1": lambda s: s1(s.imds), "S2": lambda s: s2(s.imds)}

    def elapsed(self, label: str) -> float:
        return TICK if label.startswith(TIME_PASSES) else 0.0

    def describe(self, s: State) -> str:
        def one(i: int, v: Vm) -> str:
            knows = ",".join(f"{VMS[j]}:{'ready' if k.ready else '-'}{'' if k.failing_age is None else ' failing'}"
                             for j, k in enumerate(v.know) if k is not None)
            return (f"{VMS[i]} {v.run}, {'prepared' if v.prepared else 'preparing'}"
                    f"{', knows ' + knows if knows else ''}{', posting' if v.sending else ''}"
                    f"{', record ' + v.record if v.record else ''}")
        return (f"IMDS: {s.imds.status}, POSTs from {sorted(s.imds.posted_by)}; "
                + "; ".join(one(i, v) for i, v in enumerate(s.vms)) + f"; faults {list(s.faults)}")

    def steps(self, s: State) -> Iterable[tuple[str, State]]:
        if s.imds.status != SCHEDULED and not any(v.sending for v in s.vms):
            return  # the event started and no VM can still POST: nothing after this can break S1 or S2
        yield from ((label, s._replace(imds=imds)) for label, imds in imds_steps(s.imds))
        busy = any(v.sending is not None for v in s.vms if v.run == UP)  # a POST takes seconds, not a tick
        if not busy and not (s.imds.posted_by and s.imds.status == SCHEDULED):
            yield self._time_passes(s)
        for i, v in enumerate(s.vms):
            yield from self._faults(s, i, v)
            if v.run != UP:
                continue
            if not v.prepared:
                yield f"{VMS[i]}'s preparation ends: it is ready", _set(s, i, v._replace(prepared=True))
            yield from self._round(s, i, v)
            yield from self._send(s, i, v)

    def _time_passes(self, s: State) -> tuple[str, State]:
        """A tick, and right after it one turn of each running VM's loop (it runs every second), without faults."""
        s = s._replace(vms=tuple(v.older() for v in s.vms))
        turns = []
        for i, v in enumerate(s.vms):
            if v.run == UP:
                label, s = next(iter(self._round(s, i, v, lose=False)))
                turns.append(label)
        return "; ".join([TIME_PASSES] + turns), s

    def _spend(self, s: State, kind: str) -> tuple[str, ...] | None:
        return spend(s.faults, kind, self.max_faults) if kind in self.kinds else None

    def _faults(self, s: State, i: int, v: Vm) -> Iterable[tuple[str, State]]:
        name = VMS[i]
        if v.run == PAUSED:
            yield f"{name} resumes", _set(s, i, v._replace(run=UP))
        if v.run == DOWN:
            yield f"{name} starts again (it knows nothing of its peers)", _set(s, i, _restarted(v, s.imds.status))
        if v.run == UP and (f := self._spend(s, PAUSE)) is not None:
            yield f"FAULT {name} is paused (SIGSTOP, a VM freeze)", _set(s, i, v._replace(run=PAUSED), f)
        if v.run != DOWN and (f := self._spend(s, CRASH)) is not None:
            yield f"FAULT {name} crashes", _set(s, i, v._replace(run=DOWN, know=Vm().know, sending=None), f)
        if v.run == UP and (f := self._spend(s, RESTART)) is not None:
            yield f"FAULT {name} restarts", _set(s, i, _restarted(v, s.imds.status), f)
        if v.run == UP and (f := self._spend(s, WEDGE)) is not None:
            yield f"FAULT {name}'s server wedges: no answer to its peers from now on (it runs on)", \
                _set(s, i, v._replace(wedged=True), f)

    def _round(self, s: State, i: int, v: Vm, lose: bool = True) -> Iterable[tuple[str, State]]:
        """One turn of this VM's loop (see `turn`); a lost message silences one of its asks."""
        lost_budget = self._spend(s, LOST_MESSAGE) if lose else None
        world = tuple((WEDGED if w.wedged and w.run == UP else w.run, w.prepared) for w in s.vms)
        for label, after, lost in turn(i, v, world, s.imds.status, lost_budget is not None):
            yield label, _set(s, i, after, lost_budget if lost else None)

    def _send(self, s: State, i: int, v: Vm) -> Iterable[tuple[str, State]]:
        """The approver's next send: the real checks right before it, then the POST and what IMDS answers."""
        if v.sending is None:
            return
        name = VMS[i]
        decided, started, attempts = v.sending
        started = 0 if started is None else started
        within = SETTINGS.approval_retry_for
        gave_up = v._replace(sending=None, record=FAILED if attempts else v.record, failed_age=0)
        if attempts and retry_refuses(started, within, attempts + 1):
            yield f"{name}'s retries refuse another attempt (past their time)", _set(s, i, gave_up)
            return
        why = withheld(i, v.know, v.seen, decided, started)
        if why is not None:
            yield f"{name} withholds the POST: {why}", _set(s, i, gave_up)
            return
        prepared = {VMS[j]: w.prepared for j, w in enumerate(s.vms)}
        for what, imds, faults in post_outcomes(s.imds, name, prepared, lambda kind: self._spend(s, kind)):
            if faults is None:
                after = v._replace(sending=None, record=SENT, failed_age=None)
            elif retry_stops(started, within, attempts + 1):
                after, what = v._replace(sending=None, record=FAILED, failed_age=0), what + "; the retries give up"
            else:
                after = v._replace(sending=(decided, started, attempts + 1), record=SENDING)
            yield f"{name} POSTs StartRequests: {what}", s._replace(vms=_vms(s, i, after), imds=imds,
                                                                    faults=faults or s.faults)


def _restarted(v: Vm, status: str) -> Vm:
    """A VM after a restart: its state store (the approval record, its preparation) and a first poll, nothing else."""
    return Vm(run=UP, prepared=v.prepared, record=v.record, seen=status)


def _vms(s: State, i: int, v: Vm) -> tuple[Vm, ...]:
    if v.seen != SCHEDULED or v.record == SENT:  # what it knows of its peers can no longer matter: forget it
        v = v._replace(know=Vm().know)
    return s.vms[:i] + (v,) + s.vms[i + 1:]


def _set(s: State, i: int, v: Vm, faults: tuple[str, ...] | None = None) -> State:
    return s._replace(vms=_vms(s, i, v), faults=s.faults if faults is None else faults)
