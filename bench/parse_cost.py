"""Cost per poll as the document grows: JSON + parse + diff of 0..1000 events, Resources of 1..1000 names.

In-process and pure, as the loop does it (`ImdsClient.get_document`, then `Daemon.process_document`).
Three kinds of poll per size: `steady` (the same bytes as the poll before, what 1 Hz polling sees
almost always: the client compares the body with the last one and nothing is parsed or diffed),
`changed` (one event changed status since the poll before: JSON, parse and diff of the whole
document, the events that did not change reused from the last document) and `new` (no event seen
before: nothing to reuse, once per new event); `json` is the standard library's share alone
(json.loads), a yardstick for how fast the machine was. The sizes
are timed in short blocks taken in turn, so the machine's noise falls on all of them alike.
"""

from __future__ import annotations

import gc
import json
import time
import tracemalloc
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from agent.imds.imds_client import MAX_DOCUMENT_BYTES
from agent.model.events import Document, parse_document
from agent.model.tracker import Tracked, diff
from agent.trust import jsonsafe
from bench.common import percentile, write

NOW = datetime(2026, 11, 22, 12, 0, tzinfo=UTC)
SIZES = [(0, 1), (10, 1), (100, 1), (1000, 1), (10, 100), (10, 1000), (100, 100), (1000, 10)]
"""(events, names in each event's Resources)."""


def document(events: int, resources: int, first_status: str = "Scheduled") -> bytes:
    """An IMDS document as bytes on the wire; `first_status` lets two documents differ in one event."""
    names = [f"vm-{i}" for i in range(resources)]
    return json.dumps({"DocumentIncarnation": 1 if first_status == "Scheduled" else 2, "Events": [
        {"EventId": f"{i:08X}-0000-4000-8000-000000000000", "EventType": "Reboot", "ResourceType": "VirtualMachine",
         "Resources": names, "EventStatus": first_status if i == 0 else "Scheduled",
         "NotBefore": "Sun, 22 Nov 2026 12:15:00 GMT", "Description": "Host server is undergoing maintenance.",
         "EventSource": "Platform", "DurationInSeconds": -1} for i in range(events)]}).encode()


Last = tuple[bytes, Document] | None
"""What the client keeps between polls: the last body and the document parsed from it."""


def one_poll(raw: bytes, last: Last, tracked: dict[str, Tracked]) -> tuple[dict[str, Tracked], Last]:
    """What the client and the loop do with an answer: the same bytes as the last answer change nothing;
    otherwise decode JSON (size and depth checked first, as the client does), parse (reusing the last
    document's unchanged events), diff against what is tracked."""
    if last is not None and raw == last[0]:
        return tracked, last
    document = parse_document(jsonsafe.loads(raw, max_bytes=MAX_DOCUMENT_BYTES), last[1] if last else None)
    new, _ = diff(tracked, document, vm_name="vm-0", boot_id="b", now=NOW)
    return new, (raw, document)


def timed(call: Callable[[], Any]) -> tuple[float, float]:
    """Wall and CPU milliseconds of one call; CPU time is this thread's own work, without the time other
    processes on this shared machine held the core."""
    c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
    call()
    return (time.perf_counter_ns() - t0) / 1e6, (time.thread_time_ns() - c0) / 1e6


def allocated_kb(call: Callable[[], Any]) -> float:
    """Peak bytes allocated during one call (tracemalloc), in KB."""
    tracemalloc.start()
    call()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return round(peak / 1024, 1)


class Case:
    """One document size and its samples: (wall ms, CPU ms) per kind of poll."""

    def __init__(self, events: int, resources: int) -> None:
        self.events, self.resources = events, resources
        self.docs = [document(events, resources), document(events, resources, "Started")]
        self.again = bytes(bytearray(self.docs[0]))
        """The first document's bytes as a new object, as the next answer's body is."""
        self.samples: dict[str, list[tuple[float, float]]] = {"steady": [], "changed": [], "new": [], "json": []}

    def block(self, polls: int) -> None:
        """`polls` steady and changed polls, then a new one, with only this document's state alive (as in
        the daemon, which holds one document, not every size of this benchmark)."""
        gc.collect()
        tracked, last = one_poll(self.docs[0], None, {})
        for _ in range(polls):
            self.samples["steady"].append(timed(lambda: one_poll(self.again, last, tracked)))
            self.samples["changed"].append(timed(lambda: one_poll(self.docs[1], last, tracked)))
            self.samples["json"].append(timed(lambda: json.loads(self.docs[0])))
        self.samples["new"].append(timed(lambda: one_poll(self.docs[0], None, {})))

    def row(self) -> dict[str, Any]:
        """Percentiles of every kind, and the allocations of one poll of each."""
        tracked, last = one_poll(self.docs[0], None, {})
        alloc = {"new": allocated_kb(lambda: one_poll(self.docs[0], None, {})),
                 "steady": allocated_kb(lambda: one_poll(self.again, last, tracked)),
                 "changed": allocated_kb(lambda: one_poll(self.docs[1], last, tracked)),
                 "json": allocated_kb(lambda: json.loads(self.docs[0]))}
        out: dict[str, Any] = {"events": self.events, "resources": self.resources, "bytes": len(self.docs[0])}
        for kind, pairs in self.samples.items():
            wall, cpu = [w for w, _ in pairs], [c for _, c in pairs]
            out[kind] = {"n": len(pairs), "p50_ms": round(percentile(wall, 50), 3),
                         "p99_ms": round(percentile(wall, 99), 3), "cpu_p50_ms": round(percentile(cpu, 50), 3),
                         "cpu_p99_ms": round(percentile(cpu, 99), 3), "peak_alloc_kb": alloc[kind]}
        return out


