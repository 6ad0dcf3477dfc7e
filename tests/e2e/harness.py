"""Real processes on 127.0.0.1 for end-to-end tests: `maintd emulate` and `maintd run`.

Waiting here is for a condition with a deadline (a process answering, a log line arriving), never
for time to pass.
"""

from __future__ import annotations

import json
import os
import queue
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import requests
import yaml

from tests.reaper import die_with_parent

CLEAN_ENV = {k: v for k, v in os.environ.items()
             if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS", "LISTEN_PID")}


_HANDED_OUT: set[int] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now, never one this process handed out before: the kernel may give a just-closed
    port again, and two VMs of one fleet given the same port made one VM answer for the other (a CI flake)."""
    while True:
        with socket.socket() as s:
            s.bind((host, 0))
            port: int = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


def http() -> requests.Session:
    s = requests.Session()
    s.trust_env = False
    return s


def wait_until(predicate: Callable[[], Any], timeout: float, what: str | Callable[[], str],
               interval: float = 0.05) -> Any:
    """Poll `predicate` until it returns something truthy; fail the test naming `what` (or what `what()` says
    then) on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what() if callable(what) else what}")
        time.sleep(interval)


class PortTaken(AssertionError):
    """maintd could not bind its port: another process took it between `free_port` and the bind."""


