"""`maintd demo`: the emulator and a real agent process on loopback, a Reboot handled end to end.

Reads the agent's JSON log and the probe, and prints a readable timeline. Exits 0 once the event
has completed and the VM is back in rotation, 1 if that does not happen in time.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any, cast

import requests
import yaml

from agent.emulator import Emulator

VM = "vm-1"


def free_port() -> int:
    """A TCP port on 127.0.0.1 nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def demo_config(endpoint: str, listen: str, run_dir: str) -> dict[str, Any]:
    """The shipped demo.yaml with this run's emulator, port, and its state and unix socket in `run_dir`."""
    data = yaml.safe_load(resources.files("agent.cli").joinpath("demo.yaml").read_text())
    data["imds"]["endpoint"] = endpoint
    data["server"]["listen"] = listen
    data["server"]["unix_socket"] = str(Path(run_dir) / "maintd.sock")
    data["state"]["dir"] = str(Path(run_dir) / "state")
    return cast(dict[str, Any], data)


def _hm(text: str | None) -> str:
    return text[11:19] if text and len(text) >= 19 else "-"


def describe(entry: dict[str, Any]) -> str | None:
    """One readable line for an agent log entry the demo cares about (None: skip it)."""
    name = entry.get("event", "")
    fmt: dict[str, Callable[[dict[str, Any]], str]] = {
        "identity.resolved": lambda e: f"agent knows it is {e.get('vm_name')} (from IMDS compute metadata)",
        "event.appeared": lambda e: (f"IMDS announces {e.get('event_type')} {e.get('event_id', '')[:8]}… for "
                                     f"{'this VM' if e.get('names_self') else 'another VM'}, not before "
                                     f"{_hm(e.get('not_before'))} UTC (in {e.get('notice_seconds', '?')}s)"),
        "handler.started": lambda e: f"  handler {e.get('handler')} ({e.get('phase')}) started",
        "handler.finished": lambda e: f"  handler {e.get('handler')} ({e.get('phase')}): {e.get('outcome')} — "
                                      f"{e.get('detail') or ''}".rstrip(" —"),
        "hook.output": lambda e: "    | " + "\n    | ".join(str(e.get("lines", "")).splitlines()[-5:]),
        "approval.sent": lambda e: f"approval sent by {e.get('by')}: {e.get('reason')}",
        "approval.failed": lambda e: f"approval failed: {e.get('error')}",
        "event.status_changed": lambda e: f"IMDS: the event is now {e.get('status')} (maintenance under way)",
        "event.completed": lambda e: "IMDS: the event is gone — maintenance completed",
        "event.canceled": lambda e: "IMDS: the event is gone — canceled",
        "poll.failed": lambda e: f"poll failed: {e.get('error')}",
    }
    return fmt[name](entry) if name in fmt else None


LAST_HANDLER = "restore"
"""The demo config's last handler (completed phase): the demo ends once it has run."""


def main(argv: list[str] | None = None) -> int:
    """Run the demo; returns the exit status."""
    p = argparse.ArgumentParser(prog="maintd demo", description=__doc__)
    p.add_argument("--notice", type=float, default=45.0, help="seconds between the announcement and NotBefore")
    p.add_argument("--timeout", type=float, default=120.0, help="give up after this many seconds")
    args = p.parse_args(argv)

    emulator = Emulator(vms=[VM], started_duration=5.0)
    urls = emulator.start(host="127.0.0.1")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()

    def say(text: str) -> None:
        print(f"+{time.monotonic() - t0:5.1f}s  {text}", flush=True)

    with tempfile.TemporaryDirectory(prefix="maintd-demo-") as tmp:
        cfg_path = Path(tmp) / "maintd.yaml"
        cfg_path.write_text(yaml.safe_dump(demo_config(urls[VM], f"127.0.0.1:{port}", tmp)))
        os.chmod(cfg_path, 0o600)
        say(f"IMDS emulator on {urls[VM]}; starting the agent (API and probe on {base})")
        env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "JOURNAL_STREAM")}
        agent = subprocess.Popen([sys.executable, "-m", "agent", "run", "--config", str(cfg_path)],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        lines: queue.Queue[dict[str, Any]] = queue.Queue()
        threading.Thread(target=_read_log, args=(agent.stderr, lines), daemon=True).start()
        try:
            return _run(emulator, base, lines, say, args)
        finally:
            agent.terminate()
            try:
                agent.wait(10)
            except subprocess.TimeoutExpired:
                agent.kill()
            emulator.stop()


def _read_log(stream: Any, out: queue.Queue[dict[str, Any]]) -> None:
    for line in stream:
        try:
            entry = json.loads(line.lstrip("<0123456789>"))
        except ValueError:
            continue
        if isinstance(entry, dict):
            out.put(entry)


def _probe(session: requests.Session, base: str) -> str:
    try:
        r = session.get(f"{base}/probe", timeout=1)
    except requests.RequestException:
        return "unreachable"
    return f"{r.status_code} {r.text.strip()}"


def _run(emulator: Emulator, base: str, lines: queue.Queue[dict[str, Any]], say: Callable[[str], None],
         args: argparse.Namespace) -> int:
    session = requests.Session()
    session.trust_env = False
    deadline = time.monotonic() + args.timeout
    scheduled = False
    completed = False
    probe_seen = ""
    while time.monotonic() < deadline:
        try:
            entry = lines.get(timeout=0.2)
        except queue.Empty:
            entry = None
        if entry is not None:
            text = describe(entry)
            if text:
                say(text)
            if entry.get("event") == "handler.finished" and entry.get("handler") == LAST_HANDLER:
                completed = True
        probe = _probe(session, base)
        if probe != probe_seen and probe != "unreachable":
            say(f"LB probe {base}/probe answers {probe}")
            probe_seen = probe
        if not scheduled and probe.startswith("200"):
            event_id = emulator.add_event(event_type="Reboot", resources=[VM], notice=args.notice,
                                          description="Host server is undergoing maintenance.")
            say(f"scheduling a Reboot for {VM} in the emulator (EventId {event_id}, notice {args.notice:.0f}s)")
            scheduled = True
        if completed and probe.startswith("200"):
            say("done: prepared, approved, rebooted (emulated), back in rotation")
            return 0
    say(f"the demo did not finish within {args.timeout:.0f}s; see the log lines above")
    return 1
