"""Real agents in a fleet benchmark, whichever backend they coordinate through: starting them a few at a
time on distinct loopback ports, the hooks that mark when each VM was ready, and reading what they did
(the POSTs the emulator recorded, `approval.sent`, threads and RSS). `bench.fleet` (the peers) and
`bench.fleet_store` (Azure Blob Storage) both stand on it and never on each other.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from bench.common import peak_rss_mb
from tests.e2e.harness import Agent, Emulator

HOOK = 'sleep "$SLEEP"; date +%s.%N > "$DIR/$MAINTD_EVENT_ID.$MAINTD_VM_NAME"'
GO_HOOK = ('while [ ! -e "$DIR/$MAINTD_EVENT_ID.$MAINTD_VM_NAME.go" ]; do sleep 0.02; done; '
           'date +%s.%N > "$DIR/$MAINTD_EVENT_ID.$MAINTD_VM_NAME"')
"""A hook that ends once the bench touches `<event>.<vm>.go`: holds a VM not ready for as long as needed."""


def proc_status(pid: int) -> tuple[int, float]:
    """Threads and resident memory (MB) of a process."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return int(fields["Threads"]), int(fields["VmRSS"].split()[0]) / 1024


class Sampler:
    """Largest thread count and RSS of a process, sampled every 0.25 s on a thread."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.threads, self.rss_mb = 0, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.25):
            try:
                threads, rss_mb = proc_status(self.pid)
            except (OSError, KeyError):
                return
            self.threads, self.rss_mb = max(self.threads, threads), max(self.rss_mb, rss_mb)

    def stop(self) -> dict[str, float]:
        """Stop sampling; the largest values seen, and the kernel's peak RSS while the process lives."""
        self._stop.set()
        self._thread.join(2)
        try:
            peak = round(peak_rss_mb(self.pid), 1)
        except OSError:
            peak = float("nan")
        return {"threads_max": self.threads, "rss_mb_max": round(self.rss_mb, 1), "peak_rss_mb": peak}


def rounded(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per-event rows for the JSON, floats to 3 decimals."""
    return [{k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()} for row in rows]


def approval_sent(agents: dict[str, Agent], event_id: str) -> str | None:
    """The VM whose agent logged `approval.sent` for the event, if any did."""
    return next((vm for vm, a in agents.items() if a.events("approval.sent")
                 and any(e.get("event_id") == event_id for e in a.events("approval.sent"))), None)


def post_time(emu: Emulator, vm: str, event_id: str) -> float:
    """Wall time the emulator received the first StartRequests naming the event from `vm`."""
    return min(a["time"] for a in emu.approvals(vm) if event_id in a["event_ids"])


def count_posts(emu: Emulator, vms: list[str], event_ids: list[str]) -> dict[str, int]:
    """StartRequests POSTs per event, from every emulated VM's record."""
    counts = dict.fromkeys(event_ids, 0)
    for vm in vms:
        for a in emu.approvals(vm):
            for eid in a["event_ids"]:
                if eid in counts:
                    counts[eid] += 1
    return counts


def hook_ends(directory: Path, event_id: str, vms: list[str]) -> float:
    """Latest end time the given VMs' hooks wrote for the event."""
    return max(float((directory / f"{event_id}.{vm}").read_text()) for vm in vms)


def not_done(directory: Path, event_id: str, vms: list[str]) -> list[str]:
    """VMs whose hook for the event has not written its end time: approved before they were ready, if any."""
    return [vm for vm in vms if not (directory / f"{event_id}.{vm}").is_file()]


def keep_logs(agents: dict[str, Agent], vms: list[str], event_id: str) -> Path:
    """Save the given agents' logs for a failed check (the run's directory is removed at its end)."""
    out = Path(tempfile.mkdtemp(prefix=f"fleet-{event_id[:8]}-"))
    for vm in vms:
        (out / f"{vm}.log").write_text("".join(agents[vm].raw))
    return out


def addressing(kind: str, peers: dict[str, str], workdir: Path) -> dict[str, Any]:
    """The `coordination` keys that give an agent its peers' base URLs."""
    if kind == "peers":
        return {"peers": peers}
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "peers.yaml"
    path.write_text(yaml.safe_dump(peers, sort_keys=False))
    return {"peers_file": str(path)}


def distinct_ports(names: list[str]) -> dict[str, int]:
    """A different free loopback port per name (binding port 0 and closing, one at a time, can repeat one)."""
    socks = [socket.socket() for _ in names]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return {name: s.getsockname()[1] for name, s in zip(names, socks, strict=True)}
    finally:
        for s in socks:
            s.close()


def start_agents(specs: dict[str, Callable[[], Agent]]) -> dict[str, Agent]:
    """Start agents a few at a time (each waits for its own /healthz); stop them all if one fails or exits.

    An agent whose port another process holds exits on bind, but its /healthz may still be answered
    by that process: hence the last look that every agent is still running.
    """
    with concurrent.futures.ThreadPoolExecutor(max_workers=6) as pool:
        futures = {vm: pool.submit(make) for vm, make in specs.items()}
        concurrent.futures.wait(futures.values())
    agents = {vm: f.result() for vm, f in futures.items() if f.exception() is None}
    errors = [e for e in (f.exception() for f in futures.values()) if e is not None]
    time.sleep(0.5)
    errors += [AssertionError(f"{vm} exited at start: " + "".join(a.raw[-5:]))
               for vm, a in agents.items() if a.proc.poll() is not None]
    if errors:
        stop_all(agents)
        raise errors[0]
    return agents


def stop_all(agents: dict[str, Agent]) -> None:
    with concurrent.futures.ThreadPoolExecutor(max_workers=16) as pool:
        list(pool.map(lambda a: a.stop(), agents.values()))


def size_arguments(p: argparse.ArgumentParser) -> None:
    """The fleet benchmarks' shared options: fleet sizes, events, --quick."""
    p.add_argument("--n", type=int, nargs="*", metavar="N",
                   help="real-agent fleet sizes (default 10 30 50; none: skip)")
    p.add_argument("--simulated", type=int, metavar="N", help="simulated fleet size (default 1000; 0: skip)")
    p.add_argument("--events", type=int, metavar="K",
                   help="events per real fleet (default 6) and simulated (default 3)")
    p.add_argument("--quick", action="store_true", help="N=5 and 50 simulated, into bench/results/quick/")
