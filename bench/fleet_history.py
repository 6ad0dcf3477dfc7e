"""Cost of the fleet history (store backend), in-process over an in-memory store that counts requests as the blob
store would (a listing is one request per 250 blobs).

Write: each of 200 VMs records its outcome for each of 40 events through `FleetHistory.write` (the real lane; the
approval lookup and the create). Read: `FleetHistory.read` of the last 7 days with those 8000 records spread over
the week (what `maintd fleet --history` asks), its requests, and the CPU of parsing and summarising them. Also
the size of one record's metadata (blob metadata holds 8 KiB). Loop: the CPU of the loop's look for events that
ended (`EventEnds.tick`, every 2 s) with 200 events kept in the state store, 100 of them gone and recorded.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

from agent.clock import SystemClock
from agent.coordination.store.store_protocol import Item
from agent.fleet.fleet_history import FleetHistory
from agent.fleet.history_protocol import VmOutcome, to_metadata
from bench.common import percentile, write

VMS, EVENTS, PAGE = 200, 40, 250
NOW = datetime(2026, 11, 27, 12, 0, tzinfo=UTC)


class CountingStore:
    """Blobs in a dict; every call counted like a request (a listing: one per PAGE blobs)."""

    def __init__(self) -> None:
        self.blobs: dict[str, tuple[dict[str, str], datetime]] = {}
        self.requests: dict[str, int] = {"put": 0, "list": 0, "create": 0, "replace": 0, "read": 0}

    def put(self, name: str, metadata: Mapping[str, str]) -> str | None:
        self.requests["put"] += 1
        self.blobs[name] = (dict(metadata), NOW)
        return '"1"'

    def list_folder(self, prefix: str) -> tuple[list[Item], datetime]:
        items = [Item(n, m, '"1"', t) for n, (m, t) in sorted(self.blobs.items()) if n.startswith(prefix)]
        self.requests["list"] += max(1, math.ceil(len(items) / PAGE))
        return items, NOW

    def create(self, name: str, metadata: Mapping[str, str]) -> str | None:
        self.requests["create"] += 1
        if name in self.blobs:
            return None
        self.blobs[name] = (dict(metadata), NOW)
        return '"1"'

    def replace(self, name: str, metadata: Mapping[str, str], etag: str) -> str | None:
        self.requests["replace"] += 1
        return None

    def read(self, name: str) -> tuple[dict[str, str], str] | None:
        self.requests["read"] += 1
        return None

    def close(self) -> None:
        pass


def outcome(event: int, vm: int) -> VmOutcome:
    start = NOW - timedelta(days=6, hours=12) + timedelta(hours=4 * event)
    out = start + timedelta(seconds=30 * (vm % 7))
    return VmOutcome(event_id=f"{event:08x}-0000-4000-8000-000000000000", event_type="Reboot", vm=f"web_{vm:08x}",
                     not_before=start + timedelta(minutes=15), out_at=out, back_at=out + timedelta(minutes=9),
                     ready_at=out + timedelta(seconds=45), started_at=out + timedelta(minutes=2),
                     approved_by="web_00000000" if vm == 0 else None,
                     approved_at=out + timedelta(minutes=1) if vm == 0 else None,
                     handlers=(("drain", "scheduled", "ok"), ("checkpoint", "scheduled", "ok"),
                               ("drain", "completed", "ok")), chosen=None, ended_at=out + timedelta(minutes=9),
                     day=(start + timedelta(minutes=15)).date())


def loop_look(rounds: int) -> list[float]:
    """CPU (ms) of each of `rounds` looks for ended events, the first one after a start included."""
    import tempfile
    from pathlib import Path

    from agent.clock import FakeClock
    from agent.loop.event_end import CHECK_EVERY, EventEnds
    from agent.model.events import Event
    from agent.model.tracker import Tracked, Transition
    from tests.prepare.test_runner import make, spec

    clock = FakeClock()
    runner, store, _ = make(Path(tempfile.mkdtemp(prefix="maintd-bench-")), clock, spec("prep"),
                            spec("undo", phases=("completed",)))
    tracked = {f"E{i:04d}": Tracked(Event(f"E{i:04d}", "Reboot", "Scheduled", tuple(f"vm{j}" for j in range(20)),
                                          not_before=clock.now() + timedelta(minutes=15)), i % 2 == 0, clock.now(),
                                    "b", False) for i in range(200)}
    store.apply(tracked, [])
    store.apply({}, [Transition("vanished", t.event, t.names_self, clock.now(), outcome="completed")
                     for t in tracked.values()])
    for eid in list(tracked)[::2]:
        store.record(eid, "history", {"status": "recorded", "attempt": 1}, wait=False)
    ends = EventEnds(store, runner, CountingHistory(), clock, lambda: "web")  # type: ignore[arg-type]
    cpu = []
    for _ in range(rounds):
        clock.advance(CHECK_EVERY)
        t0 = time.process_time()
        ends.tick("vm0")
        cpu.append((time.process_time() - t0) * 1000)
    store.wait_saved(10)
    return cpu


class CountingHistory:
    def write(self, *_: Any) -> None:
        pass


def run(quick: bool = False) -> dict[str, Any]:
    vms, events = (20, 8) if quick else (VMS, EVENTS)
    store = CountingStore()
    history = FleetHistory(lambda: store, lambda *_: None, SystemClock())
    for e in range(events):
        for v in range(vms):
            history.write("web", outcome(e, v), 1)
    history.wait_idle(120)
    history.stop()
    writes = dict(store.requests)
    per_vm_event = {op: round(n / (vms * events), 2) for op, n in writes.items() if n}
    store.requests = dict.fromkeys(store.requests, 0)
    cpu = []
    for _ in range(3 if quick else 10):
        t0 = time.process_time()
        body = history.read("web", NOW - timedelta(days=7), NOW)
        cpu.append((time.process_time() - t0) * 1000)
    reads = store.requests["list"] // len(cpu)
    size = sum(len(k) + len(v) for k, v in to_metadata(outcome(0, 0)).items())
    look = loop_look(20 if quick else 200)
    shown = len(body["events"])
    print(f"  write: store requests per VM per event {per_vm_event}", flush=True)
    print(f"  read 7 days ({vms * events} records, {shown} events): {reads} list requests, CPU p50 "
          f"{percentile(cpu, 50):.0f} ms", flush=True)
    print(f"  one record's metadata: {size} bytes", flush=True)
    print(f"  the loop's look for ended events: first {look[0]:.2f} ms, then p50 {percentile(look[1:], 50):.3f} ms, "
          f"p99 {percentile(look[1:], 99):.3f} ms", flush=True)
    return write("fleet_history", {"vms": vms, "events": events, "write_requests_per_vm_event": per_vm_event,
                                   "read_list_requests": reads, "read_cpu_ms": cpu, "record_bytes": size,
                                   "loop_look_cpu_ms": look}, [
        ("fleet history write: store requests per VM per event (list / create)",
         f"{per_vm_event.get('list', 0)} / {per_vm_event.get('create', 0)}", "≤ 2 writes", per_vm_event.get(
             "create", 0) <= 2 and not per_vm_event.get("put") and not per_vm_event.get("replace")),
        (f"`maintd fleet --history --since 7d`, {vms} VMs × {events} events: list requests / CPU p50",
         f"{reads} / {percentile(cpu, 50):.0f} ms", "reported", True),
        ("one history record's metadata", f"{size} bytes", "< 8 KiB", size < 8192),
        ("the loop's look for ended events every 2 s (200 events kept, 100 gone and recorded): first / p50 / p99 CPU",
         f"{look[0]:.2f} / {percentile(look[1:], 50):.3f} / {percentile(look[1:], 99):.3f} ms", "< 1 ms (p99)",
         percentile(look[1:], 99) < 1.0)], quick)
