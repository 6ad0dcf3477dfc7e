"""Coordinated approval at fleet scale: peer traffic, last ready -> POST, CPU, takeover.

Part 1, real agents: N `maintd run` processes (default poll interval, 1 s) with the emulator, one
event naming all, an exec hook on each that sleeps 2-5 s (the leader's the shortest, so the last
VM to become ready is a follower) and writes the time it ended. Per event: every request the
agents' servers received other than /metrics, /healthz and the probe (the bench sends only those),
from `maintd_http_requests_total` before the event and after the POST, over that window; the
latest hook end -> the StartRequests POST the emulator recorded; CPU of the leader and followers.

Part 2, simulated fleet: a real leader (rank 0) and a real follower (rank 1) with the emulator;
every other VM is answered by `bench.fleet_standin`, each at its own base URL, turning ready at a
random time over `spread` seconds and pushing `peer-ready` to the acting leader when it does.
Requests to the stand-in are counted per asking agent; the fleet's figure is extrapolated as
leader + (N-1) x the rank-1 follower. The leader's poll gaps come from the emulator's record, its
threads and RSS from /proc. Last, a takeover: the follower is held not ready, the leader is
killed (SIGKILL) once every simulated peer is ready, and the follower is released.

`python -m bench fleet` runs N = 10, 30, 50 and 1000 simulated; `python -m bench.fleet --help`
picks sizes and the peer addressing (`coordination.peers` or `coordination.peers_file`).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import cpu_seconds, summary, write, write_summary
from bench.fleet_agents import (
    GO_HOOK,
    HOOK,
    Sampler,
    addressing,
    approval_sent,
    count_posts,
    distinct_ports,
    hook_ends,
    keep_logs,
    not_done,
    post_time,
    rounded,
    size_arguments,
    start_agents,
    stop_all,
)
from bench.fleet_tick import tick_cost
from tests.e2e.harness import CLEAN_ENV, Agent, Emulator, http, wait_until

NOT_PEER_ROUTES = frozenset({"metrics", "healthz", "probe"})
"""Server routes the bench itself uses; every other request an agent receives comes from a peer."""
TAKEOVER_AFTER = 10.0
TAKEOVER_GIVE_UP = 15.0
"""Seconds past takeover_after after which a takeover counts as not happening."""
_SAMPLE = re.compile(r'^(\w+)\{([^}]*)\} (\S+)$')
_LABEL = re.compile(r'(\w+)="([^"]*)"')


# --- reading the agents ----------------------------------------------------------------------

def peer_counts(agent: Agent) -> dict[str, float]:
    """Peer requests this agent received (`in`, every non-bench route) and sent (`out`, its own counter)."""
    counts = {"in": 0.0, "out": 0.0}
    for line in agent.get("/metrics").text.splitlines():
        match = _SAMPLE.match(line)
        if not match:
            continue
        name, labels = match.group(1), dict(_LABEL.findall(match.group(2)))
        if name == "maintd_http_requests_total" and labels.get("route") not in NOT_PEER_ROUTES:
            counts["in"] += float(match.group(3))
        elif name == "maintd_peer_requests_total":
            counts["out"] += float(match.group(3))
    return counts


# --- starting the agents ---------------------------------------------------------------------

def agent_config(kind: str, peers: dict[str, str], workdir: Path, command: str, env: dict[str, str],
                 **coordination: Any) -> dict[str, Any]:
    return {"imds": {"poll_interval": "1s"}, "log": {"level": "info"},
            "coordination": {**addressing(kind, peers, workdir), **coordination},
            "handlers": [{"name": "prepare", "type": "exec", "phases": ["scheduled"],
                          "command": ["/bin/sh", "-c", command], "env": env}]}


# --- part 1: real agents ---------------------------------------------------------------------

def real_fleet(n: int, events: int, kind: str, rng: random.Random) -> dict[str, Any]:
    names = [f"vm-{i:03d}" for i in range(n)]
    leader, follower = names[0], names[1]
    sleeps = [2.0] + rng.sample([2.5 + 2.5 * i / max(1, n - 2) for i in range(n - 1)], n - 1)
    emu = Emulator(names, "--started-duration", "0.3")
    per_event: list[dict[str, Any]] = []
    event_ids: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        hooks = Path(tmp) / "hooks"
        hooks.mkdir()
        ports = distinct_ports(names)
        bases = {vm: f"http://127.0.0.1:{p}" for vm, p in ports.items()}
        specs = {vm: (lambda vm=vm, i=i: Agent(Path(tmp) / vm, emu.urls[vm], vm, agent_config(
            kind, {p: u for p, u in bases.items() if p != vm}, Path(tmp) / vm, HOOK,
            {"DIR": str(hooks), "SLEEP": f"{sleeps[i]:.2f}"}), port=ports[vm]))
            for i, vm in enumerate(names)}
        agents = start_agents(specs)
        try:
            pids = {vm: a.proc.pid for vm, a in agents.items()}
            for _ in range(events):
                before = [peer_counts(a) for a in agents.values()]
                cpu0 = {vm: cpu_seconds(pid) for vm, pid in pids.items()}
                m0 = time.monotonic()
                eid = emu.add_event(event_type="Reboot", resources=names, notice=600)
                event_ids.append(eid)
                sender = wait_until(lambda: approval_sent(agents, eid), 120, f"the POST for {eid}")
                m1 = time.monotonic()
                cpu1 = {vm: cpu_seconds(pid) for vm, pid in pids.items()}
                after = [peer_counts(a) for a in agents.values()]
                m2 = time.monotonic()
                early = not_done(hooks, eid, names)
                if early:
                    print(f"   N={n}: {sender} approved {eid} before {', '.join(early)} were ready; logs in "
                          f"{keep_logs(agents, [sender, *early], eid)}", flush=True)
                    wait_until(lambda: not not_done(hooks, eid, names), 60, "every hook to end")
                ready = hook_ends(hooks, eid, names)
                received = sum(a["in"] - b["in"] for a, b in zip(after, before, strict=True))
                sent = sum(a["out"] - b["out"] for a, b in zip(after, before, strict=True))
                cpu = {vm: (cpu1[vm] - cpu0[vm]) / (m1 - m0) * 100 for vm in names}
                per_event.append({"event_id": eid, "sender": sender, "not_ready_at_post": early,
                                  "window_s": round(m2 - m0, 2),
                                  "peer_requests": int(received), "peer_gets_sent": int(sent),
                                  "requests_per_s": received / (m2 - m0),
                                  "ready_to_post_s": post_time(emu, sender, eid) - ready,
                                  "cpu_leader_pct": cpu[leader], "cpu_follower_pct": cpu[follower],
                                  "cpu_followers_median_pct": statistics.median(cpu[vm] for vm in names[1:])})
                print(f"   N={n} event {len(per_event)}/{events}: {received / (m2 - m0):.0f} peer requests/s, "
                      f"ready -> POST {per_event[-1]['ready_to_post_s'] * 1000:.0f} ms", flush=True)
                time.sleep(2.5)  # the event starts, ends and leaves every agent's document
            posts = count_posts(emu, names, event_ids)
        finally:
            stop_all(agents)
            emu.stop()
    rates = [e["requests_per_s"] for e in per_event]
    return {"n": n, "events": events, "hook_seconds": [min(sleeps), max(sleeps)],
            "peer_requests_per_s": {"fleet_median": round(statistics.median(rates), 1),
                                    "fleet_max": round(max(rates), 1),
                                    "per_vm_median": round(statistics.median(rates) / n, 2)},
            "ready_to_post_ms": summary([e["ready_to_post_s"] for e in per_event]),
            "posts_per_event": list(posts.values()),
            "cpu_pct_median": {k: round(statistics.median(e[k] for e in per_event), 1)
                               for k in ("cpu_leader_pct", "cpu_follower_pct", "cpu_followers_median_pct")},
            "per_event": rounded(per_event)}


# --- part 2: simulated fleet -----------------------------------------------------------------

class Standin:
    """`python -m bench.fleet_standin` as a child process with its admin calls."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "bench.fleet_standin"], stdout=subprocess.PIPE,
                                     text=True, env=CLEAN_ENV, cwd=Path(__file__).resolve().parent.parent)
        assert self.proc.stdout is not None
        self.port = json.loads(self.proc.stdout.readline())["port"]
        self.base = f"http://127.0.0.1:{self.port}"
        self.http = http()

    def peer_url(self, src: str, vm: str) -> str:
        return f"{self.base}/{src}/p/{vm}"

    def schedule(self, event_id: str, ready_in: dict[str, float], leaders: list[str], resources: list[str]) -> None:
        self.http.post(f"{self.base}/admin/event", json={"event_id": event_id, "ready_in": ready_in,
                                                         "leaders": leaders, "resources": resources},
                       timeout=10).raise_for_status()

    def stats(self, event_id: str) -> dict[str, Any]:
        return self.http.get(f"{self.base}/admin/stats", params={"event_id": event_id}, timeout=10).json()

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


