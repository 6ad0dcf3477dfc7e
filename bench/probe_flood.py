"""The load balancer's probe under a pipelined /probe flood (issue 28, finding 2).

Four flooder processes open 32 connections from each of 4 (then 64) loopback addresses (127.0.1.x) and keep
up to 1024 pipelined `GET /probe` in flight on each (64 more whenever 64 are answered), reading the answers.
Meanwhile the LB probes from another address on a new connection every 0.3 s (1 s budget: an answer later than
1 s, or none, is a failure) and a peer asks `/v1/health` every second (2 s budget). Reports the probe's
p50/p99/max and failures, the peer asks answered, the server's CPU share and its protective closes.

`MAINTD_BENCH_TREE=/path/to/checkout` runs the daemon from another source tree (the figures before a change).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench.common import cpu_seconds, summary, write
from tests.e2e.harness import CLEAN_ENV, Agent, Emulator

FLOOD = textwrap.dedent("""
    import json, resource, selectors, socket, sys, time
    port, first, addresses, per, seconds = (int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]),
                                            float(sys.argv[5]))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 65536), hard))
    DEPTH = 1024
    BATCH = b"GET /probe HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n" * 64
    sel = selectors.DefaultSelector()
    answers, reconnects = [0], [0]
    def open_one(source):
        s = socket.socket()
        s.setblocking(False)
        s.bind((source, 0))
        try:
            s.connect(("127.0.0.1", port))
        except BlockingIOError:
            pass
        sel.register(s, selectors.EVENT_READ | selectors.EVENT_WRITE, [source, 0, b""])
    for a in range(first, first + addresses):
        for _ in range(per):
            open_one(f"127.0.1.{a + 1}")
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for key, mask in sel.select(0.1):
            s, state = key.fileobj, key.data  # [source, requests in flight, bytes not yet sent]
            try:
                if mask & selectors.EVENT_READ:
                    data = s.recv(1 << 18)
                    if not data:
                        raise ConnectionResetError
                    n = data.count(b"HTTP/1.1 ")
                    answers[0] += n
                    state[1] -= n
                if state[1] <= DEPTH - 64 and not state[2]:
                    state[1] += 64
                    state[2] = BATCH
                if state[2]:  # the rest of a partial write first: requests stay whole
                    state[2] = state[2][s.send(state[2]):]
                sel.modify(s, selectors.EVENT_READ | (selectors.EVENT_WRITE if state[2] else 0), state)
            except BlockingIOError:
                pass
            except OSError:
                sel.unregister(s)
                s.close()
                reconnects[0] += 1
                open_one(state[0])
    print(json.dumps({"answers": answers[0], "reconnects": reconnects[0]}))
""")


FLOODERS = 4
"""Flooder processes, the addresses shared among them (one Python process alone cannot keep 2048 connections busy)."""


def answered_in(port: int, source: str, path: str, budget: float) -> float | None:
    """Seconds until `GET path` on a new connection from `source` is answered 200; None when it is not within
    `budget`."""
    t0 = time.monotonic()
    try:
        with socket.socket() as s:
            s.settimeout(budget)
            s.bind((source, 0))
            s.connect(("127.0.0.1", port))
            s.sendall(b"GET " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            ok = s.recv(4096).startswith(b"HTTP/1.1 200")
    except OSError:
        return None
    return time.monotonic() - t0 if ok else None


def flood(port: int, pid: int, addresses: int, seconds: float) -> dict[str, Any]:
    """One flood from `addresses` x 32 connections, with the LB's probes and a peer's asks during it."""
    cpu0, t0 = cpu_seconds(pid), time.monotonic()
    share = addresses // FLOODERS
    flooders = [subprocess.Popen([sys.executable, "-c", FLOOD, str(port), str(k * share), str(share), "32",
                                  str(seconds)], stdout=subprocess.PIPE, text=True, env=CLEAN_ENV)
                for k in range(FLOODERS)]
    time.sleep(min(2.0, seconds / 4))  # the flood is on
    probes: list[float | None] = []
    asks: list[bool] = []

    def ask_peers() -> None:
        while flooders[0].poll() is None and len(asks) < seconds:
            asks.append(answered_in(port, "127.0.0.251", "/v1/health", 2.0) is not None)
            time.sleep(1.0)

    asker = threading.Thread(target=ask_peers)
    asker.start()
    end = time.monotonic() + seconds * 0.6
    while time.monotonic() < end:
        probes.append(answered_in(port, "127.0.0.250", "/probe", 5.0))
        time.sleep(0.3)
    asker.join()
    done = [json.loads(f.communicate(timeout=seconds + 30)[0] or "{}") for f in flooders]
    answered = [p for p in probes if p is not None]
    server_cpu = (cpu_seconds(pid) - cpu0) / (time.monotonic() - t0)
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    drops = {line.split('"')[1]: float(line.split()[-1]) for line in metrics.splitlines()
             if line.startswith("maintd_http_connections_dropped_total{")}
    late = sum(1 for p in probes if p is None or p > 1.0)
    return {"addresses": addresses, "connections": addresses * 32, "probes": len(probes), "failures": late,
            "probe_ms": summary(answered) if answered else {}, "probe_max_ms": round(max(answered) * 1000, 1)
            if answered else None, "peer_asks": len(asks), "peer_asks_answered": sum(asks),
            "flood_answers_per_s": round(sum(d.get("answers", 0) for d in done) / seconds),
            "flood_reconnects": sum(d.get("reconnects", 0) for d in done), "dropped_so_far": drops,
            "server_cpu_share_of_a_core": round(server_cpu, 2)}


def run(quick: bool = False) -> dict[str, Any]:
    seconds = 8.0 if quick else 25.0
    tree = os.environ.get("MAINTD_BENCH_TREE")
    emu = Emulator(["vm-1"])
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        agent = Agent(Path(tmp) / "vm-1", emu.urls["vm-1"], "vm-1",
                      {"imds": {"poll_interval": "1s"}, "log": {"level": "warning"},
                       "server": {"max_connections_per_client": 32}}, env={"PYTHONPATH": tree} if tree else None)
        try:
            for addresses in (4, 64):
                results.append(flood(agent.port, agent.proc.pid, addresses, seconds))
        finally:
            agent.stop()
            emu.stop()
    name = "probe_flood" + ("_before" if tree else "")
    checks = []
    for r in results:
        p99 = r["probe_ms"].get("p99", "-")
        checks.append((f"LB probe under the flood from {r['addresses']} addresses x 32: p99 / max, failures (> 1 s)",
                       f"{p99} / {r['probe_max_ms']} ms, {r['failures']} of {r['probes']}",
                       "0 failures" if r["addresses"] == 4 else "reported", r["addresses"] != 4 or r["failures"] == 0))
        answered = r["peer_asks_answered"]
        checks.append((f"peer asks answered during it ({r['addresses']} addresses)",
                       f"{answered} of {r['peer_asks']}", "all", answered == r["peer_asks"]))
    return write(name, {"floods": results, "tree": tree or "this checkout"}, checks, quick)
