"""The cluster rig: the two-node cluster (`netns.Cluster`), each node's IMDS at 169.254.169.254 inside
its namespace (one `agent.emulator.Emulator` model, one server per node, opened in that node's
network namespace) and one `maintd run` per node, entered into the node like its cluster daemons.

Also a `Sampler`: where the resource runs and which nodes are in standby, read every 0.2 s, and
every StartRequests POST the IMDS servers accepted, with their times: what the scenarios are judged by.
"""

from __future__ import annotations

import http.client
import json
import os
import secrets
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from agent.emulator import Emulator
from agent.emulator.server import VmServer
from tests.cluster.netns import IMDS, LAUNCH, Cluster, Mon, Node
from tests.e2e.harness import CLEAN_ENV, Process, wait_until

ROOT = Path(__file__).resolve().parents[2]


class ClusterImds(Emulator):
    """One event model; each node's server listens on 169.254.169.254:80 inside that node's namespace."""

    def __init__(self, nodes: list[Node], **kw: Any) -> None:
        self.timeline: list[tuple[float, str, dict[str, Any]]] = []
        super().__init__([n.name for n in nodes], rate_limit=None, listener=self._heard, **kw)
        self.cluster_nodes = nodes

    def _heard(self, name: str, fields: dict[str, Any]) -> None:
        self.timeline.append((time.monotonic(), name, fields))

    def start_in_nodes(self) -> None:
        for i, node in enumerate(self.cluster_nodes):
            self._servers[node.name] = node.in_netns(lambda n=node, i=i: VmServer(IMDS, 80, n.name, i, self))
        for server in self._servers.values():
            server.serve_in_thread()
        threading.Thread(target=self._tick_loop, name="emulator-tick", daemon=True).start()

    def clear_events(self) -> None:
        """End every event (a test's leftovers)."""
        with self.model.lock:
            ids = list(self.model._events)
        for eid in ids:
            self.complete_event(eid)

    def when(self, name: str, event_id: str) -> float | None:
        """Monotonic time the model first did `name` (e.g. emulator.event_completed) for the event."""
        return next((t for t, n, f in self.timeline if n == name and f.get("event_id") == event_id), None)


class UnixHttp(http.client.HTTPConnection):
    def __init__(self, path: str) -> None:
        super().__init__("localhost", timeout=5)
        self.path = path

    def connect(self) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(5)
        s.connect(self.path)
        self.sock = s


class NodeAgent(Process):
    """`maintd run` inside a node, talking to that node's IMDS at 169.254.169.254; read over its unix socket."""

    def __init__(self, node: Node, workdir: Path, handler: dict[str, Any]) -> None:
        self.node, self.workdir = node, workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.unix_socket = str(workdir / "maintd.sock")
        token_file = workdir / "token"
        token_file.write_text(secrets.token_hex(16) + "\n")
        os.chmod(token_file, 0o600)
        cfg = {
            "imds": {"poll_interval": "250ms", "timeout": "2s", "first_timeout": "5s", "max_backoff": "500ms"},
            "identity": {"name": node.name},
            "state": {"dir": str(workdir / "state")},
            "server": {"listen": "127.0.0.1:8080", "unix_socket": self.unix_socket, "token_file": str(token_file)},
            "log": {"format": "json", "level": "debug"},
            "handlers": [handler],
        }
        self.config_path = workdir / "maintd.yaml"
        self.config_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        os.chmod(self.config_path, 0o600)
        self.start()

    def start(self) -> None:
        env = {**CLEAN_ENV, "PYTHONPATH": str(ROOT)}
        argv = [sys.executable, "-c", LAUNCH, sys.executable, "-m", "agent", "run", "--config", str(self.config_path)]
        super().__init__(self.node.enter(argv), env)  # LAUNCH: it ends with the test process, however that ends
        wait_until(lambda: self._up(), 60, lambda: f"maintd on {self.node.name}; stderr: " + "".join(self.raw[-10:]))

    def _up(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"maintd on {self.node.name} exited {self.proc.returncode}: "
                                 + "".join(self.raw[-20:]))
        return any(e.get("event") == "server.listening" for e in self.events()) and self.get("/healthz")[0] == 200

    def get(self, path: str) -> tuple[int, Any]:
        conn = UnixHttp(self.unix_socket)
        try:
            conn.request("GET", path)
            r = conn.getresponse()
            body = r.read()
            return r.status, json.loads(body) if body.startswith((b"{", b"[")) else body
        except OSError:
            return 0, None
        finally:
            conn.close()

    def health(self) -> dict[str, Any]:
        return self.get("/v1/health")[1] or {}

    def report(self, prop: str) -> dict[str, Any] | None:
        """This maintd's health report `prop` of SourceId pacemaker (HealthState, Description), if any."""
        for e in self.health().get("HealthEvents", []):
            if e.get("SourceId") == "pacemaker" and e.get("Property") == prop:
                return dict(e)
        return None


