"""Coordinated approval through Azure Blob Storage (Azurite): last ready -> POST, store traffic, POSTs per event.

Part 1, real agents: N `maintd run` processes (poll 1 s), `coordination.backend: azure_blob` over one
Azurite (in memory, loopback), no peers at all, one event naming all, an exec hook on each that
sleeps 2-5 s. Per event: the latest hook end -> the StartRequests POST the emulator recorded, store
requests per VM (each agent's `maintd_store_requests_total` before the event and after the POST),
POSTs per event, the fleet's store requests per second over the window.

Part 2, simulated fleet: two real agents (A ready at once, B the last VM ready) and a stand-in in
this process that writes the other N-2 VMs' markers as their agents would (preparing at once, ready
at a random time over `spread` s; their lists are not replayed). B's hook ends once every
simulated VM is ready, so B's own list finds all N markers and B claims: last ready -> POST at N
VMs. A waits through the whole spread, so its store requests are the background rate of a
waiting VM; A's poll gaps come from the emulator's record, its RSS from /proc (the SDK loaded).

`python -m bench fleet --backend azure_blob` runs N = 10, 30, 50 and 1000 simulated;
`python -m bench.fleet_store --help` picks sizes.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.common import cpu_seconds, summary, write, write_summary
from bench.fleet_agents import (
    GO_HOOK,
    HOOK,
    Sampler,
    approval_sent,
    count_posts,
    distinct_ports,
    hook_ends,
    not_done,
    post_time,
    rounded,
    size_arguments,
    start_agents,
    stop_all,
)
from tests.azurite import Azurite, start
from tests.e2e.harness import Agent, Emulator, wait_until

STORE_METRIC = "maintd_store_requests_total{"


def store_ops(agent: Agent) -> float:
    """Every store request this agent made (all operations and outcomes), from its /metrics."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in agent.get("/metrics").text.splitlines()
               if line.startswith(STORE_METRIC))


def store_section(server: Azurite, container: str, workdir: Path) -> dict[str, Any]:
    workdir.mkdir(parents=True, exist_ok=True)
    conn = workdir / "storage.conn"
    conn.write_text(server.connection_string())
    conn.chmod(0o600)
    return {"backend": "azure_blob", "azure_blob": {"container": container, "connection_string_file": str(conn)}}


def agent_config(server: Azurite, container: str, workdir: Path, command: str, env: dict[str, str]) -> dict[str, Any]:
    return {"imds": {"poll_interval": "1s"}, "log": {"level": "info"},
            "coordination": store_section(server, container, workdir),
            "handlers": [{"name": "prepare", "type": "exec", "phases": ["scheduled"], "timeout": "600s",
                          "command": ["/bin/sh", "-c", command], "env": env}]}


def flexible_names(n: int, rng: random.Random) -> list[str]:
    return [f"web_{rng.getrandbits(32):08x}" for _ in range(n)]


# --- part 1: real agents ---------------------------------------------------------------------------