class SimulatedFleet:
    """A real leader and rank-1 follower, the emulator for both, and the stand-in for every other VM."""

    def __init__(self, n: int, kind: str, tmp: Path, takeover_after: float) -> None:
        self.names = [f"vm-{i:04d}" for i in range(n)]
        self.leader, self.follower, self.simulated = self.names[0], self.names[1], self.names[2:]
        self.hooks = tmp / "hooks"
        self.hooks.mkdir()
        self.emu = Emulator([self.leader, self.follower], "--started-duration", "0.3")
        self.standin = Standin()
        ports = distinct_ports([self.leader, self.follower])
        self.bases = {vm: f"http://127.0.0.1:{p}" for vm, p in ports.items()}
        src = {self.leader: "L", self.follower: "F"}

        def spec(vm: str, other: str) -> Callable[[], Agent]:
            peers = {other: self.bases[other], **{s: self.standin.peer_url(src[vm], s) for s in self.simulated}}
            return lambda: Agent(tmp / vm, self.emu.urls[vm], vm, agent_config(
                kind, peers, tmp / vm, GO_HOOK, {"DIR": str(self.hooks)}, takeover_after=f"{takeover_after:g}s",
                unreachable_peers="ignore", peer_timeout=f"{takeover_after:g}s"),  # the takeover POSTs only so (S1)
                port=ports[vm])

        try:
            self.agents = start_agents({self.leader: spec(self.leader, self.follower),
                                        self.follower: spec(self.follower, self.leader)})
        except BaseException:
            self.standin.stop()
            self.emu.stop()
            raise
        self.event_ids: list[str] = []

    def release(self, event_id: str, vm: str) -> None:
        """Let the VM's hook for the event end (it is ready once its agent sees that)."""
        (self.hooks / f"{event_id}.{vm}.go").touch()

    def add_event(self, rng: random.Random, spread: float) -> str:
        """An event naming every VM; the simulated peers turn ready over `spread` s, the last at `spread`."""
        eid = self.emu.add_event(event_type="Reboot", resources=self.names, notice=900)
        self.event_ids.append(eid)
        ready_in = {vm: rng.uniform(0, spread) for vm in self.simulated}
        ready_in[rng.choice(self.simulated)] = spread
        self.standin.schedule(eid, ready_in, [self.bases[self.leader], self.bases[self.follower]], self.names)
        return eid

    def stop(self) -> None:
        for eid in self.event_ids:  # a killed agent's hook is orphaned: let it end
            for vm in (self.leader, self.follower):
                self.release(eid, vm)
        stop_all(self.agents)
        self.standin.stop()
        self.emu.stop()


