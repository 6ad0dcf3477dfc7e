"""Cost per poll as the document grows: parse + diff of 0..1000 events, Resources of 1..1000 names."""

from __future__ import annotations

import gc
import json
import time
import tracemalloc
from datetime import datetime, timezone

from agent import events as events_mod
from agent.events import parse_document
from agent.tracker import diff
from bench.common import percentile, write

NOW = datetime(2026, 11, 22, 12, 0, tzinfo=timezone.utc)


def document(events: int, resources: int, incarnation: int = 1) -> bytes:
    names = [f"vm-{i}" for i in range(resources)]
    return json.dumps({"DocumentIncarnation": incarnation, "Events": [
        {"EventId": f"{i:08X}-0000-4000-8000-000000000000", "EventType": "Reboot", "ResourceType": "VirtualMachine",
         "Resources": names, "EventStatus": "Scheduled", "NotBefore": "Sun, 22 Nov 2026 12:15:00 GMT",
         "Description": "Host server is undergoing maintenance.", "EventSource": "Platform",
         "DurationInSeconds": -1} for i in range(events)]}).encode()


def one_poll(raw: bytes, tracked: dict) -> dict:
    """What the loop does with an answer: JSON, parse, diff against what is tracked."""
    doc = parse_document(json.loads(raw))
    new, _ = diff(tracked, doc, vm_name="vm-0", boot_id="b", now=NOW)
    return new


def measure(events: int, resources: int, repeats: int, cold: bool = False) -> dict[str, float]:
    """Steady state (the same document again, as at 1 Hz), or `cold`: every event parsed afresh."""
    raw = document(events, resources)
    tracked = one_poll(raw, {})
    times = []
    for _ in range(repeats):
        if cold:
            events_mod._parse_cached.cache_clear()
            events_mod._parse_time_text.cache_clear()
        t0 = time.perf_counter_ns()
        one_poll(raw, tracked)
        times.append((time.perf_counter_ns() - t0) / 1e6)
    tracemalloc.start()
    one_poll(raw, tracked)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return {"events": events, "resources": resources, "cold": cold, "bytes": len(raw), "p50_ms": round(percentile(times, 50), 3),
            "p99_ms": round(percentile(times, 99), 3), "peak_alloc_kb": round(peak / 1024, 1)}


def run(quick: bool = False) -> dict:
    gc.freeze()  # as `maintd run` does after start: long-lived objects stay out of the collections
    rows = []
    for events, resources in [(0, 1), (10, 1), (100, 1), (1000, 1), (10, 100), (10, 1000), (100, 100),
                              (1000, 10)]:
        repeats = max(5, (50 if quick else 400) // max(1, events * resources // 1000))
        row = measure(events, resources, repeats)
        rows.append(row)
        print(f"  {events:5} events x {resources:4} names: p50 {row['p50_ms']} ms, p99 {row['p99_ms']} ms, "
              f"peak alloc {row['peak_alloc_kb']} KB", flush=True)
    cold = measure(1000, 1, 20 if quick else 100, cold=True)
    rows.append(cold)
    print(f"   1000 events, none seen before: p50 {cold['p50_ms']} ms, p99 {cold['p99_ms']} ms", flush=True)
    by = {(r["events"], r["resources"]): r for r in rows if not r["cold"]}
    thousand = by[(1000, 1)]
    per_event = [by[(n, 1)]["p50_ms"] / n for n in (100, 1000)]
    linear = per_event[1] <= 2 * per_event[0]
    return write("parse_cost", {"rows": rows}, [
        ("1000 events parsed and diffed per poll (p99)", f"{thousand['p99_ms']} ms", "< 20 ms",
         thousand["p99_ms"] < 20),
        ("cost per event, 100 vs 1000 events (p50)", f"{per_event[0] * 1000:.1f} / {per_event[1] * 1000:.1f} µs",
         "linear (≤ 2×)", linear),
        ("1000 events none seen before (p50, once per change)", f"{cold['p50_ms']} ms", "reported", True),
        ("empty document per poll (p50)", f"{by[(0, 1)]['p50_ms']} ms", "small", by[(0, 1)]["p50_ms"] < 1),
    ])