def real_fleet(n: int, events: int, rng: random.Random, server: Azurite) -> dict[str, Any]:
    names = flexible_names(n, rng)
    sleeps = [2.0 + 3.0 * i / max(1, n - 1) for i in range(n)]
    rng.shuffle(sleeps)
    container = server.new_container()
    emu = Emulator(names, "--started-duration", "0.3")
    per_event: list[dict[str, Any]] = []
    event_ids: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        hooks = Path(tmp) / "hooks"
        hooks.mkdir()
        ports = distinct_ports(names)
        specs = {vm: (lambda vm=vm, i=i: Agent(Path(tmp) / vm, emu.urls[vm], vm, agent_config(
            server, container, Path(tmp) / vm, HOOK, {"DIR": str(hooks), "SLEEP": f"{sleeps[i]:.2f}"}),
            port=ports[vm])) for i, vm in enumerate(names)}
        agents = start_agents(specs)
        try:
            for _ in range(events):
                before = {vm: store_ops(a) for vm, a in agents.items()}
                m0 = time.monotonic()
                eid = emu.add_event(event_type="Reboot", resources=names, notice=600)
                event_ids.append(eid)
                sender = wait_until(lambda: approval_sent(agents, eid), 120, f"the POST for {eid}")
                time.sleep(1.0)  # the claimer's `approved` rewrite and the others' last lists land
                ops = {vm: store_ops(a) - before[vm] for vm, a in agents.items()}
                window = time.monotonic() - m0
                early = not_done(hooks, eid, names)
                wait_until(lambda: not not_done(hooks, eid, names), 60, "every hook to end")
                ready = hook_ends(hooks, eid, names)
                per_event.append({"event_id": eid, "sender": sender, "not_ready_at_post": early,
                                  "ready_to_post_s": post_time(emu, sender, eid) - ready,
                                  "ops_per_vm_max": max(ops.values()),
                                  "ops_per_vm_median": statistics.median(ops.values()),
                                  "ops_claimer": ops[sender], "window_s": window,
                                  "store_requests_per_s": sum(ops.values()) / window})
                e = per_event[-1]
                print(f"   store N={n} event {len(per_event)}/{events}: ready -> POST "
                      f"{e['ready_to_post_s'] * 1000:.0f} ms, store ops per VM median {e['ops_per_vm_median']:.0f} "
                      f"max {e['ops_per_vm_max']:.0f}, {e['store_requests_per_s']:.1f} req/s", flush=True)
                time.sleep(2.5)
            posts = count_posts(emu, names, event_ids)
        finally:
            stop_all(agents)
            emu.stop()
    return {"n": n, "events": events, "hook_seconds": [round(min(sleeps), 2), round(max(sleeps), 2)],
            "ready_to_post_ms": summary([e["ready_to_post_s"] for e in per_event]),
            "store_ops_per_vm": {"median": statistics.median(e["ops_per_vm_median"] for e in per_event),
                                 "max": max(e["ops_per_vm_max"] for e in per_event),
                                 "claimer_max": max(e["ops_claimer"] for e in per_event)},
            "store_requests_per_s": round(statistics.median(e["store_requests_per_s"] for e in per_event), 1),
            "posts_per_event": list(posts.values()), "per_event": rounded(per_event)}


# --- part 2: simulated fleet -----------------------------------------------------------------------

class StandinMarkers:
    """The simulated VMs' marker writes, as their agents would make them, from 16 threads of this process."""

    def __init__(self, server: Azurite, container: str) -> None:
        from agent.coordination.store.blob_store import BlobStore, Settings

        self.ops = 0
        self.lock = threading.Lock()
        self.store = BlobStore.open(Settings(server.url, container, connection_string=server.connection_string()),
                                    self._count)
        self.pool = concurrent.futures.ThreadPoolExecutor(16)

    def _count(self, op: str, outcome: str) -> None:
        with self.lock:
            self.ops += 1

    def mark(self, event_id: str, vm: str, state: str) -> None:
        """The marker write (a real VM lists after it too: not replayed here, it would measure this process's
        XML parsing of 1000-blob listings rather than the agents; the fleet's lists are estimated from A's)."""
        from agent.coordination.store.store_protocol import marker_blob, marker_record

        self.store.put(marker_blob(event_id, vm), marker_record(event_id, vm, state))

    def run(self, event_id: str, ready_in: dict[str, float]) -> float:
        """Preparing at once, ready at each VM's time; the wall time the last one was written."""
        t0 = time.monotonic()
        list(self.pool.map(lambda vm: self.mark(event_id, vm, "preparing"), ready_in))
        last = [0.0]

        def ready(vm: str) -> None:
            time.sleep(max(0.0, t0 + ready_in[vm] - time.monotonic()))
            self.mark(event_id, vm, "ready")
            with self.lock:
                last[0] = max(last[0], time.time())

        list(self.pool.map(ready, sorted(ready_in, key=ready_in.get)))
        return last[0]

    def stop(self) -> None:
        self.pool.shutdown()
        self.store.close()


