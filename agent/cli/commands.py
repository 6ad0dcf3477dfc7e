"""The `maintd` command: run the daemon, check a config, talk to a running daemon, emulate, demo."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, TypedDict

from agent import __version__
from agent.config import config as config_mod
from agent.coordination.coordination_settings import CoordinationConfig
from agent.coordination.peers.peers_file import PeersFile
from agent.errors import ConfigError

if TYPE_CHECKING:
    from agent.model.outcomes import Phase
    from agent.model.tracker import Transition, TransitionKind, VanishOutcome

EX_CONFIG = 78


def load_for_run(path: str, dry_run: bool = False) -> config_mod.Config:
    """The config for `run`: the file, with $STATE_DIRECTORY and --dry-run applied."""
    cfg = config_mod.with_state_env(config_mod.load(path))
    if dry_run:
        cfg = dataclasses.replace(cfg, dry_run=True)
    return cfg


# --- run / check-config ---------------------------------------------------------------------

def cmd_run(args: argparse.Namespace) -> int:
    from agent.clock import SystemClock
    from agent.errors import StateError
    from agent.loop.daemon import Daemon
    from agent.state.state_file import check_dir
    from agent.systemd import listen_fds
    from agent.telemetry import logs

    path = config_mod.path_from(args.config)
    try:
        cfg = load_for_run(path, args.dry_run)
    except ConfigError as exc:
        print(f"maintd: config refused: {exc}", file=sys.stderr)
        return EX_CONFIG
    try:
        check_dir(cfg.state.dir, create=not args.once)
    except StateError as exc:
        print(f"maintd: {exc}", file=sys.stderr)
        return EX_CONFIG
    logs.configure(cfg.log.format, cfg.log.level)
    daemon = Daemon(cfg, SystemClock(), config_path=path)
    if args.once:
        return run_once(daemon)
    daemon.control.install()
    daemon.load()  # drains and events first: /probe, the TCP probe and /healthz never answer from an empty state
    sockets = listen_fds()
    try:
        daemon.serve(sockets[0] if sockets else None)
    except OSError as exc:
        daemon.log.error("server.bind_failed", listen=cfg.server.listen, error=str(exc),
                         hint="another process holds the port or the unix socket, or maintd may not create it; "
                              "change server.listen or server.unix_socket, or stop the other process")
        return 1
    daemon.start()
    gc.freeze()  # the objects made at start live as long as the process: keep them out of every collection
    daemon.notifier.ready(f"polling {cfg.imds.endpoint} as {daemon.vm_name or '(name unknown)'}")
    try:
        daemon.run()
    finally:
        daemon.shutdown()
    return 0


class Would(TypedDict):
    """What `maintd run --once` would do for one transition."""

    transition: TransitionKind
    event_id: str
    event_type: str
    names_self: bool
    outcome: VanishOutcome | None
    phase: Phase | None
    handlers: list[str]


def run_once(daemon: Any) -> int:
    """Poll once, print what maintd sees and would do, change nothing on disk, exit."""
    from agent.errors import ImdsError
    from agent.model.tracker import phase_for

    daemon.store.load()
    if daemon.vm_name is None:
        daemon.resolve_identity(attempts=3)
    if daemon.vm_name is None:
        print("maintd: cannot learn this VM's name from IMDS; set identity.name", file=sys.stderr)
        return 1
    try:
        doc, transitions = daemon.dry_poll()
    except ImdsError as exc:
        print(f"maintd: poll failed: {exc} {exc.body[:200]}", file=sys.stderr)
        return 1

    def would(tr: Transition) -> Would:
        phase = phase_for(tr)
        handlers = [h.spec.name for h in daemon.runner.selected(phase, tr.event, tr.names_self)] if phase else []
        return {"transition": tr.kind, "event_id": tr.event.event_id, "event_type": tr.event.event_type,
                "names_self": tr.names_self, "outcome": tr.outcome, "phase": phase, "handlers": handlers}

    out = {
        "vm_name": daemon.vm_name,
        "document_incarnation": doc.incarnation,
        "events": [{**e.to_json(), "names_self": e.names(daemon.vm_name)} for e in doc.events],
        "skipped": [dataclasses.asdict(s) for s in doc.skipped],
        "would": [would(t) for t in transitions],
        "dry_run": daemon.config.dry_run,
    }
    print(json.dumps(out, indent=2, default=str))
    return 0


def cmd_check_config(args: argparse.Namespace) -> int:
    from agent.errors import StateError
    from agent.state.state_file import check_dir

    try:
        cfg, warnings = config_mod.load_checked(args.path)
        check_dir(config_mod.with_state_env(cfg).state.dir)
    except (ConfigError, StateError) as exc:
        print(f"{exc}", file=sys.stderr)
        return 1
    for warning in warnings:  # accepted all the same (exit 0): a choice to make knowingly
        print(warning, file=sys.stderr)
    print(f"{args.path}: OK ({_summary(cfg)})")
    print(_addressing(cfg.coordination) if cfg.coordination.backend == "peers" else _store(cfg.coordination))
    return 0


def _addressing(c: CoordinationConfig) -> str:
    """How peers will be addressed: the static map, the peers file as it reads now, the template."""
    lines = ["peers are reached through (first match wins):",
             f"  coordination.peers       {len(c.peers)} static entr{'y' if len(c.peers) == 1 else 'ies'}"]
    if c.peers_file:
        peers_file = PeersFile(c.peers_file)
        found, _ = peers_file.current()
        lines.append(f"  coordination.peers_file  {c.peers_file}: "
                     + (f"PROBLEM {peers_file.problem}" if peers_file.problem else f"{len(found)} entries"))
    lines.append(f"  coordination.peer_url    {c.peer_url} ({{computer_name}} is derived on a Uniform scale set)")
    return "\n".join(lines)


def _store(c: CoordinationConfig) -> str:
    """Where the store backend keeps its records, and how this VM authenticates."""
    store = c.azure_blob
    assert store is not None
    how = (f"connection string in {store.connection_string_file}" if store.connection_string_file else
           f"managed identity{' ' + store.client_id if store.client_id else ' (system-assigned)'}, token from IMDS")
    line = f"coordination through Azure Blob Storage: {store.describe}; {how}"
    return line + "".join(f"\n{x}" for x in _budget(c))


def _budget(c: CoordinationConfig) -> list[str]:
    """Where the budget's wake hints go, and a warning where `advertise` would once have been relied on."""
    b = c.budget
    if b is None:
        return []
    lines = [f"budget wake hints: {'to ' + b.wake_url if b.wake_url else 'none'} (an accelerator: the members next "
             "in line read the record every second)"]
    if b.advertise not in ("auto", "none") and b.wake_url is None:
        lines.append(f"warning: coordination.budget.advertise ({b.advertise}) is shown in the fleet view only: no "
                     "hint is sent to an address read from the record; set coordination.budget.wake_url (a template "
                     "such as http://{name}:8088) for hints")
    return lines


