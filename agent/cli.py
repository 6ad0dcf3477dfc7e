"""The `maintd` command: run the daemon, check a config, talk to a running daemon, emulate, demo."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import http.client
import json
import os
import socket
import sys
from typing import Any, Sequence

import requests

from agent import __version__
from agent import config as config_mod
from agent.errors import ConfigError
from agent.peersfile import PeersFile

DEFAULT_CONFIG = "/etc/maintd/maintd.yaml"
EX_CONFIG = 78
DEFAULT_STATE_DIR = "/var/lib/maintd"


def _config_path(args: argparse.Namespace) -> str:
    return args.config or os.environ.get("MAINTD_CONFIG") or DEFAULT_CONFIG


def with_state_env(cfg: config_mod.Config) -> config_mod.Config:
    """Use systemd's $STATE_DIRECTORY when state.dir is left at its default."""
    state_env = os.environ.get("STATE_DIRECTORY", "").split(":")[0]
    if state_env and cfg.state.dir == DEFAULT_STATE_DIR:
        cfg = dataclasses.replace(cfg, state=dataclasses.replace(cfg.state, dir=state_env))
    return cfg


def load_for_run(path: str, dry_run: bool = False) -> config_mod.Config:
    """The config for `run`: the file, with $STATE_DIRECTORY and --dry-run applied."""
    cfg = with_state_env(config_mod.load(path))
    if dry_run:
        cfg = dataclasses.replace(cfg, dry_run=True)
    return cfg


# --- run / check-config ---------------------------------------------------------------------

def cmd_run(args: argparse.Namespace) -> int:
    from agent import logs
    from agent.clock import SystemClock
    from agent.daemon import build
    from agent.errors import StateError
    from agent.statefile import check_dir
    from agent.systemd import listen_fds

    path = _config_path(args)
    try:
        cfg = load_for_run(path, args.dry_run)
    except ConfigError as exc:
        print(f"maintd: config refused: {exc}", file=sys.stderr)
        return EX_CONFIG
    try:
        check_dir(cfg.state.dir)
    except StateError as exc:
        print(f"maintd: {exc}", file=sys.stderr)
        return EX_CONFIG
    logs.configure(cfg.log.format, cfg.log.level)
    daemon = build(cfg, SystemClock(), config_path=path)
    if args.once:
        return run_once(daemon)
    daemon.install_signals()
    sockets = listen_fds()
    try:
        daemon.serve(sockets[0] if sockets else None)
    except OSError as exc:
        daemon.log.error("server.bind_failed", listen=cfg.server.listen, error=str(exc),
                         hint="another process holds the port; change server.listen or stop it")
        return 1
    daemon.start()
    gc.freeze()  # the objects made at start live as long as the process: keep them out of every collection
    daemon.notifier.ready(f"polling {cfg.imds.endpoint} as {daemon.vm_name or '(name unknown)'}")
    try:
        daemon.run()
    finally:
        daemon.shutdown()
    return 0


def run_once(daemon: Any) -> int:
    """Poll once, print what maintd sees and would do, change nothing on disk, exit."""
    from agent.errors import ImdsError
    from agent.policy import phase_for

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

    def would(tr: Any) -> dict[str, Any]:
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
    try:
        cfg = config_mod.load(args.path)
    except ConfigError as exc:
        print(f"{exc}", file=sys.stderr)
        return 1
    print(f"{args.path}: OK ({_summary(cfg)})")
    print(_addressing(cfg.coordination))
    return 0


def _addressing(c: config_mod.CoordinationConfig) -> str:
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


def _summary(cfg: config_mod.Config) -> str:
    parts = [f"poll every {cfg.imds.poll_interval:g}s", f"identity {cfg.identity.name}"]
    handlers = getattr(cfg, "handlers", ())
    parts.append(f"{len(handlers)} handler{'s' if len(handlers) != 1 else ''}")
    return ", ".join(parts)


# --- talking to a running daemon ------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Target:
    """Where and how the CLI reaches the daemon."""

    url: str
    unix_socket: str | None = None
    token: str | None = None


def _target(args: argparse.Namespace) -> _Target:
    """--url as given; else from the config: its unix socket when this user may use it, else loopback TCP.

    The token is $MAINTD_TOKEN, else the contents of server.token_file when this user can read it
    (root can), so `server.require_token_on_loopback` does not lock root's CLI out.
    """
    env_token = os.environ.get("MAINTD_TOKEN") or None
    if args.url:
        return _Target(args.url.rstrip("/"), token=env_token)
    try:
        server = config_mod.load(_config_path(args), check_perms=False).server
    except ConfigError:
        server = config_mod.ServerConfig(listen="127.0.0.1:8088")
    host, _, port = server.listen.rpartition(":")
    if host in ("0.0.0.0", "", "[::]", "::"):
        host = "127.0.0.1"
    unix = server.unix_socket if server.unix_socket and os.access(server.unix_socket, os.W_OK) else None
    token = env_token
    if token is None and server.token_file and not unix:
        try:
            token = open(server.token_file, encoding="utf-8").read().strip() or None
        except OSError:
            pass
    return _Target(f"http://{host}:{port}", unix, token)