def simulated_fleet(n: int, spread: float, events: int, rng: random.Random, server: Azurite) -> dict[str, Any]:
    names = flexible_names(n, rng)
    a, b, simulated = names[0], names[1], names[2:]
    container = server.new_container()
    emu = Emulator([a, b], "--started-duration", "0.3")
    standin = StandinMarkers(server, container)
    per_event: list[dict[str, Any]] = []
    event_ids: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        hooks = Path(tmp) / "hooks"
        hooks.mkdir()
        ports = distinct_ports([a, b])
        agents = start_agents({vm: (lambda vm=vm: Agent(Path(tmp) / vm, emu.urls[vm], vm, agent_config(
            server, container, Path(tmp) / vm, GO_HOOK, {"DIR": str(hooks)}), port=ports[vm])) for vm in (a, b)})
        sampler = Sampler(agents[a].proc.pid)
        try:
            for _ in range(events):
                before = {vm: store_ops(agent) for vm, agent in agents.items()}
                cpu0, t0, m0 = cpu_seconds(agents[a].proc.pid), time.time(), time.monotonic()
                eid = emu.add_event(event_type="Reboot", resources=names, notice=900)
                event_ids.append(eid)
                (hooks / f"{eid}.{a}.go").touch()
                ready_in = {vm: rng.uniform(0, spread) for vm in simulated}
                ready_in[rng.choice(simulated)] = spread
                standin.run(eid, ready_in)
                (hooks / f"{eid}.{b}.go").touch()
                sender = wait_until(lambda: approval_sent(agents, eid), 120, f"the POST for {eid}")
                m1 = time.monotonic()
                ops = {vm: store_ops(agent) - before[vm] for vm, agent in agents.items()}
                t_post = post_time(emu, sender, eid)
                polls = [r["time"] for r in emu.requests(a)
                         if "scheduledevents" in r["path"] and t0 <= r["time"] <= t_post]
                gaps = [y - x for x, y in zip(polls, polls[1:], strict=False)]
                per_event.append({"event_id": eid, "sender": sender,
                                  "ready_to_post_s": t_post - hook_ends(hooks, eid, [b]),
                                  "ops_waiting_vm": ops[a], "ops_last_vm": ops[b],
                                  "waiting_vm_requests_per_s": ops[a] / (m1 - m0), "window_s": m1 - m0,
                                  "poll_gap_max_s": max(gaps, default=float("nan")),
                                  "cpu_waiting_vm_pct": (cpu_seconds(agents[a].proc.pid) - cpu0) / (m1 - m0) * 100})
                e = per_event[-1]
                print(f"   store simulated N={n}: ready -> POST {e['ready_to_post_s'] * 1000:.0f} ms, waiting VM "
                      f"{e['ops_waiting_vm']:.0f} ops over {e['window_s']:.0f} s, last VM {e['ops_last_vm']:.0f} ops, "
                      f"largest poll gap {e['poll_gap_max_s']:.3f} s", flush=True)
                time.sleep(2.5)
            memory = sampler.stop()
            posts = count_posts(emu, [a, b], event_ids)
        finally:
            sampler.stop()
            stop_all(agents)
            standin.stop()
            emu.stop()
    waiting_rate = statistics.median(e["waiting_vm_requests_per_s"] for e in per_event)
    return {"n": n, "real_agents": 2, "simulated": n - 2, "spread_s": spread, "events": events,
            "ready_to_post_ms": summary([e["ready_to_post_s"] for e in per_event]),
            "store_ops": {"waiting_vm_max": max(e["ops_waiting_vm"] for e in per_event),
                          "last_vm_max": max(e["ops_last_vm"] for e in per_event),
                          "waiting_vm_per_s": round(waiting_rate, 3),
                          "fleet_background_estimate_per_s": round(waiting_rate * n, 1)},
            "poll_gap_max_s": round(max(e["poll_gap_max_s"] for e in per_event), 3),
            "waiting_vm": {**memory, "cpu_pct_median": round(statistics.median(e["cpu_waiting_vm_pct"]
                                                                                 for e in per_event), 2)},
            "posts_per_event": list(posts.values()), "per_event": rounded(per_event)}


# --- figures and checks ----------------------------------------------------------------------------

