"""Cost of the fleet history (store backend), in-process over an in-memory store that counts requests as the blob
store would (a listing is one request per 250 blobs).

Write: each of 200 VMs records its outcome for each of 40 events through `FleetHistory.write` (the real lane; the
approval lookup and the create). Read: `FleetHistory.read` of the last 7 days with those 8000 records spread over
the week (what `maintd fleet --history` asks), its requests, and the CPU of parsing and summarising them. Also
the size of one record's metadata (blob metadata holds 8 KiB).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

from agent.clock import SystemClock
from agent.coordination.store.fleet_history import FleetHistory
from agent.coordination.store.history_protocol import VmOutcome, to_metadata
from agent.coordination.store.store_protocol import Item
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
    shown = len(body["events"])
    print(f"  write: store requests per VM per event {per_vm_event}", flush=True)
    print(f"  read 7 days ({vms * events} records, {shown} events): {reads} list requests, CPU p50 "
          f"{percentile(cpu, 50):.0f} ms", flush=True)
    print(f"  one record's metadata: {size} bytes", flush=True)
    return write("fleet_history", {"vms": vms, "events": events, "write_requests_per_vm_event": per_vm_event,
                                   "read_list_requests": reads, "read_cpu_ms": cpu, "record_bytes": size}, [
        ("fleet history write: store requests per VM per event (list / create)",
         f"{per_vm_event.get('list', 0)} / {per_vm_event.get('create', 0)}", "≤ 2 writes", per_vm_event.get(
             "create", 0) <= 2 and not per_vm_event.get("put") and not per_vm_event.get("replace")),
        (f"`maintd fleet --history --since 7d`, {vms} VMs × {events} events: list requests / CPU p50",
         f"{reads} / {percentile(cpu, 50):.0f} ms", "reported", True),
        ("one history record's metadata", f"{size} bytes", "< 8 KiB", size < 8192)], quick)