class _UnixConnection(http.client.HTTPConnection):
    """http.client over a unix socket (the daemon's `server.unix_socket`)."""

    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.unix_path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.unix_path)


def _send(target: _Target, method: str, path: str, body: Any) -> tuple[int, str]:
    """(status, text) of one request to the daemon; raises OSError or RequestException when it is unreachable."""
    headers = {"Authorization": f"Bearer {target.token}"} if target.token else {}
    if target.unix_socket:
        conn = _UnixConnection(target.unix_socket, timeout=10)
        try:
            data = json.dumps(body).encode() if body is not None else None
            if data is not None:
                headers["Content-Type"] = "application/json"
            conn.request(method, path, body=data, headers=headers)
            answer = conn.getresponse()
            return answer.status, answer.read().decode("utf-8", "replace")
        finally:
            conn.close()
    session = requests.Session()
    session.trust_env = False
    response = session.request(method, target.url + path, json=body, headers=headers, timeout=10)
    return response.status_code, response.text


def _call(args: argparse.Namespace, method: str, path: str, body: Any = None) -> Any:
    """The daemon's JSON answer; a failure to reach it or a non-200 answer ends the command with status 1."""
    target = _target(args)
    try:
        status, text = _send(target, method, path, body)
    except (requests.RequestException, OSError) as exc:
        where = target.unix_socket or target.url + path
        raise SystemExit(f"maintd: cannot reach the daemon at {where} ({type(exc).__name__}); is it running? "
                         "(systemctl status maintd; or pass --url)") from None
    try:
        answer = json.loads(text)
    except ValueError:
        answer = text
    if status != 200:
        message = answer.get("error") if isinstance(answer, dict) else answer
        raise SystemExit(f"maintd: the daemon answered {status}: {message}")
    return answer


def _print_json(body: Any) -> int:
    print(json.dumps(body, indent=2))
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    body = _call(args, "GET", "/v1/status")
    if args.json:
        return _print_json(body)
    for key, value in body.items():
        if key == "peers" and isinstance(value, dict):
            for event_id, peers in value.items():
                print(f"peers of {event_id}")
                for name, how in (peers.items() if isinstance(peers, dict) else ()):
                    print(f"  {name:22} {how}")
            continue
        if isinstance(value, dict):
            value = ", ".join(f"{k}={v}" for k, v in value.items()) or "-"
        print(f"{key:24} {value}")
    return 0


def _approval_cell(event: dict[str, Any]) -> str:
    """sent/failed, `held: <gate>` while a gate holds it, else -."""
    held = event.get("approval_held")
    if held:
        return f"held: {held.get('gate')}"
    approval = event.get("approval")
    return str(approval.get("status", "-")) if isinstance(approval, dict) else "-"


def _plan_cells(event: dict[str, Any]) -> tuple[str, str]:
    """PREPARE and APPROVE FROM of the plan (timing): `<time> (<reason>)` while held, `started`, `-` without a plan."""
    plan = event.get("plan")
    if not isinstance(plan, dict):
        return "-", "-"
    def short(t: Any) -> str:
        return str(t)[:16] + "Z" if t else "-"
    prepare = "started" if plan.get("preparation") == "started" else \
        f"{short(plan.get('prepare_at'))} ({plan.get('prepare_reason')})"
    reason = plan.get("approve_reason")
    approve = f"{short(plan.get('approve_not_before'))} (window)" if reason == "window" else str(reason)
    return prepare, approve


def _events_table(events: list[dict[str, Any]]) -> str:
    rows = [("EVENT ID", "TYPE", "STATUS", "NOT BEFORE", "THIS VM", "RANK", "READY", "PREPARE", "APPROVE FROM",
             "APPROVAL", "RESOURCES")]
    for e in events:
        rows.append((e["EventId"], e["EventType"], e["EventStatus"], e.get("NotBefore") or "-",
                     "yes" if e.get("names_self") else "no", str(e.get("rank") if e.get("rank") is not None else "-"),
                     "yes" if e.get("ready") else "no", *_plan_cells(e), _approval_cell(e),
                     ",".join(e.get("Resources", []))[:40]))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    table = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    why = [f"{e['EventId']} not ready: {reason}" for e in events for reason in e.get("not_ready") or []]
    return "\n".join(table + ([""] + why if why else []))