def checks_real(r: dict[str, Any]) -> list[tuple[str, str, str, bool]]:
    n, s, ops, posts = r["n"], r["ready_to_post_ms"], r["store_ops_per_vm"], r["posts_per_event"]
    return [
        (f"store N={n} real: last hook end -> POST received p50 / p99", f"{s['p50']:.0f} / {s['p99']:.0f} ms "
         f"(n={s['n']})", "p99 < 1 s", s["p99"] < 1000),
        (f"store N={n} real: store requests per VM per event, median / max / claimer",
         f"{ops['median']:.0f} / {ops['max']:.0f} / {ops['claimer_max']:.0f}", "≤ ~10 + background",
         ops["median"] <= 10),
        (f"store N={n} real: fleet store requests/s over the event", f"{r['store_requests_per_s']}", "reported", True),
        (f"store N={n} real: POSTs per event", " ".join(map(str, posts)), "exactly 1", all(p == 1 for p in posts)),
        (f"store N={n} real: VMs whose hook had not ended at the POST",
         str(sum(len(e["not_ready_at_post"]) for e in r["per_event"])), "0",
         not any(e["not_ready_at_post"] for e in r["per_event"])),
    ]


def checks_simulated(r: dict[str, Any]) -> list[tuple[str, str, str, bool]]:
    n, s, ops, vm = r["n"], r["ready_to_post_ms"], r["store_ops"], r["waiting_vm"]
    return [
        (f"store N={n} simulated: last VM ready -> POST received p50 / p99",
         f"{s['p50']:.0f} / {s['p99']:.0f} ms (n={s['n']})", "p99 < 1 s", s["p99"] < 1000),
        (f"store N={n} simulated: store requests of the last VM ready / of a VM waiting {r['spread_s']:g} s",
         f"{ops['last_vm_max']:.0f} / {ops['waiting_vm_max']:.0f} ({ops['waiting_vm_per_s']}/s; fleet "
         f"~{ops['fleet_background_estimate_per_s']}/s)", "last ≤ ~10; waiting: background, reported",
         ops["last_vm_max"] <= 10),
        (f"store N={n} simulated: waiting VM's largest gap between two polls", f"{r['poll_gap_max_s']:.3f} s",
         "≤ 1.05 s", r["poll_gap_max_s"] <= 1.05),
        (f"store N={n} simulated: waiting VM threads (max) / RSS (peak) / CPU (median)",
         f"{vm['threads_max']} / {vm['peak_rss_mb']} MB / {vm['cpu_pct_median']} %", "RSS ≤ 64 MB",
         vm["peak_rss_mb"] <= 64),
        (f"store N={n} simulated: POSTs per event", " ".join(map(str, r["posts_per_event"])), "exactly 1",
         all(p == 1 for p in r["posts_per_event"])),
    ]


def run(quick: bool = False, sizes: list[int] | None = None, simulated: int | None = None,
        events: int | None = None) -> dict[str, Any]:
    rng = random.Random(23)
    sizes = sizes if sizes is not None else ([5] if quick else [10, 30, 50])
    simulated = simulated if simulated is not None else (50 if quick else 1000)
    figures: dict[str, Any] = {"backend": "azure_blob", "poll_interval_s": 1.0, "real": [], "simulated": None}
    checks: list[tuple[str, str, str, bool]] = []
    with tempfile.TemporaryDirectory() as tmp:
        server = start(Path(tmp))
        try:
            for n in sizes:
                result = real_fleet(n, events or (2 if quick else 6), rng, server)
                figures["real"].append(result)
                checks += checks_real(result)
            if simulated:
                result = simulated_fleet(simulated, 10.0 if quick else 60.0, events or (1 if quick else 3), rng, server)
                figures["simulated"] = result
                checks += checks_simulated(result)
        finally:
            server.stop()
    return write("fleet_store", figures, checks, quick)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.fleet_store", description=__doc__.split("\n")[0])
    size_arguments(p)
    args = p.parse_args(argv)
    run(args.quick, args.n, args.simulated, args.events)
    print(f"summary: {write_summary(args.quick)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
