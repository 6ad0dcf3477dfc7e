"""The coordinator on the store backend (an in-memory store, a fake clock): profiles, manual, gates and dry runs
keep their meaning; the claim is taken only right before a POST; a claimer too slow to post leaves it."""

from __future__ import annotations

from datetime import timedelta

import tests.needs_azure  # noqa: F401 - skips this module without the azure extra
from agent.coordination.coordination_settings import AzureBlobConfig, CoordinationConfig
from agent.coordination.coordinator import Coordinator
from agent.coordination.store.store_backend import StoreBackend
from agent.coordination.store.store_protocol import READY, approval_blob, marker_blob, marker_record
from agent.health.health_store import HealthState, HealthStore
from agent.loop.tick import Tick
from agent.model.events import Event
from agent.model.gate_specs import FleetGate, Gates
from agent.model.tracker import Tracked
from agent.policy.approval_policy import Profile
from agent.state.state_store import Store
from agent.telemetry.metrics import Metrics
from tests.stopping import stopped_at_end
from tests.store.test_store_exchange import MemoryStore

EVENT = "5F1E2B0C-9A4D-4C61-8E2F-1A2B3C4D5E6F"
VMS = ("web_3f2a9c1b", "web_7c0d11e4")
ME, OTHER = VMS


def setup(tmp_path, clock, blobs: MemoryStore, approve=None, **settings):
    sent: list[list[str]] = []
    cfg = CoordinationConfig(backend="azure_blob", azure_blob=AzureBlobConfig(account_url="https://a.blob.core.windows.net"),
                             takeover_after=60.0, **settings)
    health = HealthStore(clock)
    backend = StoreBackend(cfg.azure_blob, token=lambda r, c: b"", clock=clock, metrics=Metrics(), health=health,
                           secret=lambda key, path: None, on_change=lambda: None, takeover_after=lambda: 60.0,
                           local_health=lambda: health.to_json(False))
    stopped_at_end(backend)
    backend.exchange.client.open_store = lambda: blobs
    coord = Coordinator(cfg, approve=approve or sent.append, store=Store(tmp_path, clock), clock=clock,
                        metrics=Metrics(), poll_interval=1.0, backend=backend, health=health,
                        local_health=lambda: health.to_json(False))
    stopped_at_end(coord)
    return coord, sent, health


def tracked(clock):
    e = Event(EVENT, "Reboot", "Scheduled", VMS, not_before=clock.now() + timedelta(minutes=15))
    return {EVENT: Tracked(e, True, clock.now(), "b", False)}


def ticks(coord, t, profile, n=3, pending=lambda t: [], dry_run=False):
    clock = coord.approver.clock  # the clock the test injected; the loop reads it once per pass for the Tick
    for _ in range(n):
        coord.tick(Tick.of(t, ME, profile, dry_run, pending,
                           now=clock.now(), monotonic=clock.monotonic()))
        assert coord.wait_idle(5)


def other_ready(blobs: MemoryStore) -> None:
    blobs.put(marker_blob(EVENT, OTHER), marker_record(EVENT, OTHER, READY))


def test_auto_claims_posts_once_and_records_approved(tmp_path, clock) -> None:
    """Both VMs ready: this VM claims, sends the one POST, and the record says approved by it."""
    blobs = MemoryStore()
    other_ready(blobs)
    coord, sent, health = setup(tmp_path, clock, blobs)
    ticks(coord, tracked(clock), Profile(name="default", approval="auto"))
    assert sent == [[EVENT]]
    record = blobs.blobs[approval_blob(EVENT)][0]
    assert (record["state"], record["by"]) == ("approved", ME)
    store = {(e.report.source_id, e.report.property): e.report.state for e in health.snapshot()}
    assert store[("coordination", "store")] == HealthState.OK


def test_never_records_readiness_but_never_claims(tmp_path, clock) -> None:
    """approval: never — this VM's marker says ready (the fleet can count it), but it claims nothing."""
    blobs = MemoryStore()
    other_ready(blobs)
    coord, sent, _ = setup(tmp_path, clock, blobs)
    ticks(coord, tracked(clock), Profile(name="freeze", approval="never"))
    assert sent == [] and approval_blob(EVENT) not in blobs.blobs
    assert blobs.blobs[marker_blob(EVENT, ME)][0]["state"] == READY


def test_manual_claims_only_after_the_operators_go(tmp_path, clock) -> None:
    """approval: manual — no claim until `maintd approve`, then the claim and one POST."""
    blobs = MemoryStore()
    other_ready(blobs)
    coord, sent, _ = setup(tmp_path, clock, blobs)
    t = tracked(clock)
    ticks(coord, t, Profile(name="m", approval="manual"))
    assert sent == [] and approval_blob(EVENT) not in blobs.blobs and "list" not in blobs.ops
    coord.store.record(EVENT, "manual_approval", {"by": "uid 0"})
    ticks(coord, t, Profile(name="m", approval="manual"))
    assert sent == [[EVENT]]


