"""B2 with B3 once the platform acts (issue 34's follow-ups): a place lost for an event the platform acts on now (it
is Started, this VM's approval was sent, an operator approved it by hand) or past its last safe moment keeps the VM
out of rotation, written into the record as forced so every member counts it; it is never returned to rotation
(the platform would take it down while it serves). An event nobody approved still returns to rotation."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

from agent.clock import FakeClock
from agent.fleet.budget_rules import FORCED
from agent.model.approval import APPROVAL_KEY, MANUAL_APPROVAL_KEY, acts_now
from tests.budget_fakes import CasStore
from tests.fleet.test_budget_lease import RELEASE_AFTER, Vm, record, run


def restarted(store: CasStore, clock: FakeClock, name: str, event: str, nb, committed: bool):  # type: ignore[no-untyped-def]
    """The VM after a restart while out for `event` (its preparation started): three loop passes."""
    vm = Vm(store, clock, name, event, nb)
    vm.out, vm.want = True, replace(vm.want, committed=committed)
    for _ in range(3):
        gate = vm.budget.look()
        vm._revoke(gate)
        gate = vm.budget.tick([], vm.out, [vm.want])
        vm._revoke(gate)
        vm.budget.wait_idle(5)
    return vm


def test_a_restart_while_out_for_an_approved_event_the_record_does_not_list_keeps_it_out_and_counted() -> None:
    """vmb holds the only place; vma's operator approved vma's event by hand (`maintd approve`), so vma prepared
    without a place. maintd restarts on vma: its first read finds no place of vma's. It stays out of rotation
    (the platform acts now) and is written as forced: vmb's zone-mates count it, nobody else may take a place."""
    clock = FakeClock()
    store = CasStore(clock)
    nb = clock.now() + timedelta(hours=2)
    b = Vm(store, clock, "vmb", "eb", nb)
    run([b], clock, 2)
    assert b.out
    a = restarted(store, clock, "vma", "ea", nb, committed=True)
    assert a.out and a.returned == 0, "still out of rotation: never handed back while the platform acts"
    assert (h := record(store).holder("vma")) is not None and h.why == FORCED and h.event == "ea"
    assert "lost its place" not in a.health.reports["budget"][1]
    c = Vm(store, clock, "vmc", "ec", nb)
    run([c], clock, 3)
    assert not c.out, "vma counts as out: no third place by choice"


def test_a_restart_while_out_for_an_event_nobody_approved_still_returns_it_to_rotation() -> None:
    """The same restart for an event not approved (and hours before its last safe moment): back in rotation."""
    clock = FakeClock()
    store = CasStore(clock)
    nb = clock.now() + timedelta(hours=2)
    a = restarted(store, clock, "vma", "ea", nb, committed=False)
    assert not a.out and a.returned == 1


def test_a_holder_whose_approval_was_sent_stays_out_when_its_lease_ends_and_is_written_forced() -> None:
    """vma holds its place and its approval went out; then its store fails past its lease. It keeps the VM out
    (the reboot is coming), and once the store answers it is in the record as forced."""
    clock = FakeClock()
    store = CasStore(clock)
    nb = clock.now() + timedelta(hours=2)
    a = Vm(store, clock, "vma", "ea", nb)
    run([a], clock, 2)
    assert a.out
    a.want = replace(a.want, committed=True)
    a.link.cut = True
    for _ in range(int(RELEASE_AFTER) + 5):
        gate = a.budget.look()
        a._revoke(gate)
        gate = a.budget.tick([], True, [a.want])
        a._revoke(gate)
        a.budget.wait_idle(5)
        clock.advance(1)
    assert a.out and a.returned == 0
    assert a.budget.send_blocked("ea", ["vma"]) is None, "it counts itself out: forced"
    a.link.cut = False
    for _ in range(35):  # its backoff tops out at 30 s
        a.budget.tick([], True, [a.want])
        a.budget.wait_idle(5)
        clock.advance(1)
    assert (h := record(store).holder("vma")) is not None and h.why == FORCED


def test_the_platform_acts_on_an_event_started_sent_or_approved_by_hand() -> None:
    assert acts_now("Started", {})
    assert acts_now("Scheduled", {APPROVAL_KEY: {"status": "sent", "by": "vma", "at": "x"}})
    assert acts_now("Scheduled", {APPROVAL_KEY: {"status": "sending", "by": "vma", "at": "x"}})
    assert acts_now("Scheduled", {MANUAL_APPROVAL_KEY: {"by": "ops", "at": "x"}})
    assert not acts_now("Scheduled", {APPROVAL_KEY: {"status": "failed", "by": "vma", "at": "x"}})
    assert not acts_now("Scheduled", {})


def test_maintd_fleet_shows_this_vms_lost_place_when_and_why_and_the_odd_records_count() -> None:
    """vma holds its place; the record gets a holder renewed in 2099 (an odd record: its entry and its stamp); then
    vma's place is lost (its lease ended while its store failed). `/v1/fleet` (the budget's view) and `maintd
    fleet` say which event lost its place, when and why, and how many odd records were found and ignored."""
    from datetime import UTC, datetime

    from agent.cli.cliviews import fleet_text
    from agent.fleet.budget_rules import CHOSEN, Entry, places_blob, render_places

    clock = FakeClock()
    store = CasStore(clock)
    a = Vm(store, clock, "vma", "ea", clock.now() + timedelta(hours=2))
    run([a], clock, 2)
    y2099, now = datetime(2099, 1, 1, tzinfo=UTC), record(store)
    store.blobs[places_blob("web")] = (render_places("web", replace(
        now, holders=(*now.holders, Entry("ghost", "1", "0", "e-ghost", CHOSEN, y2099, y2099)),
        members={**now.members, "ghost": y2099})), "forged")
    run([a], clock, RELEASE_AFTER / 4 + 2)  # its renewal reads the record
    a.link.cut = True
    run([a], clock, RELEASE_AFTER)
    assert a.returned == 1
    view = a.budget.publish()
    assert [x["event_id"] for x in view["lost"]] == ["ea"] and "within its lease" in view["lost"][0]["reason"]
    assert view["lost"][0]["at"] is not None and view["odd_records"] == 2
    shown = fleet_text({"vm_name": "vma", "backend": "azure_blob", "events": [], "budget": view})
    assert f"this VM lost its place for ea at {view['lost'][0]['at']}" in shown
    assert "back in rotation, queued again" in shown
    assert "odd records: 2 found and ignored" in shown
