"""Shared by the benchmarks: percentiles, process accounting, machine facts, result files."""

from __future__ import annotations

import json
import os
import platform
import statistics
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
"""Where the figures go; a `--quick` run writes to RESULTS / "quick" so it never overwrites them."""
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def percentile(values: list[float], p: float) -> float:
    """The p-th percentile (nearest rank on sorted values)."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = max(0, min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1))))
    return ordered[k]


def summary(values: list[float], unit_scale: float = 1000.0) -> dict[str, float]:
    """p50/p90/p99/max/mean of `values` (seconds), in ms by default."""
    return {"n": len(values), "p50": round(percentile(values, 50) * unit_scale, 2),
            "p90": round(percentile(values, 90) * unit_scale, 2),
            "p99": round(percentile(values, 99) * unit_scale, 2),
            "max": round(max(values) * unit_scale, 2) if values else float("nan"),
            "mean": round(statistics.fmean(values) * unit_scale, 2) if values else float("nan")}


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def peak_rss_mb(pid: int) -> float:
    """VmHWM (peak resident set) in MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def wakeups_by_thread(pid: int) -> dict[int, int]:
    """Voluntary context switches of each thread of `pid` so far: each is one sleep that ended."""
    found: dict[int, int] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            for line in (task / "status").read_text().splitlines():
                if line.startswith("voluntary_ctxt_switches:"):
                    found[int(task.name)] = int(line.split()[1])
        except FileNotFoundError:  # the thread ended while we read
            pass
    return found


def machine() -> dict[str, Any]:
    """What the figures were measured on, with the load at the end (the machine is shared)."""
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    return {"cpu": model, "cores": os.cpu_count(), "python": platform.python_version(),
            "kernel": platform.release(), "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "load_average_1_5_15": [round(x, 2) for x in os.getloadavg()]}


def out_dir(quick: bool) -> Path:
    """bench/results, or bench/results/quick for smoke runs (their figures are not to be quoted)."""
    return RESULTS / "quick" if quick else RESULTS


def write(name: str, figures: dict[str, Any], checks: list[tuple[str, str, str, bool]],
          quick: bool = False) -> dict[str, Any]:
    """Save <out_dir>/<name>.json; `checks` are (figure, measured, target, met)."""
    out = out_dir(quick)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"benchmark": name, "quick": quick, "machine": machine(), "figures": figures,
           "checks": [{"figure": f, "measured": m, "target": t, "met": ok} for f, m, t, ok in checks]}
    (out / f"{name}.json").write_text(json.dumps(doc, indent=2) + "\n")
    for f, m, t, ok in checks:
        print(f"  {'PASS' if ok else 'MISS'}  {f}: {m} (target {t})", flush=True)
    return doc


def write_summary(quick: bool = False) -> Path:
    """<out_dir>/summary.md from every result file there."""
    rows = ["| benchmark | figure | measured | target | met |", "| --- | --- | --- | --- | --- |"]
    machine_line = ""
    for path in sorted(out_dir(quick).glob("*.json")):
        doc = json.loads(path.read_text())
        m = doc["machine"]
        machine_line = f"{m['cpu']}, {m['cores']} cores, Python {m['python']}, {m['date']}"
        for c in doc["checks"]:
            rows.append(f"| {doc['benchmark']} | {c['figure']} | {c['measured']} | {c['target']} | "
                        f"{'yes' if c['met'] else '**no**'} |")
    out = out_dir(quick) / "summary.md"
    out.write_text(f"Machine: {machine_line}\n\n" + "\n".join(rows) + "\n")
    return out