def _summary(cfg: config_mod.Config) -> str:
    parts = [f"poll every {cfg.imds.poll_interval:g}s", f"identity {cfg.identity.name}"]
    handlers = getattr(cfg, "handlers", ())
    parts.append(f"{len(handlers)} handler{'s' if len(handlers) != 1 else ''}")
    return ", ".join(parts)


def cmd_client(args: argparse.Namespace) -> int:
    """status, events, fleet, drain, undrain, approve, health: imported only for these, `maintd run` never
    loads them."""
    from agent.cli.cliclient import COMMANDS

    return COMMANDS[args.command](args)


def cmd_watch(args: argparse.Namespace) -> int:
    """`maintd watch`: the live view, redrawn every second until Ctrl-C."""
    from agent.cli.cliclient import watch_answers
    from agent.cli.cliwatch import run

    return run(lambda: watch_answers(args))


def cmd_emulate(args: argparse.Namespace) -> int:
    from agent.emulator.cli import main as emulate_main

    return emulate_main(args.rest)


def cmd_demo(args: argparse.Namespace) -> int:
    from agent.cli.demo import main as demo_main

    return demo_main(args.rest)


# --- parser ---------------------------------------------------------------------------------

def _since(value: str) -> datetime:
    """`--since`: a span back from now or an ISO time (argparse says what is wrong with anything else)."""
    from agent.model.timefmt import since_instant

    try:
        return since_instant(value, datetime.now(UTC))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parser() -> argparse.ArgumentParser:
    """The argument parser (also the source of `maintd --help`)."""
    p = argparse.ArgumentParser(prog="maintd", description="Azure Scheduled Events agent.")
    p.add_argument("--version", action="version", version=f"maintd {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def client(name: str, help_: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help_)
        sp.add_argument("--config", help=f"config file (default $MAINTD_CONFIG or {config_mod.DEFAULT_PATH})")
        sp.add_argument("--url", help="ask the daemon over TCP at this base URL with $MAINTD_TOKEN or a readable "
                                      "server.token_file (default: server.unix_socket, else server.listen)")
        sp.set_defaults(fn=cmd_client)
        return sp

    run = sub.add_parser("run", help="run the daemon")
    run.add_argument("--config", help=f"config file (default $MAINTD_CONFIG or {config_mod.DEFAULT_PATH})")
    run.add_argument("--once", action="store_true", help="poll once, print what maintd sees and would do, exit")
    run.add_argument("--dry-run", action="store_true", help="send no approval; run only hooks that opt in")
    run.set_defaults(fn=cmd_run)

    check = sub.add_parser("check-config", help="validate a config file (exit 0 valid, 1 refused)")
    check.add_argument("path")
    check.set_defaults(fn=cmd_check_config)

    st = client("status", "the daemon's state")
    st.add_argument("--json", action="store_true")

    ev = client("events", "events the daemon tracks (or --history from the audit journal)")
    ev.add_argument("event_id", nargs="?")
    ev.add_argument("--json", action="store_true")
    ev.add_argument("--history", action="store_true", help="read the audit journal instead of asking the daemon")
    ev.add_argument("--since", type=_since, metavar="WHEN",
                    help="with --history: entries from WHEN on: a span back from now (7d, 2h, 30m) or an ISO time")
    ev.add_argument("--type", metavar="EVENT_TYPE",
                    help="with --history: only events of this type (Reboot, Freeze, ...)")
    ev.add_argument("--event", metavar="EVENT_ID", help="only this event (the same as EVENT_ID)")

    dr = client("drain", "take this VM out of the load balancer's rotation")
    dr.add_argument("--reason", default="manual drain")
    client("undrain", "lift the manual drain")

    ap = client("approve", "approve a Scheduled event (profiles with approval: manual)")
    ap.add_argument("event_id")

    fl = client("fleet", "each pending event naming this VM: every VM it names, its state, who approved "
                         "(or --history: the group's past events, from the store)")
    fl.add_argument("--json", action="store_true")
    fl.add_argument("--history", action="store_true",
                    help="the group's past events from the store (backend azure_blob): per VM its time out of "
                         "rotation and whether it was prepared before the start, one summary line per event")
    fl.add_argument("--since", type=_since, metavar="WHEN",
                    help="with --history: events that ended from WHEN on: a span back from now (7d, the default; 2h) "
                         "or an ISO time")

    he = client("health", "aggregated health and every report")
    he.add_argument("--json", action="store_true")

    client("watch", "a live view: rotation, each event, its handlers, the approval, the peers or the store "
                    "(every second until Ctrl-C)").set_defaults(fn=cmd_watch)

    em = sub.add_parser("emulate", help="run the IMDS Scheduled Events emulator (see maintd emulate --help)",
                        add_help=False)
    em.add_argument("rest", nargs=argparse.REMAINDER)
    em.set_defaults(fn=cmd_emulate)
    de = sub.add_parser("demo", help="emulator + agent on loopback: a Reboot handled end to end", add_help=False)
    de.add_argument("rest", nargs=argparse.REMAINDER)
    de.set_defaults(fn=cmd_demo)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `maintd` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("emulate", "demo"):  # their own parsers take every option after the command
        return int(parser().parse_args(argv[:1]).fn(argparse.Namespace(rest=argv[1:])) or 0)
    args = parser().parse_args(argv)
    return int(args.fn(args) or 0)