def simulated_event(fleet: SimulatedFleet, rng: random.Random, spread: float) -> dict[str, Any]:
    """One event the leader approves once the last simulated peer turns ready; the figures of its window."""
    f, leader, follower = fleet, fleet.leader, fleet.follower
    before = {vm: peer_counts(a) for vm, a in f.agents.items()}
    asked0 = f.standin.stats("")["requests_by_src"]
    cpu0 = {vm: cpu_seconds(a.proc.pid) for vm, a in f.agents.items()}
    t0, m0 = time.time(), time.monotonic()
    eid = f.add_event(rng, spread)
    f.release(eid, leader)
    f.release(eid, follower)
    sender = wait_until(lambda: approval_sent(f.agents, eid), spread + 120, f"the POST for {eid}")
    m1 = time.monotonic()
    cpu1 = {vm: cpu_seconds(a.proc.pid) for vm, a in f.agents.items()}
    after = {vm: peer_counts(a) for vm, a in f.agents.items()}
    stats = f.standin.stats(eid)
    window = time.monotonic() - m0
    t_post = post_time(f.emu, sender, eid)
    ready = max(stats["last_ready_wall"], hook_ends(f.hooks, eid, [leader, follower]))
    received = {vm: after[vm]["in"] - before[vm]["in"] for vm in f.agents}
    asked = {src: n - asked0.get(src, 0) for src, n in stats["requests_by_src"].items()}
    # The leader's requests: to simulated peers, and to the real follower (all that the follower received).
    leader_out = asked.get("L", 0) + received[follower]
    # The follower's: to simulated peers, and to the leader (what it received, less the simulated pushes).
    follower_out = asked.get("F", 0) + received[leader] - stats["pushes"].get("ok", 0)
    polls = [r["time"] for r in f.emu.requests(leader) if "scheduledevents" in r["path"] and t0 <= r["time"] <= t_post]
    gaps = [b - a for a, b in zip(polls, polls[1:], strict=False)]
    n = len(f.names)
    return {"event_id": eid, "sender": sender, "window_s": window,
            "leader_requests_per_s": leader_out / window, "follower_requests_per_s": follower_out / window,
            "pushes_per_s": sum(stats["pushes"].values()) / window,
            "fleet_estimate_per_s": (leader_out + (n - 1) * follower_out) / window,
            "asks_after_ready": sum(stats["asks_after_ready"].values()),
            "asks_per_peer_max": stats["asks_per_peer_max"],
            "ready_to_post_s": t_post - ready, "leader_poll_gap_max_s": max(gaps, default=float("nan")),
            "leader_polls": len(polls),
            "cpu_leader_pct": (cpu1[leader] - cpu0[leader]) / (m1 - m0) * 100,
            "cpu_follower_pct": (cpu1[follower] - cpu0[follower]) / (m1 - m0) * 100}