def cmd_events(args: argparse.Namespace) -> int:
    if args.history:
        from agent.journal import read_journal

        try:
            directory = with_state_env(config_mod.load(_config_path(args), check_perms=False)).state.dir
        except ConfigError as exc:
            print(f"maintd: {exc}", file=sys.stderr)
            return 1
        entries = [e for e in read_journal(directory) if not args.event_id or e.get("event_id") == args.event_id]
        for entry in entries:
            print(json.dumps(entry) if args.json else
                  f"{entry.get('t', '?')}  {entry.get('kind', '?'):28} {entry.get('event_id', '')}  "
                  + " ".join(f"{k}={v}" for k, v in entry.items() if k not in ("t", "kind", "event_id")))
        return 0
    body = _call(args, "GET", f"/v1/events/{args.event_id}" if args.event_id else "/v1/events")
    if args.json or args.event_id:
        return _print_json(body)
    print(_events_table(body) if body else "no events")
    return 0


def cmd_drain(args: argparse.Namespace) -> int:
    body = _call(args, "POST", "/v1/drain", {"reason": args.reason})
    print(f"out of rotation: {args.reason}" + (" (was already drained)" if body.get("already") else ""))
    if body.get("note"):
        print(body["note"])
    return 0


def cmd_undrain(args: argparse.Namespace) -> int:
    body = _call(args, "POST", "/v1/undrain")
    remaining = body.get("remaining_drains") or {}
    print("manual drain lifted" if body.get("undrained") else "there was no manual drain")
    if remaining:
        print("still out of rotation for: " + ", ".join(remaining))
    return 0


def cmd_approve(args: argparse.Namespace) -> int:
    return _print_json(_call(args, "POST", f"/v1/events/{args.event_id}/approve"))


def cmd_health(args: argparse.Namespace) -> int:
    body = _call(args, "GET", "/v1/health")
    if args.json:
        return _print_json(body)
    print(f"aggregated: {body.get('AggregatedHealthState')}")
    for ev in body.get("HealthEvents", []):
        print(f"  {ev.get('HealthState', '?'):8} {ev.get('SourceId')}/{ev.get('Property')}: {ev.get('Description', '')}")
    return 0 if body.get("AggregatedHealthState") != "Error" else 2


def cmd_emulate(args: argparse.Namespace) -> int:
    from agent.emulator.cli import main as emulate_main

    return emulate_main(args.rest)


def cmd_demo(args: argparse.Namespace) -> int:
    from agent.demo import main as demo_main

    return demo_main(args.rest)


# --- parser ---------------------------------------------------------------------------------

def parser() -> argparse.ArgumentParser:
    """The argument parser (also the source of `maintd --help`)."""
    p = argparse.ArgumentParser(prog="maintd", description="Azure Scheduled Events agent.")
    p.add_argument("--version", action="version", version=f"maintd {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def client(name: str, help_: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help_)
        sp.add_argument("--config", help=f"config file (default $MAINTD_CONFIG or {DEFAULT_CONFIG})")
        sp.add_argument("--url", help="the daemon's base URL (default: from server.listen in the config)")
        return sp

    run = sub.add_parser("run", help="run the daemon")
    run.add_argument("--config", help=f"config file (default $MAINTD_CONFIG or {DEFAULT_CONFIG})")
    run.add_argument("--once", action="store_true", help="poll once, print what maintd sees and would do, exit")
    run.add_argument("--dry-run", action="store_true", help="send no approval; run only hooks that opt in")
    run.set_defaults(fn=cmd_run)

    check = sub.add_parser("check-config", help="validate a config file (exit 0 valid, 1 refused)")
    check.add_argument("path")
    check.set_defaults(fn=cmd_check_config)

    st = client("status", "the daemon's state")
    st.add_argument("--json", action="store_true")
    st.set_defaults(fn=cmd_status)

    ev = client("events", "events the daemon tracks (or --history from the audit journal)")
    ev.add_argument("event_id", nargs="?")
    ev.add_argument("--json", action="store_true")
    ev.add_argument("--history", action="store_true", help="read the audit journal instead of asking the daemon")
    ev.set_defaults(fn=cmd_events)

    dr = client("drain", "take this VM out of the load balancer's rotation")
    dr.add_argument("--reason", default="manual drain")
    dr.set_defaults(fn=cmd_drain)
    client("undrain", "lift the manual drain").set_defaults(fn=cmd_undrain)

    ap = client("approve", "approve a Scheduled event (profiles with approval: manual)")
    ap.add_argument("event_id")
    ap.set_defaults(fn=cmd_approve)

    he = client("health", "aggregated health and every report")
    he.add_argument("--json", action="store_true")
    he.set_defaults(fn=cmd_health)

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
