"""Issue 34's findings 2 and 3 as a member of the budget sees them (an in-memory store with conditional writes, one
fake clock, each member's preparation played by the test): a holder cut off from the store longer than its lease
gives its place back before anyone may take it over; a member resumed from a pause acts on nothing before it looked;
a forced member is in the record before it leaves rotation when the store answers, leaves after FORCE_WAIT_S when it
does not and is written once it answers; a forced member counts as out for every other member and never blocks its
own approval."""

from __future__ import annotations

import threading
from datetime import datetime, timedelta
from types import SimpleNamespace

from agent.clock import FakeClock
from agent.coordination.coordinator import Coordinator
from agent.coordination.store.store_protocol import StoreError, Unchanged
from agent.fleet.budget_lease import FORCE_WAIT_S
from agent.fleet.budget_rules import FORCED, parse_places, places_blob, release, render_places
from agent.model.budget_gate import LeaveGate
from tests.budget_fakes import CasStore, member, want

RELEASE_AFTER = 60.0


class Link:
    """One member's way to the shared store: `cut` fails its requests (a partition), `hang` holds them until
    released (a store that does not answer)."""

    def __init__(self, store: CasStore) -> None:
        self.store, self.cut = store, False
        self.hang: threading.Event | None = None

    def _through(self) -> None:
        if self.hang is not None:
            self.hang.wait(10)
        if self.cut:
            raise StoreError("unreachable", "store unreachable: connection refused")

    def read_body(self, name: str) -> tuple[bytes, str, datetime] | None:
        self._through()
        return self.store.read_body(name)

    def read_if_changed(self, name: str, etag: str) -> tuple[bytes, str, datetime] | Unchanged | None:
        self._through()
        return self.store.read_if_changed(name, etag)

    def write_body(self, name: str, body: bytes, etag: str | None) -> str | None:
        self._through()
        return self.store.write_body(name, body, etag)


class Vm:
    """A member and its preparation as the operator sees it: in rotation, or out for its event."""

    def __init__(self, store: CasStore, clock: FakeClock, name: str, event: str, not_before: datetime,
                 zone: str = "1", event_type: str = "Reboot", **config: object) -> None:
        self.link = Link(store)
        self.budget, self.health = member(store, clock, name, zone=zone, release_after=RELEASE_AFTER, **config)
        self.budget.open_store = lambda: self.link
        self.name, self.event, self.want = name, event, want(event, not_before, event_type)
        self.out = self.done = False
        self.returned = 0
        """Times it went back into rotation because its place was lost."""

    def tick(self, settle: bool = True) -> LeaveGate:
        """One loop pass: the budget's look first, its step, and preparation acting on the gate."""
        gate = self.budget.look()
        self._revoke(gate)
        gate = self.budget.tick([] if self.out or self.done else [self.want], self.out)
        if gate.lets(self.event):
            self.out = True
        self._revoke(gate)
        if settle:
            self.budget.wait_idle(5)
        return gate

    def _revoke(self, gate: LeaveGate) -> None:
        if self.event in gate.revoked and self.out:
            self.out, self.returned = False, self.returned + 1  # back in rotation as after a cancel; held again

    def finish(self) -> None:
        """Its event is over: back in rotation, nothing more to prepare."""
        self.out, self.done = False, True

    def holds(self, clock: FakeClock) -> bool:
        return self.budget.hold.holds(self.event, clock.monotonic())


def record(store: CasStore):  # type: ignore[no-untyped-def]
    places = parse_places(store.blobs[places_blob("web")][0])
    assert not isinstance(places, str)
    return places


def run(vms: list[Vm], clock: FakeClock, seconds: float, every: float = 1.0) -> list[list[str]]:
    """Tick every member each `every` seconds; who was out of rotation after each round."""
    seen = []
    for _ in range(int(seconds / every)):
        for vm in vms:
            vm.tick()
        for vm in vms:
            vm.tick()  # take in what the worker answered
        seen.append([vm.name for vm in vms if vm.out])
        clock.advance(every)
    return seen