def takeover(fleet: SimulatedFleet, rng: random.Random, leader_ready: bool, takeover_after: float) -> dict[str, Any]:
    """Kill the leader once every simulated peer is ready, then let the follower (rank 1) become ready.

    The fleet runs with `unreachable_peers: ignore` and `peer_timeout` = `takeover_after`: under the
    default `wait` a taker never POSTs for a silent leader (S1, decision 0100), and this measures the
    opt-out's takeover time.

    `leader_ready`: the leader's own hook has ended before the kill (it was waiting for the follower
    alone), or it is still preparing. The time is from the kill to the follower's POST at the emulator.
    """
    f, leader, follower = fleet, fleet.leader, fleet.follower
    if f.agents[leader].proc.poll() is not None:
        f.agents[leader].start()
    eid = f.add_event(rng, 5.0)
    if leader_ready:
        f.release(eid, leader)
    wait_until(lambda: f.standin.stats(eid)["ready"] == len(f.simulated), 60, "every simulated peer ready")
    if leader_ready:
        wait_until(lambda: (f.hooks / f"{eid}.{leader}").exists(), 30, "the leader's hook to end")
    time.sleep(2)  # the follower has asked everyone since
    killed_at = time.time()
    f.agents[leader].kill()
    f.release(eid, follower)
    try:
        wait_until(lambda: approval_sent({follower: f.agents[follower]}, eid), takeover_after + TAKEOVER_GIVE_UP,
                   "the follower's takeover POST")
        seconds: float | None = round(post_time(f.emu, follower, eid) - killed_at, 3)
    except AssertionError:
        seconds = None
    state = "ready" if leader_ready else "preparing"
    print(f"   takeover, leader killed while {state}: "
          + (f"{seconds:.2f} s to the follower's POST" if seconds is not None
             else f"no POST within takeover_after + {TAKEOVER_GIVE_UP:g} s")
          + f" (takeover_after {takeover_after:g} s)", flush=True)
    return {"event_id": eid, "leader": state, "takeover_after_s": takeover_after, "kill_to_post_s": seconds}