def run(quick: bool = False) -> dict[str, Any]:
    gc.freeze()  # as `maintd run` does after start: long-lived objects stay out of the collections
    cases = [Case(e, r) for e, r in SIZES]
    blocks, polls = (4, 10) if quick else (30, 10)
    for _ in range(blocks):  # sizes in turn, so the machine's noise falls on all of them alike
        for case in cases:
            case.block(polls)
    rows = [case.row() for case in cases]
    for r in rows:
        ch, st = r["changed"], r["steady"]
        print(f"  {r['events']:5} events x {r['resources']:4} names: "
              f"changed p50 {ch['p50_ms']} / p99 {ch['p99_ms']} ms (CPU {ch['cpu_p50_ms']} / {ch['cpu_p99_ms']}), "
              f"steady p50 {st['p50_ms']} ms, new p50 {r['new']['p50_ms']} ms, "
              f"json.loads alone p50 {r['json']['p50_ms']} ms, alloc {ch['peak_alloc_kb']} KB",
              flush=True)
    by = {(r["events"], r["resources"]): r for r in rows}
    k = by[(1000, 1)]
    per_event = {n: by[(n, 1)]["changed"]["cpu_p50_ms"] / n * 1000 for n in (10, 100, 1000)}
    per_name = {n: by[(10, n)]["changed"]["cpu_p50_ms"] / (10 * n) * 1e6 for n in (100, 1000)}
    figures = {"blocks": blocks, "polls_per_block": polls, "rows": rows,
               "cpu_per_event_us": {str(n): round(v, 2) for n, v in per_event.items()},
               "cpu_per_name_ns": {str(n): round(v) for n, v in per_name.items()}}
    return write("parse_cost", figures, [
        ("1000 events parsed and diffed per poll (one event changed): CPU p50 / p99 (wall p99)",
         f"{k['changed']['cpu_p50_ms']} / {k['changed']['cpu_p99_ms']} ms ({k['changed']['p99_ms']} ms)", "< 20 ms",
         k["changed"]["cpu_p99_ms"] < 20),
        ("CPU per event at 10 / 100 / 1000 events, parsed and diffed (p50)",
         " / ".join(f"{per_event[n]:.1f}" for n in (10, 100, 1000)) + " µs", "linear (1000 ≤ 2× 100)",
         per_event[1000] <= 2 * per_event[100]),
        ("CPU per Resources name, 10 events of 100 / 1000 names (p50)",
         f"{per_name[100]:.0f} / {per_name[1000]:.0f} ns", "linear (1000 ≤ 2× 100)",
         per_name[1000] <= 2 * per_name[100]),
        ("1000 events, steady poll (same bytes as the last) p50 / p99",
         f"{k['steady']['cpu_p50_ms']} / {k['steady']['cpu_p99_ms']} ms", "reported", True),
        ("1000 events, json.loads alone p50 (how fast the machine was)", f"{k['json']['cpu_p50_ms']} ms",
         "reported", True),
        ("1000 events none seen before, p50 (once per new event)", f"{k['new']['cpu_p50_ms']} ms", "reported", True),
        ("allocated per poll, 1000 events, one changed (peak)", f"{k['changed']['peak_alloc_kb'] / 1024:.2f} MB",
         "reported", True),
        ("empty document per poll, changed (p50)", f"{by[(0, 1)]['changed']['p50_ms']} ms", "< 1 ms",
         by[(0, 1)]["changed"]["p50_ms"] < 1),
    ], quick)
