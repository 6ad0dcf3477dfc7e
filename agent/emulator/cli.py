"""`maintd emulate` (also `python -m agent.emulator`): the emulator as a process.

Prints one JSON line on stdout once every VM listens,
`{"event": "emulator.ready", "vms": {"vm-1": "http://127.0.0.1:PORT", ...}}`, logs every state
change as a JSON line on stderr, and serves until SIGTERM or SIGINT (exit 0).
"""

from __future__ import annotations

import argparse
import json
import queue
import signal
import sys
import threading
from datetime import UTC, datetime
from typing import Any

from agent.emulator import Emulator
from agent.emulator.model import UNKNOWN_EVENT_ANSWERS
from agent.emulator.scenario import ScenarioError, load

DESCRIPTION = ("A faithful IMDS Scheduled Events emulator: one port per VM, IMDS's wire format, validation and "
               "rate limit, fault injection, and an admin API under /admin/ (events, faults, requests, "
               "approvals, reset) for loopback clients.")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="maintd emulate", description=DESCRIPTION)
    p.add_argument("--vm", action="append", metavar="NAME",
                   help="an emulated VM (repeat for several; default vm-1, or the scenario's vms)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=0,
                   help="port of the first VM, the others follow (default 0: free ports)")
    p.add_argument("--scenario", metavar="FILE", help="a YAML scenario: events and faults on a timeline")
    p.add_argument("--time-scale", type=float, help="emulated seconds per real second (default 1, or the scenario's)")
    p.add_argument("--rate-limit", type=float, default=5.0, help="requests/s per VM before 429 (default 5; 0: none)")
    p.add_argument("--started-duration", type=float, metavar="SECONDS",
                   help="how long a Started event with DurationInSeconds -1 stays (default 10)")
    p.add_argument("--first-call-delay", type=float, metavar="SECONDS",
                   help="delay each VM's first request, and the first after a reset (real IMDS: up to 120 s)")
    p.add_argument("--etag", action=argparse.BooleanOptionalAction, default=True,
                   help="send ETag and answer If-None-Match with 304 (unverified on real IMDS; default on)")
    p.add_argument("--broadcast", action=argparse.BooleanOptionalAction, default=True,
                   help="every VM sees every event, as in an availability set (default on)")
    p.add_argument("--zones", type=int, default=0, metavar="N",
                   help="spread the VMs over N availability zones in turn (compute zone 1..N; default 0: none)")
    p.add_argument("--unknown-event", choices=UNKNOWN_EVENT_ANSWERS, default="ok",
                   help="the answer to approving an unknown EventId (undocumented on real IMDS; default ok)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the emulator until SIGTERM/SIGINT; returns the exit status."""
    args = _parser().parse_args(argv)
    lines: queue.Queue[dict[str, Any]] = queue.Queue()

    def listen(name: str, fields: dict[str, Any]) -> None:
        lines.put({"ts": datetime.now(UTC).isoformat(), "event": name, **fields})

    try:
        plan = load(args.scenario) if args.scenario else None
        emulator = Emulator(args.vm or (plan.vms if plan else ["vm-1"]),
                            time_scale=args.time_scale if args.time_scale is not None
                            else (plan.time_scale if plan else 1.0),
                            rate_limit=args.rate_limit, etag=args.etag,
                            started_duration=args.started_duration if args.started_duration is not None
                            else (plan.started_duration if plan else None),
                            broadcast=args.broadcast, unknown_event=args.unknown_event, listener=listen,
                            zones=args.zones)
        if args.first_call_delay:
            emulator.add_fault(kind="first_call_delay", delay=args.first_call_delay)
    except (ScenarioError, ValueError) as exc:
        print(f"maintd emulate: {exc}", file=sys.stderr)
        return 2
    try:
        urls = emulator.start(args.host, args.port)
    except OSError as exc:
        print(f"maintd emulate: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    print(json.dumps({"event": "emulator.ready", "vms": urls}), flush=True)
    if plan is not None:
        emulator.play(plan)
    while not stop.is_set():
        try:
            line = lines.get(timeout=0.1)
        except queue.Empty:
            continue
        print(json.dumps(line, default=str), file=sys.stderr, flush=True)
    emulator.stop()
    while not lines.empty():
        print(json.dumps(lines.get(), default=str), file=sys.stderr, flush=True)
    return 0