def simulated_fleet(n: int, spread: float, events: int, kind: str, rng: random.Random,
                    takeover_after: float = TAKEOVER_AFTER) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        fleet = SimulatedFleet(n, kind, Path(tmp), takeover_after)
        sampler = Sampler(fleet.agents[fleet.leader].proc.pid)
        try:
            per_event = []
            for k in range(events):
                per_event.append(simulated_event(fleet, rng, spread))
                e = per_event[-1]
                print(f"   simulated N={n} event {k + 1}/{events}: leader {e['leader_requests_per_s']:.0f} req/s, "
                      f"follower {e['follower_requests_per_s']:.0f} req/s, ready -> POST "
                      f"{e['ready_to_post_s'] * 1000:.0f} ms, largest poll gap {e['leader_poll_gap_max_s']:.3f} s",
                      flush=True)
                time.sleep(2.5)  # the event starts, ends and leaves both documents
            leader = sampler.stop()
            takeovers = [takeover(fleet, rng, ready, takeover_after) for ready in (False, True)]
            time.sleep(2.5)
            posts = count_posts(fleet.emu, [fleet.leader, fleet.follower], fleet.event_ids)
            standin_cpu = cpu_seconds(fleet.standin.proc.pid)
        finally:
            sampler.stop()
            fleet.stop()

    def med(key: str) -> float:
        return statistics.median(e[key] for e in per_event)

    return {"n": n, "real_agents": 2, "simulated_peers": n - 2, "spread_s": spread, "events": events,
            "peer_requests_per_s": {"leader": round(med("leader_requests_per_s"), 1),
                                    "follower_rank1": round(med("follower_requests_per_s"), 1),
                                    "pushes": round(med("pushes_per_s"), 1),
                                    "fleet_estimate": round(med("fleet_estimate_per_s")),
                                    "fleet_estimate_per_vm": round(med("fleet_estimate_per_s") / n, 2)},
            "ready_to_post_ms": summary([e["ready_to_post_s"] for e in per_event]),
            "leader_poll_gap_max_s": round(max(e["leader_poll_gap_max_s"] for e in per_event), 3),
            "leader": {**leader, "cpu_pct_median": round(med("cpu_leader_pct"), 1)},
            "follower_cpu_pct_median": round(med("cpu_follower_pct"), 1),
            "standin_cpu_s": round(standin_cpu, 1), "takeovers": takeovers, "posts_per_event": list(posts.values()),
            "per_event": rounded(per_event)}


# --- figures and checks ----------------------------------------------------------------------

def checks_real(r: dict[str, Any]) -> list[tuple[str, str, str, bool]]:
    n, rate, s = r["n"], r["peer_requests_per_s"], r["ready_to_post_ms"]
    cpu, posts = r["cpu_pct_median"], r["posts_per_event"]
    return [
        (f"N={n} real: fleet peer requests/s during preparation (per VM), median of {r['events']} events",
         f"{rate['fleet_median']:.0f} ({rate['per_vm_median']:.1f}/VM)", f"≤ 2·N = {2 * n}",
         rate["fleet_median"] <= 2 * n),
        (f"N={n} real: last hook end -> POST received p50 / p99", f"{s['p50']:.0f} / {s['p99']:.0f} ms (n={s['n']})",
         "reported", True),
        (f"N={n} real: CPU during preparation, leader / follower rank 1 / followers' median",
         f"{cpu['cpu_leader_pct']} / {cpu['cpu_follower_pct']} / {cpu['cpu_followers_median_pct']} % of a core",
         "reported", True),
        (f"N={n} real: POSTs per event", " ".join(map(str, posts)), "exactly 1", all(p == 1 for p in posts)),
        (f"N={n} real: VMs whose hook had not ended at the POST", str(sum(len(e["not_ready_at_post"])
                                                                          for e in r["per_event"])),
         "0", not any(e["not_ready_at_post"] for e in r["per_event"])),
    ]