class Process:
    """A child process whose stderr JSON lines are collected on a thread."""

    def __init__(self, argv: list[str], env: dict[str, str] | None = None) -> None:
        self.argv = argv
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env=env or CLEAN_ENV, preexec_fn=die_with_parent)
        self.lines: list[dict[str, Any]] = []
        self.raw: list[str] = []
        self._lock = threading.Lock()
        self.stdout: queue.Queue[str] = queue.Queue()
        self.err_reader = threading.Thread(target=self._read_err, daemon=True)
        self.err_reader.start()
        threading.Thread(target=self._read_out, daemon=True).start()

    def _read_err(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            with self._lock:
                self.raw.append(line)
                try:
                    entry = json.loads(line)
                except ValueError:
                    continue
                if isinstance(entry, dict):
                    self.lines.append(entry)

    def _read_out(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.stdout.put(line)

    def events(self, name: str | None = None) -> list[dict[str, Any]]:
        with self._lock:
            return [e for e in self.lines if name is None or e.get("event") == name]

    def wait_log(self, name: str, timeout: float = 30.0, **fields: Any) -> dict[str, Any]:
        def found() -> dict[str, Any] | None:
            return next((e for e in self.events(name) if all(e.get(k) == v for k, v in fields.items())), None)
        return wait_until(found, timeout, lambda: f"log {name} {fields or ''} from {self.argv[3:5]}; last lines: "
                          + "".join(self.raw[-5:]))

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(5)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(5)


class Emulator(Process):
    """`maintd emulate` with its admin API."""

    def __init__(self, vms: list[str], *extra: str) -> None:
        # The agents here poll every 100 ms (10 req/s): above IMDS's 5 req/s, so the bucket is raised.
        argv = [sys.executable, "-m", "agent", "emulate", "--port", "0", "--rate-limit", "50"]
        for vm in vms:
            argv += ["--vm", vm]
        super().__init__(argv + list(extra))
        try:
            line = self.stdout.get(timeout=30)
        except queue.Empty:
            self.kill()
            raise AssertionError("the emulator printed no ready line: " + "".join(self.raw[-10:])) from None
        ready = json.loads(line)
        assert ready["event"] == "emulator.ready"
        self.urls: dict[str, str] = ready["vms"]
        self.http = http()

    def admin(self, verb: str, route: str, vm: str | None = None, /, **body: Any) -> Any:
        url = self.urls[vm or next(iter(self.urls))] + "/admin/" + route
        r = self.http.request(verb, url, json=body if body else None, timeout=5)
        r.raise_for_status()
        return r.json() if r.content else None

    def add_event(self, **body: Any) -> str:
        answer = self.admin("POST", "events", **body)
        return answer["EventId"] if isinstance(answer, dict) else str(answer)

    def requests(self, vm: str | None = None) -> list[dict[str, Any]]:
        return self.admin("GET", "requests", vm)

    def approvals(self, vm: str | None = None) -> list[dict[str, Any]]:
        return self.admin("GET", "approvals", vm)


class Agent(Process):
    """`maintd run` with a config written into `workdir`."""

    def __init__(self, workdir: Path, imds_url: str, name: str, extra: dict[str, Any] | None = None,
                 env: dict[str, str] | None = None, port: int | None = None, host: str = "127.0.0.1") -> None:
        """`host`: the loopback address it listens on (127.0.0.2, ... for members that have no address for each
        other)."""
        self.host = host
        for attempt in range(3):  # a port of our choosing that another process took first: choose again
            try:
                self._start_on(port or free_port(self.host), workdir, imds_url, name, extra, env)
                return
            except PortTaken:
                if port is not None or attempt == 2:
                    raise

    def _start_on(self, port: int, workdir: Path, imds_url: str, name: str, extra: dict[str, Any] | None,
                  env: dict[str, str] | None) -> None:
        self.port = port
        self.env = {**CLEAN_ENV, **(env or {})}
        self.workdir = workdir
        self.base = f"http://{self.host}:{self.port}"
        workdir.mkdir(parents=True, exist_ok=True)
        # the secure default with this agent's own paths: root acts over its unix socket, scripts (post()) with the
        # token; loopback alone only reads
        self.unix_socket = str(workdir / "maintd.sock")
        self.token = secrets.token_hex(16)
        token_file = workdir / "token"
        token_file.write_text(self.token + "\n")
        os.chmod(token_file, 0o600)
        cfg: dict[str, Any] = {
            "imds": {"endpoint": imds_url, "poll_interval": "100ms", "timeout": "2s", "first_timeout": "5s",
                     "max_backoff": "500ms"},
            "identity": {"name": name},
            "state": {"dir": str(workdir / "state")},
            # every VM of a test fleet calls its peers from 127.0.0.1, which holds one client's share on each
            "server": {"listen": f"{self.host}:{self.port}", "max_connections_per_client": 1024,
                       "unix_socket": self.unix_socket, "token_file": str(token_file)},
            "log": {"format": "json", "level": "debug"},
        }
        for key, value in (extra or {}).items():
            if isinstance(value, dict) and isinstance(cfg.get(key), dict):
                cfg[key] = {**cfg[key], **value}
            else:
                cfg[key] = value
        self.base = f"http://{cfg['server']['listen']}"  # the address a test chose (server.listen), if it did
        self.config_path = workdir / "maintd.yaml"
        self.config_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        os.chmod(self.config_path, 0o600)
        self.http = http()
        self.start()

    def start(self) -> None:
        super().__init__([sys.executable, "-m", "agent", "run", "--config", str(self.config_path)], self.env)
        wait_until(self._up, 30, lambda: f"maintd {self.base} to answer /healthz; stderr: " + "".join(self.raw[-10:]))

    def _up(self) -> bool:
        if self.proc.poll() is not None:
            self.err_reader.join(5)
            why = f"maintd exited with {self.proc.returncode}: " + "".join(self.raw[-20:])
            if any(e.get("event") == "server.bind_failed" and "Address already in use" in str(e.get("error"))
                   for e in self.events()):
                raise PortTaken(why)
            raise AssertionError(why)
        try:
            answered = self.http.get(self.base + "/healthz", timeout=1).status_code == 200
        except requests.RequestException:
            return False
        # this maintd's own answer, not another process's on the same port (this one then exits: bind_failed)
        return answered and any(e.get("event") == "server.listening" for e in self.events())

    def get(self, path: str) -> requests.Response:
        return self.http.get(self.base + path, timeout=5)

    def post(self, path: str, body: Any = None, token: bool = True) -> requests.Response:
        """POST over loopback TCP, as a script does: with the server's bearer token unless `token` is False."""
        headers = {"Authorization": f"Bearer {self.token}"} if token else {}
        return self.http.post(self.base + path, json=body, headers=headers, timeout=5)

    def state(self) -> dict[str, Any]:
        return json.loads((self.workdir / "state" / "state.json").read_text())
