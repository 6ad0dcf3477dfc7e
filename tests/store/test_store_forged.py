"""A marker under this VM's name that it did not write (a forged `ready`): noticed while preparing (one read of its
own marker when due) or in a listing, rewritten, and an Error `coordination`/`store_marker` that makes this VM's
marker say unhealthy, so the fleet gate holds on every VM."""

from __future__ import annotations

from agent.clock import FakeClock
from agent.coordination.store.store_protocol import PREPARING, READY, marker_blob, marker_record
from agent.health.health_store import HealthState
from agent.loop.tick import Tick
from agent.policy.approval_policy import Profile
from tests.store.test_store_coordinator import EVENT, ME, OTHER, setup, ticks, tracked
from tests.store.test_store_exchange import MemoryStore, Rig


def forge(blobs: MemoryStore, vm: str) -> None:
    """What anything holding the container's role can do: write a `ready` marker under another VM's name."""
    blobs.put(marker_blob(EVENT, vm), marker_record(EVENT, vm, READY))


def test_a_preparing_vm_notices_a_forged_ready_marker_and_rewrites_it(clock: FakeClock, logs: list[dict]) -> None:
    """The VM is still preparing; someone writes `ready` under its name. At its next check (2.5 s, backing off) it
    reads its own marker, sees an ETag it did not write, logs store.marker_forged, reports it and writes
    `preparing` again (today: it never looks, and the forged `ready` stands)."""
    blobs = MemoryStore()
    rig = Rig(blobs, clock)
    vms = (ME, OTHER)
    rig.sync(vms, ME, PREPARING, listing=False)
    forge(blobs, ME)
    clock.advance(3)
    rig.sync(vms, ME, PREPARING, listing=False)
    rig.sync(vms, ME, PREPARING, listing=False)
    assert blobs.ops == ["put", "put", "read", "put"]
    assert blobs.blobs[marker_blob(EVENT, ME)][0]["state"] == PREPARING
    assert [e["event"] for e in logs if e["log_level"] == "error"] == ["store.marker_forged"]
    assert rig.reports[-1][:2] == ("store_marker", False)


def test_a_preparing_vm_reads_its_marker_backing_off_and_nothing_while_it_is_its_own(clock: FakeClock,
                                                                                     logs: list[dict]) -> None:
    """Its own marker untouched: reads back off (2.5 s, 5 s, 10 s cap for two VMs), no report, nothing rewritten."""
    blobs = MemoryStore()
    rig = Rig(blobs, clock)
    vms = (ME, OTHER)
    rig.sync(vms, ME, PREPARING, listing=False)
    for _ in range(40):
        clock.advance(1)
        rig.sync(vms, ME, PREPARING, listing=False)
    assert blobs.ops.count("put") == 1 and 4 <= blobs.ops.count("read") <= 6
    assert rig.reports == [("store", True, "the store answers")]
    assert not [e for e in logs if e["event"] == "store.marker_forged"]


def test_a_forged_marker_is_an_error_that_holds_the_fleet_gate(tmp_path, clock: FakeClock) -> None:
    """On the backend: Error health `coordination`/`store_marker`, and this VM's marker rewritten `unhealthy` (what
    the other VMs' fleet gates count); the Error stays until the event ends."""
    blobs = MemoryStore()
    coord, _, health = setup(tmp_path, clock, blobs)
    t = tracked(clock)
    profile = Profile(name="default", approval="auto")
    ticks(coord, t, profile, pending=lambda t: ["checkpoint"])
    forge(blobs, ME)
    clock.advance(3)
    ticks(coord, t, profile, pending=lambda t: ["checkpoint"], n=4)
    state = {(e.report.source_id, e.report.property): e.report.state for e in health.snapshot()}
    assert state[("coordination", "store_marker")] == HealthState.ERROR
    record = blobs.blobs[marker_blob(EVENT, ME)][0]
    assert (record["state"], record["health"]) == (PREPARING, "unhealthy")
    coord.tick(Tick.of({}, ME, profile, False, lambda t: [],
                       now=clock.now(), monotonic=clock.monotonic()))
    state = {(e.report.source_id, e.report.property): e.report.state for e in health.snapshot()}
    assert state[("coordination", "store_marker")] == HealthState.OK


def test_a_ready_vm_notices_a_forged_marker_in_its_listing(clock: FakeClock, logs: list[dict]) -> None:
    """Ready and listing: the listing shows its marker at an ETag it did not write (someone rewrote it `ready`
    with health ok while it said unhealthy): reported, and its own marker written again."""
    blobs = MemoryStore()
    rig = Rig(blobs, clock)
    vms = (ME, OTHER)
    rig.exchange.run(EVENT, vms, ME, (READY, "unhealthy"), True, clock.monotonic())
    assert rig.exchange.wait_idle(5)
    rig.exchange.apply(clock.monotonic())
    forge(blobs, ME)
    clock.advance(3)
    for _ in range(2):
        rig.exchange.run(EVENT, vms, ME, (READY, "unhealthy"), True, clock.monotonic())
        assert rig.exchange.wait_idle(5)
        rig.exchange.apply(clock.monotonic())
    assert blobs.blobs[marker_blob(EVENT, ME)][0]["health"] == "unhealthy"
    assert any(e["event"] == "store.marker_forged" for e in logs)
    assert ("store_marker", False) in [r[:2] for r in rig.reports]


def test_a_listing_that_gives_etags_bare_is_not_taken_for_forgery(clock: FakeClock, logs: list[dict]) -> None:
    """List Blobs gives ETags bare (0x8D...), a put's answer quoted ("0x8D..."), as Azure and Azurite do: the same
    version, so nothing is reported or rewritten."""
    class Bare(MemoryStore):
        def put(self, name: str, metadata) -> str:
            return f'"{super().put(name, metadata)}"'

    blobs = Bare()
    rig = Rig(blobs, clock)
    for _ in range(3):
        rig.sync((ME, OTHER), ME, READY)
        clock.advance(30)
    assert blobs.ops == ["put", "list", "list", "list"]
    assert not [e for e in logs if e["event"] == "store.marker_forged"]