def test_a_holder_cut_off_longer_than_its_lease_returns_to_rotation_before_anyone_takes_its_place() -> None:
    """Finding 2: vma holds the only place and its store requests fail for longer than release_after. It gives the
    place up on its own clock before vmb may take it (never two out), never approves on it, says so, and queues
    again: once its store answers, it goes out again when the place is free."""
    clock = FakeClock()
    store = CasStore(clock)
    nb = clock.now() + timedelta(hours=2)
    a, b = Vm(store, clock, "vma", "ea", nb), Vm(store, clock, "vmb", "eb", nb)
    run([a, b], clock, 2)
    assert a.out and not b.out
    a.link.cut = True
    seen = run([a, b], clock, 90)
    assert all(len(out) <= 1 for out in seen), seen
    assert not a.out and b.out, "vmb took the place only after vma gave it back"
    assert a.budget.metrics.budget_lost.labels("lease_ended")._value.get() == 1
    assert a.health.reports["budget"][0] == "warning" and "lost its place" in a.health.reports["budget"][1]
    assert a.budget.approval_blocked("ea", ["vma"]) is not None
    assert a.budget.send_blocked("ea", ["vma"]) is not None
    a.link.cut = False
    run([a, b], clock, 31)  # its backoff tops out at 30 s
    assert not a.out and [w.vm for w in record(store).waiting] == ["vma"], "queued again"
    b.finish()  # vmb is back: its release hands vma the place
    seen = run([a, b], clock, 20)
    assert a.out and all(len(out) <= 1 for out in seen)
    assert a.budget.send_blocked("ea", ["vma"]) is None and a.budget.approval_blocked("ea", ["vma"]) is None


def test_renewing_a_place_the_record_no_longer_lists_loses_it_and_never_says_renewed() -> None:
    """Finding 2, the rule: vma's entry is gone from the record (another member dropped it: its store clock ran
    ahead, say). vma's next renewal finds it missing: the place is lost, never "renewed"; it goes back into
    rotation and asks again, and the place being free, it is out again on a write of its own."""
    clock = FakeClock()
    store = CasStore(clock)
    a = Vm(store, clock, "vma", "ea", clock.now() + timedelta(hours=2))
    run([a], clock, 2)
    assert a.out
    _, etag = store.blobs[places_blob("web")]
    dropped_at = clock.now()
    assert store.write_body(places_blob("web"), render_places("web", release(record(store), "vma", dropped_at)), etag)
    run([a], clock, RELEASE_AFTER / 4 + 2)
    assert a.returned == 1 and a.budget.metrics.budget_lost.labels("dropped")._value.get() == 1
    assert a.out and (h := record(store).holder("vma")) is not None and h.since > dropped_at


def test_a_member_paused_past_its_lease_acts_on_nothing_before_it_looked() -> None:
    """A SIGSTOP longer than the lease: the first thing the member does when resumed is look at its lease; it
    sends no store request, and what it says to preparation is "return to rotation", not "may leave"."""
    clock = FakeClock()
    store = CasStore(clock)
    nb = clock.now() + timedelta(hours=2)
    a = Vm(store, clock, "vma", "ea", nb)
    run([a], clock, 2)
    assert a.out and a.holds(clock)
    clock.advance(RELEASE_AFTER)  # paused: no tick, no renewal
    before = store.requests
    gate = a.budget.look()
    assert gate.revoked == {"ea"} and not gate.lets("ea")
    assert store.requests == before
    assert not a.holds(clock) and a.budget.send_blocked("ea", ["vma"]) is not None


def test_a_forced_member_is_in_the_record_before_it_leaves_rotation_when_the_store_answers() -> None:
    """Finding 3: vmb's last safe moment comes while vma holds the only place. Its FORCE write goes at once and
    it leaves rotation only once the record lists it as forced; it stays listed while its preparation runs."""
    clock = FakeClock()
    store = CasStore(clock)
    nb = clock.now() + timedelta(minutes=10)
    a = Vm(store, clock, "vma", "ea", nb + timedelta(hours=1))
    b = Vm(store, clock, "vmb", "eb", nb)
    run([a, b], clock, 2)
    assert a.out and not b.out
    clock.advance((nb - timedelta(seconds=65) - clock.now()).total_seconds())  # its last safe moment
    assert not b.tick(settle=False).lets("eb") and not b.out, "not before its FORCE write landed"
    b.budget.wait_idle(5)
    b.tick()
    assert b.out and (h := record(store).holder("vmb")) is not None and h.why == FORCED
    run([a, b], clock, 20)  # its preparation started: no longer "due", still forced and listed
    assert (h := record(store).holder("vmb")) is not None and h.why == FORCED
    assert b.budget.reason_for("eb") == FORCED


def test_a_forced_member_whose_store_does_not_answer_leaves_after_force_wait_and_is_written_once_it_answers() -> None:
    clock = FakeClock()
    store = CasStore(clock)
    nb = clock.now() + timedelta(seconds=30)  # past its last safe moment at once
    b = Vm(store, clock, "vmb", "eb", nb)
    b.link.hang = threading.Event()
    assert not b.tick(settle=False).lets("eb")
    clock.advance(FORCE_WAIT_S / 2)
    assert not b.tick(settle=False).lets("eb")
    clock.advance(FORCE_WAIT_S / 2)
    assert b.tick(settle=False).lets("eb"), "the workload's safety before the count: out after FORCE_WAIT_S"
    b.link.hang.set()
    b.link.hang = None
    assert b.budget.wait_idle(5)
    run([b], clock, 3)
    assert (h := record(store).holder("vmb")) is not None and h.why == FORCED