def test_the_fleet_gate_counts_health_from_the_markers_and_holds_before_the_claim(tmp_path, clock) -> None:
    """Fleet gate at 0 %: the other VM's marker says unhealthy, so the gate holds (no peer is asked over HTTP)
    and, gates running before the claim, no record is written; its marker healthy again, the one POST goes."""
    blobs = MemoryStore()
    blobs.put(marker_blob(EVENT, OTHER), marker_record(EVENT, OTHER, READY, "unhealthy"))
    coord, sent, _ = setup(tmp_path, clock, blobs)
    gated = Profile(name="default", approval="auto", gates=Gates(fleet=FleetGate(max_percent_unhealthy=0)))
    t = tracked(clock)
    ticks(coord, t, gated)
    assert sent == [] and approval_blob(EVENT) not in blobs.blobs
    held = coord.view(EVENT)["approval_held"]
    assert held["gate"] == "fleet" and OTHER in held["reason"]
    other_ready(blobs)
    clock.advance(10)
    ticks(coord, t, gated)
    clock.advance(5)  # a held gate is asked again at most every approval_retry_for / 12 (issue 28 #5)
    ticks(coord, t, gated)
    assert sent == [[EVENT]]


def test_this_vms_health_goes_into_its_marker_and_is_rewritten_when_it_changes(tmp_path, clock) -> None:
    """A health report in Error on this VM: its marker says unhealthy (the other VMs' fleet gates count it),
    rewritten as soon as the verdict changes."""
    blobs = MemoryStore()
    coord, _, health = setup(tmp_path, clock, blobs)
    t = tracked(clock)
    profile = Profile(name="default", approval="auto")
    ticks(coord, t, profile)
    assert blobs.blobs[marker_blob(EVENT, ME)][0]["health"] == "ok"
    health.set("disk", "root", HealthState.ERROR, "full")
    ticks(coord, t, profile)
    assert blobs.blobs[marker_blob(EVENT, ME)][0]["health"] == "unhealthy"


def test_a_dry_run_claims_nothing(tmp_path, clock) -> None:
    """dry_run: the whole pipeline runs, the marker is written, no claim and no POST."""
    blobs = MemoryStore()
    other_ready(blobs)
    coord, sent, _ = setup(tmp_path, clock, blobs)
    ticks(coord, tracked(clock), Profile(name="default", approval="auto"), dry_run=True)
    assert sent == [] and approval_blob(EVENT) not in blobs.blobs


def test_a_vm_still_preparing_records_preparing_and_nobody_claims(tmp_path, clock) -> None:
    """This VM's handlers still run: its marker says preparing (one put, no list: it cannot claim, so it has
    nothing to look for), and neither it nor the other VM may claim."""
    blobs = MemoryStore()
    other_ready(blobs)
    blobs.ops.clear()
    coord, sent, _ = setup(tmp_path, clock, blobs)
    ticks(coord, tracked(clock), Profile(name="default", approval="auto"), pending=lambda t: ["checkpoint"], n=5)
    assert sent == [] and blobs.blobs[marker_blob(EVENT, ME)][0]["state"] == "preparing"
    assert blobs.ops == ["put"]


def test_a_failed_post_releases_the_claim_for_another_vm(tmp_path, clock) -> None:
    """IMDS refuses the POST (400, not retried): the record is rewritten `released`, which any VM may take at once."""
    from agent.errors import ImdsRequestRejected

    def refuse(ids: list[str]) -> None:
        raise ImdsRequestRejected("IMDS rejected the request (400)", 400)

    blobs = MemoryStore()
    other_ready(blobs)
    coord, _, _ = setup(tmp_path, clock, blobs, approve=refuse)
    ticks(coord, tracked(clock), Profile(name="default", approval="auto"), n=2)
    assert blobs.blobs[approval_blob(EVENT)][0]["state"] == "released"


def test_a_claim_that_took_half_of_takeover_after_is_not_posted(tmp_path, clock, logs) -> None:
    """The create took 31 s (takeover_after 60 s): another VM may take the claim over from 60 s on, so this VM
    must not be posting by then; it sends nothing and releases the claim."""

    class SlowStore(MemoryStore):
        def create(self, name, metadata):
            clock.advance(31)
            return super().create(name, metadata)

    blobs = SlowStore()
    other_ready(blobs)
    coord, sent, _ = setup(tmp_path, clock, blobs)
    ticks(coord, tracked(clock), Profile(name="default", approval="auto"), n=2)
    assert sent == []
    assert blobs.blobs[approval_blob(EVENT)][0]["state"] == "released"
    assert any(e["event"] == "store.claim_too_old" for e in logs)


def test_a_listing_that_shows_the_marker_healthy_again_opens_the_held_gate_at_once(tmp_path, clock) -> None:
    """Issue 35 #3 on the store: the gate's input is the last listing; the listing that shows the other VM healthy
    again decides at once (on the pass it wakes), before the periodic 5 s recheck of the gates."""
    blobs = MemoryStore()
    blobs.put(marker_blob(EVENT, OTHER), marker_record(EVENT, OTHER, READY, "unhealthy"))
    coord, sent, _ = setup(tmp_path, clock, blobs)
    gated = Profile(name="default", approval="auto", gates=Gates(fleet=FleetGate(max_percent_unhealthy=0)))
    t = tracked(clock)
    ticks(coord, t, gated)
    assert sent == [] and coord.view(EVENT)["approval_held"]["gate"] == "fleet"
    held_at = clock.monotonic()
    other_ready(blobs)
    lists = blobs.ops.count("list")
    while blobs.ops.count("list") == lists and clock.monotonic() - held_at < 30:
        clock.advance(0.25)
        ticks(coord, t, gated, n=1)
    listed_at = clock.monotonic()
    ticks(coord, t, gated, n=2)  # the pass the listing woke, and the one its approval's outcome wakes
    assert sent == [[EVENT]] and clock.monotonic() == listed_at < held_at + 5
