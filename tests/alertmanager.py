"""A real Alertmanager for tests: Debian's `prometheus-alertmanager` on a 127.0.0.1 port, not clustered
(`--cluster.listen-address=` empty), with helpers to fire an alert and read silences back."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.e2e.harness import free_port, http, wait_until
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
            self.proc.terminate()
            self.proc.wait(10)

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