def test_a_forced_member_whose_store_fails_leaves_at_once_and_keeps_trying_the_write() -> None:
    clock = FakeClock()
    store = CasStore(clock)
    b = Vm(store, clock, "vmb", "eb", clock.now() + timedelta(hours=1), event_type="Preempt")
    b.link.cut = True
    b.tick()
    assert b.tick().lets("eb") and b.out
    run([b], clock, 30)
    b.link.cut = False
    run([b], clock, 40)  # the backoff tops out at 30 s
    assert (h := record(store).holder("vmb")) is not None and h.why == FORCED


def test_another_zone_cannot_take_a_place_while_a_forced_member_is_out() -> None:
    """Finding 3: with spread zone, a member of zone 2 waits while a forced member of zone 1 is out, even after
    the forced member's preparation started (its event no longer due)."""
    clock = FakeClock()
    store = CasStore(clock)
    forced = Vm(store, clock, "a", "ea", clock.now() + timedelta(hours=1), zone="1", event_type="Terminate",
                max_unavailable=2, spread="zone")
    other = Vm(store, clock, "b", "eb", clock.now() + timedelta(hours=1), zone="2", max_unavailable=2,
               spread="zone")
    run([forced], clock, 2)
    assert forced.out
    seen = run([forced, other], clock, 30)
    assert not other.out and all(out == ["a"] for out in seen)
    assert record(store).waiter("b") is not None


def test_a_forced_member_never_blocks_its_own_approval_and_a_multi_vm_event_is_approved_once_all_are_out() -> None:
    """Finding 3: a 3-VM event whose members were forced is approved early once every one of them is forced or
    holds a place; a forced member does not wait for its own name (even while its FORCE write has not landed)."""
    clock = FakeClock()
    store = CasStore(clock)
    nb = clock.now() + timedelta(seconds=40)
    vms = [Vm(store, clock, n, "e", nb) for n in ("a", "b", "c")]
    names = ["a", "b", "c"]
    run(vms, clock, 2)
    assert all(vm.out for vm in vms)
    for _ in range(3):  # a member waiting on the others' places reads the record again
        blocked = [vm.name for vm in vms if vm.budget.approval_blocked("e", names) is not None]
        run(vms, clock, 3)
    assert blocked == []
    lone = Vm(CasStore(clock), clock, "d", "e2", nb)
    lone.link.cut = True
    lone.tick()
    assert lone.tick().lets("e2") and lone.budget.approval_blocked("e2", ["d"]) is None
    assert lone.budget.send_blocked("e2", ["d"]) is None



def test_a_member_restarted_while_out_keeps_a_place_its_lease_still_covers_and_gives_back_one_it_lost() -> None:
    """maintd restarted while out: its first read finds its own place and keeps it (renewed at once); after a
    downtime longer than release_after, its entry is gone (another member dropped it): it returns to rotation."""
    clock = FakeClock()
    store = CasStore(clock)
    nb = clock.now() + timedelta(hours=2)
    a = Vm(store, clock, "vma", "ea", nb)
    run([a], clock, 2)
    again = Vm(store, clock, "vma", "ea", nb)  # the same VM after a restart: out, its preparation started
    again.out = True
    for _ in range(3):
        gate = again.budget.tick([], True, [again.want])
        again.budget.wait_idle(5)
    assert not gate.revoked and again.holds(clock) and again.budget.send_blocked("ea", ["vma"]) is None
    other = Vm(store, clock, "vmb", "eb", nb)
    clock.advance(RELEASE_AFTER + 1)  # down longer than release_after: vmb drops it and takes the place
    run([other], clock, 2)
    assert other.out and record(store).holder("vma") is None
    late = Vm(store, clock, "vma", "ea", nb)
    late.out = True
    for _ in range(3):
        gate = late.budget.tick([], True, [late.want])
        late.budget.wait_idle(5)
    assert gate.revoked == {"ea"} and not late.holds(clock)


def test_the_approvers_recheck_withholds_a_send_once_the_lease_ended_even_before_the_loop_looked() -> None:
    """An approval ordered while vma held its place: immediately before the send (the approver's thread), the
    coordinator's recheck asks the budget's lease against the clock, so a send after the lease ended is withheld
    even when the loop has not run a pass since (a pause between the order and the send)."""
    clock = FakeClock()
    store = CasStore(clock)
    a = Vm(store, clock, "vma", "ea", clock.now() + timedelta(hours=2))
    run([a], clock, 2)
    order = SimpleNamespace(event_id="ea", resources=("vma", "vmb"))
    coordinator = SimpleNamespace(scheduled=frozenset({"ea"}), budget=a.budget)
    assert Coordinator.still_right(coordinator, order) is None  # type: ignore[arg-type]
    clock.advance(RELEASE_AFTER)
    assert "no longer holds its place" in (Coordinator.still_right(coordinator, order) or "")  # type: ignore[arg-type]