def checks_simulated(r: dict[str, Any]) -> list[tuple[str, str, str, bool]]:
    n, rate, s = r["n"], r["peer_requests_per_s"], r["ready_to_post_ms"]
    leader, posts = r["leader"], r["posts_per_event"]
    checks = [
        (f"N={n} simulated: fleet peer requests/s (leader + (N-1) x rank-1 follower; per VM)",
         f"{rate['fleet_estimate']:.0f} ({rate['fleet_estimate_per_vm']}/VM; leader {rate['leader']}, "
         f"follower {rate['follower_rank1']})", f"≤ 2·N = {2 * n}", rate["fleet_estimate"] <= 2 * n),
        (f"N={n} simulated: last peer ready -> POST received p50 / p99",
         f"{s['p50']:.0f} / {s['p99']:.0f} ms (n={s['n']})", "p99 < 1 s", s["p99"] < 1000),
        (f"N={n} simulated: leader's largest gap between two polls", f"{r['leader_poll_gap_max_s']:.3f} s",
         "≤ 1.05 s", r["leader_poll_gap_max_s"] <= 1.05),
        (f"N={n} simulated: leader threads (max) / RSS (peak) / CPU (median); follower CPU",
         f"{leader['threads_max']} / {leader['peak_rss_mb']} MB / {leader['cpu_pct_median']} %; "
         f"{r['follower_cpu_pct_median']} %", "reported", True),
    ]
    for t in r["takeovers"]:
        took = t["kill_to_post_s"]
        checks.append((f"N={n} simulated: leader killed while {t['leader']} -> follower's POST received",
                       f"{took:.2f} s" if took is not None
                       else f"none within {t['takeover_after_s'] + TAKEOVER_GIVE_UP:g} s",
                       f"≤ takeover_after + 2 s = {t['takeover_after_s'] + 2:g} s",
                       took is not None and took <= t["takeover_after_s"] + 2))
    checks.append((f"N={n} simulated: POSTs per event (the last two are the takeovers)", " ".join(map(str, posts)),
                   "exactly 1", all(p == 1 for p in posts)))
    return checks


def run(quick: bool = False, sizes: list[int] | None = None, simulated: int | None = None,
        events: int | None = None, kind: str = "peers") -> dict[str, Any]:
    rng = random.Random(13)
    sizes = sizes if sizes is not None else ([5] if quick else [10, 30, 50])
    simulated = simulated if simulated is not None else (50 if quick else 1000)
    real_events = events or (2 if quick else 6)
    figures: dict[str, Any] = {"addressing": kind, "poll_interval_s": 1.0, "real": [], "simulated": None,
                               "tick": []}
    checks: list[tuple[str, str, str, bool]] = []
    for n in sizes:
        result = real_fleet(n, real_events, kind, rng)
        figures["real"].append(result)
        checks += checks_real(result)
    if simulated:
        result = simulated_fleet(simulated, 10.0 if quick else 60.0, events or (1 if quick else 3), kind, rng,
                                 takeover_after=3.0 if quick else TAKEOVER_AFTER)
        figures["simulated"] = result
        checks += checks_simulated(result)
        figures["tick"] = [tick_cost(k) for k in (100, simulated)]
        checks += [(f"N={t['n']} in process: the leader's coordination pass on its loop thread (best / median of 5)",
                    f"{t['ms_per_tick_best']} / {t['ms_per_tick_median']} ms per tick", "reported", True)
                   for t in figures["tick"]]
    return write("fleet", figures, checks, quick)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.fleet", description=__doc__.split("\n")[0])
    size_arguments(p)
    p.add_argument("--addressing", choices=("peers", "peers_file"), default="peers",
                   help="give the agents their peers as coordination.peers (default) or a coordination.peers_file")
    args = p.parse_args(argv)
    run(args.quick, args.n, args.simulated, args.events, args.addressing)
    print(f"summary: {write_summary(args.quick)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
