"""A real Alertmanager for tests: Debian's `prometheus-alertmanager` on a 127.0.0.1 port, not clustered
(`--cluster.listen-address=` empty), with helpers to fire an alert and read silences back."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.e2e.harness import Agent, free_port, http, wait_until
from tests.reaper import die_with_parent

BINARY = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
needs_alertmanager = pytest.mark.skipif(
    BINARY is None, reason="Debian's prometheus-alertmanager is not installed (.ci/run installs it)")
CONFIG = 'route: {receiver: "null"}\nreceivers: [{name: "null"}]\n'


class Alertmanager:
    """One replica; `stop` and `start` keep its data directory (silences survive, as in production)."""

    def __init__(self, workdir: Path) -> None:
        assert BINARY is not None
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "am.yml").write_text(CONFIG)
        self.workdir = workdir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.http = http()
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        assert BINARY is not None
        self.proc = subprocess.Popen(
            [BINARY, f"--config.file={self.workdir / 'am.yml'}", f"--storage.path={self.workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--cluster.listen-address="],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=die_with_parent)
        wait_until(self._ready, 20, f"Alertmanager on {self.url}")

    def _ready(self) -> bool:
        try:
            return self.http.get(f"{self.url}/-/ready", timeout=1).status_code == 200
        except requests.RequestException:
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # a paused one takes its SIGTERM only once it runs again
            self.proc.terminate()
            self.proc.wait(10)

    def pause(self) -> None:
        """Hang it (SIGSTOP): the kernel still accepts connections on its port, nothing answers them."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def fire(self, **labels: str) -> None:
        """Post a firing alert with these labels (alertname MaintenanceTest unless given)."""
        alert = {"labels": {"alertname": "MaintenanceTest", **labels}}
        self.http.post(f"{self.url}/api/v2/alerts", json=[alert], timeout=5).raise_for_status()

    def silenced_by(self, **labels: str) -> list[str]:
        """The silence ids muting the alert with these labels (it must be firing)."""
        alerts = self.http.get(f"{self.url}/api/v2/alerts", timeout=5).json()
        mine = [a for a in alerts if all(a["labels"].get(k) == v for k, v in labels.items())]
        assert mine, f"no alert with {labels} is firing"
        return list(mine[0]["status"]["silencedBy"])

    def silences(self, state: str | None = None) -> list[dict[str, Any]]:
        """Every silence (or those in `state`: active, pending, expired)."""
        found = self.http.get(f"{self.url}/api/v2/silences", timeout=5).json()
        return [s for s in found if state is None or s["status"]["state"] == state]

    def live(self) -> list[dict[str, Any]]:
        """The silences not expired (active or pending)."""
        return [s for s in self.silences() if s["status"]["state"] != "expired"]

    def delete(self, silence_id: str) -> None:
        self.http.delete(f"{self.url}/api/v2/silence/{silence_id}", timeout=5).raise_for_status()


class Trickle:
    """A proxy in front of a replica that passes each request on and trickles the answer back, one byte every
    `every` seconds (an Alertmanager behind a congested link): `url` is where to point maintd."""

    def __init__(self, target: Alertmanager, every: float = 0.3) -> None:
        self.target, self.every = target, every
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._stop = threading.Event()
        self.requests = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                up = socket.create_connection(("127.0.0.1", self.target.port), timeout=10)
            except OSError:
                return
            with up:
                self._relay(conn, up)

    def _relay(self, conn: socket.socket, up: socket.socket) -> None:
        try:
            conn.settimeout(10)
            request = conn.recv(65536)
            self.requests += 1
            up.sendall(request.replace(b"Connection: keep-alive", b"Connection: close"))
            answer = b""
            while chunk := up.recv(65536):
                answer += chunk
            for i in range(len(answer)):
                if self._stop.wait(self.every):
                    return
                conn.sendall(answer[i:i + 1])
        except OSError:
            return

    def close(self) -> None:
        self._stop.set()
        self._listener.close()


@dataclass
class Samples:
    """When the VM left rotation as seen from outside, and what the Alertmanager said while it was out.

    The VM left rotation after the last probe that answered 200 was sent (`in_sent`) and before the first 503
    arrived (`out_at`): the sampler's resolution is that window (`window`)."""

    in_sent: float | None = None
    out_at: float | None = None
    out: int = 0
    unsilenced: list[float] = field(default_factory=list)
    errors: int = 0

    @property
    def window(self) -> float:
        return float("inf") if self.out_at is None or self.in_sent is None else self.out_at - self.in_sent


@contextmanager
def sampling(agent: Agent, am: Alertmanager | None = None) -> Iterator[Samples]:
    """Sample /probe (and, with `am`, its active silences between two probes that both say out) until the end."""
    found, stop = Samples(), threading.Event()

    def out() -> bool:
        return agent.get("/probe").status_code == 503

    def run() -> None:
        while not stop.is_set():
            try:
                sent = time.monotonic()
                if not out():
                    found.in_sent = sent if found.out_at is None else found.in_sent
                else:
                    now = time.monotonic()
                    found.out_at = found.out_at if found.out_at is not None else now
                    if am is not None:
                        active = [s for s in am.live() if s["status"]["state"] == "active"]
                        if out():  # out before and after the read: the silence must have been active throughout
                            found.out += 1
                            if not active:
                                found.unsilenced.append(now - (found.out_at or now))
            except Exception:  # a sample that failed to answer is counted, never a dead sampler
                found.errors += 1
            stop.wait(0.02)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield found
    finally:
        stop.set()
        thread.join(10)


@pytest.fixture
def alertmanagers(tmp_path: Path) -> Iterator[Callable[[int], list[Alertmanager]]]:
    """Start replicas on demand (`alertmanagers(2)`); all are stopped at the end."""
    started: list[Alertmanager] = []

    def start(n: int = 1) -> list[Alertmanager]:
        new = [Alertmanager(tmp_path / f"am-{len(started) + i}") for i in range(n)]
        started.extend(new)
        return new

    yield start
    for am in started:
        am.stop()
