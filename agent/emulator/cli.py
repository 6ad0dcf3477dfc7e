"""`maintd emulate`: the emulator as a process. Prints one ready line on stdout, logs changes on stderr."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from pathlib import Path

from agent.emulator import Emulator
from agent.emulator import scenario as scenario_mod


def _log(**fields: object) -> None:
    print(json.dumps(fields, default=str), file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="maintd emulate", description="A faithful IMDS Scheduled Events emulator on "
                                "loopback: one port per VM, admin API under /admin/ (events, faults, requests).")
    p.add_argument("--vm", action="append", help="an emulated VM (repeat; default vm-1, or the scenario's vms)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=0, help="port of the first VM, the others follow (0: free ports)")
    p.add_argument("--scenario", type=Path, help="a YAML scenario file (events and faults on a timeline)")
    p.add_argument("--time-scale", type=float, help="emulated seconds per real second (default 1)")
    p.add_argument("--rate-limit", type=float, default=5.0, help="requests per second per VM before 429 (default 5)")
    p.add_argument("--started-duration", type=float, help="seconds a Started event stays (default 10)")
    p.add_argument("--etag", action="store_true", help="send ETag and answer If-None-Match with 304 (unverified "
                                                       "on real IMDS)")
    p.add_argument("--unknown-event", choices=("ok", "400"), default="ok",
                   help="answer to approving an unknown EventId (undocumented on real IMDS; default ok)")
    args = p.parse_args(argv)

    plan = None
    if args.scenario:
        try:
            plan = scenario_mod.parse(args.scenario.read_text())
        except (OSError, scenario_mod.ScenarioError) as exc:
            print(f"maintd emulate: {args.scenario}: {exc}", file=sys.stderr)
            return 2
    vms = args.vm or (plan.vms if plan else ["vm-1"])
    scale = args.time_scale or (plan.time_scale if plan else 1.0)
    started = args.started_duration if args.started_duration is not None else (plan.started_duration if plan else None)
    emulator = Emulator(vms, time_scale=scale, rate_limit=args.rate_limit, etag=args.etag,
                        unknown_event=args.unknown_event, started_duration=started)
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
        threading.Thread(target=scenario_mod.run, daemon=True, name="scenario",
                         args=(plan, emulator, stop, lambda s: _log(event=f"scenario.{s.what}", at=s.at, **s.args))
                         ).start()
    seen = 0
    while not stop.wait(0.1):
        with emulator.model.lock:
            changes = emulator.model.changes[seen:]
            seen += len(changes)
        for change in changes:
            _log(event=f"emulator.{change.pop('change')}", **change)
    emulator.stop()
    return 0