@dataclass
class Sample:
    at: float
    where: str | None
    standby: tuple[str, ...]
    online: tuple[str, ...]
    healthy: dict[str, bool] = field(default_factory=dict)
    """Per node: online, out of standby, and its node health (azure-events-az's #health-azure) not red."""


@dataclass
class Sampler:
    """Where `rsc` runs and who is in standby, every `interval` seconds (crm_mon from the first node)."""

    cluster: Cluster
    rsc: str = "dummy"
    interval: float = 0.2
    node: Node | None = None
    """The node crm_mon is asked on (the first by default)."""
    samples: list[Sample] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> Sampler:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        wait_until(lambda: self.samples, 30, "a first crm_mon sample")
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(15)

    def _run(self) -> None:
        next_at = time.monotonic()
        while not self._stop.is_set():
            at = time.monotonic()  # a sample is stamped when crm_mon was asked: the state it shows is no older
            mon = self.cluster.mon(self.node)
            if mon is not None:
                self.samples.append(_sample(at, mon, self.rsc))
            next_at += self.interval
            self._stop.wait(max(0.0, next_at - time.monotonic()))

    def first(self, pred: Any, after: float = 0.0) -> float | None:
        return next((s.at for s in list(self.samples) if s.at >= after and pred(s)), None)

    def downtime(self) -> list[float]:
        """Each stretch of time the resource ran nowhere (from the last sample that saw it to the first again)."""
        out, last_up, down = [], None, False
        for s in list(self.samples):
            if s.where is None:
                down = True
            else:
                if down and last_up is not None:
                    out.append(s.at - last_up)
                down, last_up = False, s.at
        return out


def _sample(at: float, mon: Mon, rsc: str) -> Sample:
    return Sample(at, mon.where(rsc), tuple(n for n, v in mon.nodes.items() if v.standby),
                  tuple(n for n, v in mon.nodes.items() if v.online),
                  {n: v.online and not v.standby and v.health != "red" for n, v in mon.nodes.items()})


@contextmanager
def running(cluster: Cluster, handler: dict[str, Any], base: Path, started_duration: float) \
        -> Iterator[tuple[ClusterImds, dict[str, NodeAgent]]]:
    """The cluster started, an IMDS in each node and one maintd per node running `handler`; all taken down on
    the way out, whatever raised (the tests' fixture and `python -m bench pacemaker`)."""
    imds: ClusterImds | None = None
    agents: dict[str, NodeAgent] = {}
    try:
        cluster.start()
        imds = ClusterImds(cluster.nodes, started_duration=started_duration)
        imds.start_in_nodes()
        for node in cluster.nodes:
            agents[node.name] = NodeAgent(node, base / "maintd" / node.name, handler)
        yield imds, agents
    finally:
        for agent in agents.values():
            agent.stop()
        if imds is not None:
            imds.stop()
        cluster.stop()
