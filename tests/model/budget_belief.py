"""The disruption budget as each member believes it: three members, each its own real `Budget` (tests/model/
budget_member.py), one record in a store whose clock is the model's, and the faults issue 34 found.

Time is the store's clock in whole seconds (`T`, up to `horizon`). Each member's monotonic clock runs at its own
rate against it (`Clock`: any offset, the rate at the bound the lease is stated for, 1 % slow: the worst case for
a lease) and a read's Date is the whole second it falls in, sent just before the next (`LAG`): the entry looks up
to a second older than the member's clock says. "1s passes" is the loop pass of every running member (its lease
checked first: `look` after a resume, `tick` every second), and comes only once every running member has done
what is due (a step its loop sent is read and written within the second): the schedule is maintd's (`Mine.due`,
`renew_at`), the order of everything within a second is any.

Faults, at the start of any second (`kinds`, at most `max_faults` per path): a member that holds or was handed
a place paused (SIGSTOP: it takes no step, its clock runs) and resumed any second later, or its maintd crashed and
started again (its memory lost, the VM as it was); a member cut off from the store (each request fails) and
reconnected; the store down for all; a read answered seconds after it was sent (the store's Date then, the lease
from the send); a write that landed with its answer lost (the member sees a failure); the
record turned odd (a forged holder renewed in 2099, a garbage body, stale member names under a percentage).
Without a fault budget: the last safe moment of `FORCEABLE` at any second (the forced path) and a wake hint to a
member a write seated, taken at any moment or never (a hint is only an early read: lost, late and early are all
explored). Each member's preparation takes `PREPARE_S` before it may approve, and its event is over `HOLDS`
seconds after it approved.

Properties (every reachable state):
- B1: the members out of rotation by choice (what each believes: a chosen place, within its lease on its own
  clock; a running member has checked its lease, a paused one is counted while its lease lasts) are at most the
  cap and, with spread zone, of one zone; each was listed by a write of its own.
- B2: no running member out by choice on a place whose own write is `release_after` old (the others may have
  dropped it), and none approved on such a place.
- B3: a write that seats a member by choice counts every holder written, forced ones too (count and zone); a
  forced member out of rotation that the store answers is in the record or still means to write itself there; a forced
  member's own approval is never blocked by its own name.
- handoff (B4): a member a write seated and that the store answers has sent its read within `HANDOFF_S` (hints
  lost or not).
- B7, the load balancer's view: a VM back in rotation gets traffic again only `LB_S` later, so the members out of the
  balancer's pool by choice (out by choice as B1 counts them, or back from a chosen place less than `LB_S` ago) are
  at most the cap and, with spread zone, of one zone. The members run the real `Budget` with `rejoin_wait` = `LB_S`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from datetime import timedelta
from typing import NamedTuple

from agent.coordination.coordination_settings import BudgetConfig
from agent.fleet.budget_rules import CHOSEN, FORCED, Entry, Me, Places, capacity, render_places
from tests.model.budget_member import (
    EPOCH,
    GROUP,
    LAG,
    Clock,
    Job,
    Member,
    Memory,
    date,
    field_of,
    places_of,
    why_of,
)
from tests.model.common import spend

RELEASE_AFTER = 8.0
"""release_after in the model: short, so a pause or a partition longer than it fits a short search (the lease:
8 s less 2.08 s on the member's clock; the margin is the same 2 s and 1 % at any release_after)."""
MEMBERS = (Me("a", "1"), Me("b", "2"), Me("c", "1"))
CLOCKS = (Clock(1000.0, -0.01), Clock(-50.0, -0.01), Clock(0.0, -0.01))
FORCEABLE = 2
"""c: its last safe moment may come at any time (one forced member mixes forced and chosen places)."""
HANDOFF_S = 3
"""A member a write seated has sent its read of the record before this many seconds of store time passed, hints
lost (B4): its poll every second (HEAD_POLL_S) on a clock 1 % slow is sent by the loop's next pass (each whole
second here), so 2 s can pass in the model's granularity (the bench measures the real figure, p99 < 2 s). Every
other poll is at most release_after / 4 (2 s here): a member the head-of-line reads miss is still silent at 3 s."""
UP, PAUSED, DOWN = "up", "paused", "down"
PAUSE, CUT, STORE_DOWN, CRASH, FORGED, GARBAGE, STALE, LOST_ANSWER, SLOW_ANSWER = (
    "pause", "cut off", "store down", "crash", "forged 2099 holder", "garbage record", "stale members", "lost answer",
    "slow answer")
FAULTS = (PAUSE, CUT, STORE_DOWN, CRASH, FORGED, GARBAGE, LOST_ANSWER, SLOW_ANSWER)
TICK = "1s passes"
PREPARE_S = (3, 0, 0)
"""Seconds each member's preparation takes once out of rotation before it may approve: a's runs 3 s (a hook), so
a place can be lost between leaving rotation and the approval (B2: never approved on it)."""
HOLDS = (None, 4, 4)
"""Seconds after its approval each member's event is over (the VM back in rotation): a's runs past the horizon (a
long preparation or reboot: it holds and renews, a pause or a partition finds it holding), b's and c's are over
after 4 s (longer than release_after / 4: a holder renews once), so places are handed on."""
NAMES = {me.vm for me in MEMBERS}
LB_S = 1
"""The load balancer's view (B7): a VM back in rotation (its /probe 200 again) stays out of the balancer's pool this
many more seconds of store time (as many good probe answers as it took bad ones to stop). The members run the real
`Budget` with `rejoin_wait` the same (on their own clocks, 1 % slow: a little longer). 1 s is the smallest that
shows the release on the first pass back: the next member can be out within that second (read, write, pass)."""


class Vm(NamedTuple):
    """One member: its maintd's memory and the step under way, and the VM as the operator sees it."""

    memory: Memory
    job: Job | None = None
    out: bool = False
    """Out of rotation (its preparation left rotation and has not returned it)."""
    status: str = UP
    done: bool = False
    """Its event is over: back in rotation for good."""
    out_at: int | None = None
    """When it left rotation (None: in rotation)."""
    approved: int | None = None
    """When it approved its event (None: not yet)."""
    safe: bool = False
    """Its last safe moment has come."""
    resumed: bool = False
    """Resumed from a pause at the start of this second: its loop pass begins with `look`."""
    own: int | None = None
    """Ground truth: the store Date of its last write of its own that listed it as a holder by choice."""
    noticed: bool = False
    """A loop pass of its maintd has taken the VM as out of rotation since it left (its `tick` with `out`). Its event
    ends back in rotation only after one: maintd notices the end in a pass that still counts it out, and returns it to
    rotation after it (the restore), so its `Budget` has seen it out before it is back (B7's `Mine.rejoin`). A maintd
    that starts again finds an event over at once (its `Budget` learns what it held from its first read)."""
    back: int | None = None
    """The load balancer's view (B7): the second it came back into rotation from a chosen place (out by choice as
    B1 counts it), while the balancer does not send it traffic yet (None once LB_S has passed: one state)."""


class State(NamedTuple):
    t: int
    record: bytes
    vms: tuple[Vm, ...]
    cut: frozenset[int] = frozenset()
    faults: tuple[str, ...] = ()
    broken: tuple[str, str] | None = None
    """(property, what) a step found broken (a seat that did not count a forced member, an approval on a lost
    place): the state is reported and not explored further."""


def _initial_record() -> bytes:
    return render_places(GROUP, Places(members={me.vm: EPOCH for me in MEMBERS}))


class BeliefModel:
    """`cap` and `spread` as configured; `kinds`: the faults explored; `horizon`: seconds of store time."""

    def __init__(self, cap: int | str = 1, spread: str = "none", *, kinds: Iterable[str] = FAULTS,
                 max_faults: int = 1, horizon: int = 24, clocks: tuple[Clock, ...] = CLOCKS,
                 hints: bool = True, forced: bool = True, pass_every: int = 1) -> None:
        """`hints` False: every wake hint is lost (no early read at all); `forced` False: no last safe moment;
        `pass_every`: seconds between two loop passes that nothing woke (a store answer always wakes it)."""
        self.cap, self.spread, self.kinds, self.max_faults = cap, spread, tuple(kinds), max_faults
        self.hints, self.forced, self.pass_every = hints, forced, pass_every
        self.horizon, self.clocks = horizon, clocks
        self.config = BudgetConfig(group=GROUP, max_unavailable=cap, spread=spread, release_after=RELEASE_AFTER)
        self.places = capacity(cap, len(MEMBERS))
        """The true cap: over the group's real members."""
        self.members = tuple(Member(me, self.config, clock, f"e-{me.vm}", rejoin_wait=LB_S)
                             for me, clock in zip(MEMBERS, clocks, strict=True))
        self.name = (f"budget beliefs cap {cap} spread {spread}, faults {', '.join(self.kinds) or 'none'}"
                     + (", forced path" if forced else "") + ("" if hints else ", every hint lost")
                     + (f", a loop pass every {pass_every} s" if pass_every != 1 else ""))

    # --- the model's interface -----------------------------------------------------------------------

    def initial(self) -> Iterable[State]:
        record = _initial_record()
        vms = []
        for m in self.members:
            memory, job, out = m.tick(Memory(m.budget_fresh(), record), 0, False, False, False, False)
            vms.append(Vm(memory, job, out))
        yield State(0, record, tuple(vms))

    def steps(self, state: State) -> Iterable[tuple[str, State]]:
        for i, vm in enumerate(state.vms):
            yield from self._member_steps(state, i, vm)
        if state.t < self.horizon and all(v.status != UP or v.job is None or v.job.hung for v in state.vms):
            for label, at_once in self._moments(state):
                yield label, self._time_passes(at_once)

    def elapsed(self, label: str) -> float:
        return 1.0 if label.startswith(TICK) else 0.0

    def describe(self, state: State) -> str:
        parts = []
        for me, vm in zip(MEMBERS, state.vms, strict=True):
            why = why_of(vm.memory)
            words = [vm.status, "cut off" if MEMBERS.index(me) in state.cut else "",
                     "out" if vm.out else "in rotation", f"holds ({why})" if why else "",
                     "approved" if vm.approved is not None else "", "done" if vm.done else "",
                     f"back at t={vm.back}s, not yet in the balancer's pool" if vm.back is not None else "",
                     "forced moment" if vm.safe else ""]
            parts.append(f"{me.vm}: {' '.join(w for w in words if w)}")
        found = places_of(state.record)
        record = found if isinstance(found, str) else (
            f"holders {[f'{h.vm}({h.why}, renewed t={self._t(h)})' for h in found.holders]}, "
            f"waiting {[w.vm for w in found.waiting]}")
        return f"t={state.t}s; " + "; ".join(parts) + f"; record: {record}"

    # --- within a second: the steps the members' loops sent ------------------------------------------

    def _member_steps(self, state: State, i: int, vm: Vm) -> Iterable[tuple[str, State]]:
        m, name = self.members[i], MEMBERS[i].vm
        if vm.status != UP:
            return
        cut = i in state.cut
        if vm.job is not None and vm.job.pending is None and vm.job.hung is None and not cut \
                and (f := self._spend(state, SLOW_ANSWER)):
            hung = vm.job._replace(hung=(state.t, self.clocks[i].at(state.t + LAG)))
            yield f"FAULT {name}'s read for {vm.job.action} is sent and hangs", self._set(
                state, i, vm._replace(job=hung))._replace(faults=f)
        if vm.job is not None and vm.job.pending is None and (vm.job.hung is None or state.t > vm.job.hung[0]):
            if cut:
                yield f"{name} {vm.job.action}: the request fails (cut off)", self._answer(state, i, m.failed(vm.job))
            else:
                outcome, job = m.read_half(vm.job, state.record, state.t, vm.memory.seen)
                label = f"{name} reads for {vm.job.action}"
                if outcome is not None:
                    said = outcome.result or f"fails ({outcome.error.outcome if outcome.error else ''})"
                    yield f"{label}: {said}, nothing to write", self._answer(state, i, outcome, seen=state.record)
                else:
                    yield f"{label}: {m.written(job).result}, to write", self._set(state, i, vm._replace(job=job))
        if vm.job is not None and vm.job.pending is not None:
            yield from self._write(state, i, vm, cut)
        found = places_of(state.record)
        if self.hints and vm.job is None and not vm.done and isinstance(found, Places) \
                and (h := found.holder(name)) is not None and h.why == CHOSEN and why_of(vm.memory) is None \
                and not cut and field_of(vm.memory, "due") > self.clocks[i].at(state.t + 0.999):
            yield f"{name} gets a wake hint", self._pass(state, i, vm, woken=True)

    def _write(self, state: State, i: int, vm: Vm, cut: bool) -> Iterable[tuple[str, State]]:
        m, name, job = self.members[i], MEMBERS[i].vm, vm.job
        assert job is not None and job.pending is not None
        read, body, t_read, _ = job.pending
        if cut:
            yield f"{name}'s write fails (cut off)", self._answer(state, i, m.failed(job))
            return
        if state.record != read:
            yield f"{name}'s If-Match fails: reads again", self._set(state, i, vm._replace(job=job._replace(
                pending=None)))
            return
        new = places_of(body)
        assert isinstance(new, Places)
        broken = state.broken or self._seat_check(read, new, name)
        held = new.holder(name)
        own = t_read if held is not None and held.why == CHOSEN else vm.own
        after = state._replace(record=body, broken=broken)
        outcome = m.written(job)
        yield f"{name} writes: {outcome.result}", self._answer(after, i, outcome, own=own, seen=body)
        if f := self._spend(state, LOST_ANSWER):
            yield f"FAULT {name}'s write lands ({outcome.result}), its answer is lost", self._answer(
                after._replace(faults=f), i, m.failed(job), own=own)

    def _seat_check(self, read: bytes, new: Places, writer: str) -> tuple[str, str] | None:
        """B3: a write that seats a member by choice (its own take, or a handoff) counts every holder written."""
        before = places_of(read)
        assert isinstance(before, Places)
        seated = [h for h in new.holders if h.why == CHOSEN and before.holder(h.vm) is None]
        if not seated:
            return None
        holders = [h for h in new.holders if h.vm in NAMES]
        zones = {h.zone for h in holders}
        if len(holders) > self.places or (self.spread == "zone" and len(zones) > 1):
            who = ", ".join(f"{h.vm} ({h.why}, zone {h.zone})" for h in holders)
            return "B3", f"{writer}'s write seated {seated[0].vm} by choice with holders {who}: over the cap or zones"
        return None

    def _answer(self, state: State, i: int, outcome: object, own: int | None = -1, seen: bytes | None = None
                ) -> State:
        vm = state.vms[i]
        vm = vm._replace(job=None, own=vm.own if own == -1 else own)
        return self._pass(state, i, vm, outcome=outcome, seen=seen)

    def _pass(self, state: State, i: int, vm: Vm, *, outcome: object = None, seen: bytes | None = None,
              woken: bool = False, look_first: bool = False, t: float = 0.999) -> State:
        """The member's loop pass at `t` into the second (takes in `outcome`, a hint; with `look_first`, `look`
        before anything), and its coordinator's: it approves its event once the budget lets it."""
        m = self.members[i]
        started = vm.out and vm.approved is None and not vm.done
        memory, job, out = m.tick(vm.memory, state.t + t, vm.done, vm.safe, vm.out, started,
                                  outcome=outcome, seen=seen, woken=woken, look_first=look_first)  # type: ignore[arg-type]
        out_at = (vm.out_at if vm.out_at is not None else state.t) if out else None
        back = state.t if vm.out and not out and self._held(i, vm, state.t + t) else vm.back
        vm = vm._replace(memory=memory, job=job if vm.job is None else vm.job, out=out, out_at=out_at, back=back,
                         noticed=out and (vm.noticed or vm.out))
        if out and vm.approved is None and not vm.done and state.t >= out_at + PREPARE_S[i] \
                and m.approval(memory, state.t + t) is None:
            return self._approve(state, i, vm)
        return self._set(state, i, vm)

    def _approve(self, state: State, i: int, vm: Vm) -> State:
        broken = state.broken
        if why_of(vm.memory) != FORCED and not vm.safe and vm.own is not None and state.t - vm.own >= RELEASE_AFTER:
            broken = broken or ("B2", f"{MEMBERS[i].vm} approved on a place its own write listed at "
                                      f"t={vm.own}s: release_after had passed, the others may have dropped it")
        return self._set(state, i, vm._replace(approved=state.t))._replace(broken=broken)

    @staticmethod
    def _set(state: State, i: int, vm: Vm) -> State:
        return state._replace(vms=state.vms[:i] + (vm,) + state.vms[i + 1:])

    @staticmethod
    def _t(entry: Entry) -> int:
        return round((entry.renewed - EPOCH).total_seconds())

    # --- a second passes: what may happen at its start, then every running member's loop pass ------------

    def _time_passes(self, state: State) -> State:
        state = state._replace(t=state.t + 1)
        for i, vm in enumerate(state.vms):
            hold = HOLDS[i]
            if vm.back is not None and state.t >= vm.back + LB_S:  # the balancer sends it traffic again
                vm = vm._replace(back=None)
                state = self._set(state, i, vm)
            if vm.approved is not None and not vm.done and hold is not None and state.t >= vm.approved + hold \
                    and vm.status == UP and (vm.noticed or not vm.out):
                back = state.t if vm.out and self._held(i, vm, state.t) else vm.back
                vm = vm._replace(done=True, out=False, out_at=None, back=back, noticed=False)  # back in rotation
                state = self._set(state, i, vm)
            if vm.status == UP and (vm.resumed or state.t % self.pass_every == 0):
                state = self._pass(state, i, vm, t=0.0, look_first=vm.resumed)
                state = self._set(state, i, state.vms[i]._replace(resumed=False))
        return state

    def _moments(self, state: State) -> Iterable[tuple[str, State]]:
        """What may happen as the next second starts (one thing at most): nothing, the forced member's last safe
        moment, a member's event over, a fault (within the budget), a resume, a reconnection, a restart."""
        yield TICK, state
        for i, vm in enumerate(state.vms):
            name = MEMBERS[i].vm
            if self.forced and i == FORCEABLE and not vm.safe and not vm.done:
                yield f"{TICK}; {name}'s last safe moment", self._set(state, i, vm._replace(safe=True))
            yield from self._member_faults(state, i, vm)
        if not state.cut and (f := self._spend(state, STORE_DOWN)):
            yield f"{TICK}; FAULT the store is down", state._replace(cut=frozenset(range(len(MEMBERS))), faults=f)
        if state.cut:
            yield f"{TICK}; the store answers again", state._replace(cut=frozenset())
        yield from self._odd_records(state)

    def _spend(self, state: State, kind: str) -> tuple[str, ...] | None:
        return spend(state.faults, kind, self.max_faults) if kind in self.kinds else None

    def _member_faults(self, state: State, i: int, vm: Vm) -> Iterable[tuple[str, State]]:
        name = MEMBERS[i].vm
        found = places_of(state.record)
        holds = why_of(vm.memory) is not None or (isinstance(found, Places) and found.holder(name) is not None)
        if vm.status == UP and holds and (f := self._spend(state, PAUSE)):
            yield f"{TICK}; FAULT {name} is paused", self._set(state, i, vm._replace(status=PAUSED))._replace(
                faults=f)
        if vm.status == PAUSED:
            yield f"{TICK}; {name} resumes", self._set(state, i, vm._replace(status=UP, resumed=True))
        if vm.status == UP and holds and (f := self._spend(state, CRASH)):
            yield f"{TICK}; FAULT {name}'s maintd crashes", self._set(state, i, vm._replace(
                status=DOWN, job=None))._replace(faults=f)
        if vm.status == DOWN:
            fresh = Memory(self.members[i].budget_fresh())
            # a maintd that starts finds its event over and returns the VM to rotation before its `Budget` counts it
            # (it learns what it held from its first read: B7's restart keeps the place the whole wait)
            yield f"{TICK}; {name}'s maintd starts again (its memory lost)", self._set(
                state, i, vm._replace(status=UP, memory=fresh, job=None, noticed=vm.out))
        if not state.cut and (f := self._spend(state, CUT)):
            yield f"{TICK}; FAULT {name} is cut off from the store", state._replace(cut=frozenset({i}), faults=f)

    def _odd_records(self, state: State) -> Iterable[tuple[str, State]]:
        found = places_of(state.record)
        if not isinstance(found, Places):
            return
        if f := self._spend(state, FORGED):
            far = EPOCH.replace(year=2099)
            forged = Entry("x", "9", "", "e-x", CHOSEN, far, far)
            body = render_places(GROUP, Places(found.holders + (forged,), found.waiting, found.members))
            yield f"{TICK}; FAULT the record gains a holder renewed in 2099", state._replace(record=body, faults=f)
        if f := self._spend(state, GARBAGE):
            yield f"{TICK}; FAULT the record turns to garbage", state._replace(
                record=b"{\"maintd\": 1, garbage", faults=f)
        if f := self._spend(state, STALE):
            old = date(state.t) - timedelta(days=1)
            members = {**found.members, **{f"gone-{n}": old for n in range(6)}}
            body = render_places(GROUP, Places(found.holders, found.waiting, members))
            yield f"{TICK}; FAULT the record lists 6 members gone a day ago", state._replace(record=body, faults=f)

    # --- properties ---------------------------------------------------------------------------------

    def properties(self) -> Mapping[str, Callable[[State], str | None]]:
        return {"B1": self.b1, "B2": self.b2, "B3": self.b3, "handoff": self.handoff, "B7": self.b7}

    def _by_choice(self, i: int, vm: Vm, t: float) -> bool:
        """Out of rotation by choice as B1 counts it: a chosen place, within its lease (a running member has
        checked it; a paused one is counted while its lease lasts)."""
        if not vm.out or why_of(vm.memory) != CHOSEN:
            return False
        return vm.status == UP or self.clocks[i].at(t) < self.members[i].lease(vm.memory)

    def _held(self, i: int, vm: Vm, t: float) -> bool:
        """Out of rotation on a chosen place within its lease on its own clock at store time `t` (what it held as it
        came back into rotation: a member back because its lease ended gave the place up, B2)."""
        return vm.out and why_of(vm.memory) == CHOSEN and self.clocks[i].at(t) < self.members[i].lease(vm.memory)

    def _chosen_out(self, state: State) -> list[int]:
        return [i for i, vm in enumerate(state.vms) if self._by_choice(i, vm, state.t)]

    def b1(self, state: State) -> str | None:
        if state.broken is not None and state.broken[0] == "B1":
            return state.broken[1]
        chosen = self._chosen_out(state)
        names = [f"{MEMBERS[i].vm} (zone {MEMBERS[i].zone})" for i in chosen]
        if len(chosen) > self.places:
            return f"{len(chosen)} out of rotation by choice with {self.places} place(s): {', '.join(names)}"
        if self.spread == "zone" and len({MEMBERS[i].zone for i in chosen}) > 1:
            return f"out by choice in two zones: {', '.join(names)}"
        for i in chosen:
            if state.vms[i].own is None:
                return f"{MEMBERS[i].vm} is out of rotation by choice and no write of its own ever listed it"
        return None

    def b7(self, state: State) -> str | None:
        """B7, the load balancer's view: the members out of its pool by choice (out by choice as B1 counts them, or
        back in rotation from a chosen place less than LB_S ago) are at most the cap, of one zone with spread zone."""
        chosen = set(self._chosen_out(state))
        back = {i for i, vm in enumerate(state.vms) if vm.back is not None and state.t < vm.back + LB_S}
        lb = sorted(chosen | back)
        names = ", ".join(f"{MEMBERS[i].vm} (zone {MEMBERS[i].zone}"
                          + (f", back in rotation at t={state.vms[i].back}s" if i in back - chosen else "") + ")"
                          for i in lb)
        if len(lb) > self.places:
            return (f"{len(lb)} out of the load balancer's pool by choice with {self.places} place(s): {names} "
                    f"(it sends traffic to a member {LB_S} s after it is back)")
        if self.spread == "zone" and len({MEMBERS[i].zone for i in lb}) > 1:
            return f"out of the load balancer's pool by choice in two zones: {names}"
        return None

    def b2(self, state: State) -> str | None:
        if state.broken is not None and state.broken[0] == "B2":
            return state.broken[1]
        for i, vm in enumerate(state.vms):
            own = vm.own
            if vm.status == UP and vm.out and why_of(vm.memory) == CHOSEN and own is not None \
                    and state.t - own >= RELEASE_AFTER:
                return (f"{MEMBERS[i].vm} is out of rotation by choice at t={state.t}s on a place its own write "
                        f"listed at t={own}s: release_after ({RELEASE_AFTER:g} s) has passed on the store's clock, "
                        f"the others may drop it")
        return None

    def b3(self, state: State) -> str | None:
        if state.broken is not None and state.broken[0] == "B3":
            return state.broken[1]
        found = places_of(state.record)
        for i, vm in enumerate(state.vms):
            name = MEMBERS[i].vm
            if not (vm.safe and vm.out and vm.status == UP) or why_of(vm.memory) == CHOSEN:
                continue
            means = bool(field_of(vm.memory, "forced")) or why_of(vm.memory) == FORCED
            if i not in state.cut and isinstance(found, Places) and found.holder(name) is None and not means:
                return (f"{name} is out of rotation, forced, the store answers, it is not in the record and it no "
                        f"longer means to write itself there")
            if vm.approved is None and (why := self.members[i].approval(vm.memory, state.t + 0.5)) is not None \
                    and name in why:
                return f"{name} is forced and out of rotation, and its own approval is blocked: {why}"
        return None

    def handoff(self, state: State) -> str | None:
        found = places_of(state.record)
        if not isinstance(found, Places):
            return None
        for i, vm in enumerate(state.vms):
            held = found.holder(MEMBERS[i].vm)
            if held is None or held.why != CHOSEN or why_of(vm.memory) is not None or vm.status != UP \
                    or i in state.cut or vm.job is not None or field_of(vm.memory, "failures"):
                continue  # not handed a place, or the store does not answer it (in its backoff), or reading
            since = round((held.since - EPOCH).total_seconds())
            if state.t - since >= HANDOFF_S and (vm.own is None or vm.own < since):  # seated by another's write
                return (f"{MEMBERS[i].vm} was handed a place at t={since}s and has not read the record "
                        f"{state.t - since} s later (hints lost)")
        return None


def outcomes() -> dict[str, Callable[[State], bool]]:
    """Outcomes whose states are counted, so a vacuous model is noticed."""
    return {
        "out by choice": lambda s: any(v.out and why_of(v.memory) == CHOSEN for v in s.vms),
        "out forced": lambda s: any(v.out and v.safe and why_of(v.memory) != CHOSEN for v in s.vms),
        "approved": lambda s: any(v.approved is not None for v in s.vms),
        "a place lost": lambda s: any(v.memory.mine and _lost(v.memory) for v in s.vms),
        "back, not yet in the balancer's pool": lambda s: any(v.back is not None for v in s.vms),
    }


def _lost(memory: Memory) -> bool:
    return bool(field_of(memory, "lost"))
