"""`maintd watch`: a live view of this VM (rotation, each event, its handlers, the approval, the peers or the store),
redrawn every second until Ctrl-C. EventIds are cut to 8 characters to fit 80 columns.

Standard library only: ANSI escapes on the terminal's alternate screen, each line cut to the terminal's width
(never wrapped) and the view to its height; the terminal is given back as it was on Ctrl-C, SIGTERM or an error.
When stdout is not a terminal it prints the view once and exits.
"""

from __future__ import annotations

import shutil
import signal
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, TextIO

from agent.cli.clitext import NONE, duration, fit, instant, relative, text, when, yes_no
from agent.model.events import STARTED
from agent.model.outcomes import PHASE_SCHEDULED

ENTER = "\x1b[?1049h\x1b[?25l"
"""The alternate screen, cursor hidden."""
LEAVE = "\x1b[?25h\x1b[?1049l"
"""Cursor shown, the screen as it was before."""
INTERVAL = 1.0


def screen(status: Mapping[str, Any], events: Sequence[Mapping[str, Any]], fleet: Mapping[str, Any],
           now: datetime, problem: str | None = None) -> list[str]:
    """The view, line by line (not yet cut to a width): the daemon, then every event it tracks."""
    imds = status.get("imds") or {}
    coordination = status.get("coordination") or {}
    ago = imds.get("last_success_seconds_ago")
    drains = [short(key) for key in status.get("drains") or {}]
    rotation = "in rotation" if status.get("in_rotation") else \
        f"OUT of rotation: {', '.join(drains) if drains else text(status.get('rotation_reason'))}"
    lines = [f"maintd {text(status.get('version'))} on {text(status.get('vm_name'))}  {when(now)}  "
             "(every 1s; Ctrl-C quits)",
             f"rotation  {rotation}",
             f"health    {text(status.get('health'))}   dry run {yes_no(status.get('dry_run'))}   "
             f"profile {text(status.get('profile'))} ({text(status.get('profile_approval'))})",
             f"imds      last answer {duration(ago) + ' ago' if ago is not None else NONE}, "
             f"{text(imds.get('consecutive_failures'))} failures in a row",
             f"coord     {_coordination(coordination)}"]
    if problem:
        lines.append(f"PROBLEM   {problem}")
    fleet_by_id = {f.get("event_id"): f for f in fleet.get("events") or [] if isinstance(f, Mapping)}
    lines.append("")
    if not events:
        lines.append("no events: IMDS schedules no maintenance for this VM or any other")
    for e in events:
        lines += _event(e, fleet_by_id.get(e.get("EventId")), now)
    return lines


def short(name: str) -> str:
    """An EventId (or a drain named after one, `event:<id>`) cut to its first 8 characters, as the view shows it
    (`maintd events` shows the whole of it)."""
    kind, _, rest = name.rpartition(":")
    return f"{kind}:{rest[:8]}" if kind else name[:8]


def _coordination(c: Mapping[str, Any]) -> str:
    """One line of what the backend publishes: a store and its last answer, the peers' sources, or its name."""
    if "store" in c:
        ago = c.get("store_last_answer_seconds_ago")
        return f"store, last answer {text(c.get('store_last_answer'))}" + (f" {duration(ago)} ago" if ago else "")
    if "peer_url" not in c:
        return text(c.get("backend"))
    return f"peers (template {text(c.get('peer_url'))}, {text(c.get('peers_static'))} static" + \
        (f", file {c['peers_file']}" if c.get("peers_file") else "") + ")"


def _event(e: Mapping[str, Any], fleet: Mapping[str, Any] | None, now: datetime) -> list[str]:
    """An event: its head, then (when it names this VM) this VM's part, the handlers, the approval, the peers."""
    not_before = e.get("NotBefore")
    head = f"{text(e.get('EventType'))} {short(text(e.get('EventId')))}  {text(e.get('EventStatus'))}" + \
        (f"  not before {when(not_before)} ({relative(not_before, now)})" if instant(not_before) else "")
    if not e.get("names_self"):
        return [head, f"  names {text(e.get('Resources'))}, not this VM"]
    why = e.get("not_ready") or []
    ready = "maintenance under way" if e.get("EventStatus") == STARTED else f"ready {yes_no(e.get('ready'))}" \
        + (f": {text(why[0])}" + (f" (+{len(why) - 1} more)" if len(why) > 1 else "") if why else "")
    lines = [head, f"  this VM   rank {text(e.get('rank'))}, {ready}"]
    runs = []
    for key, r in (e.get("results") or {}).items():
        if key.startswith("handler:") and isinstance(r, Mapping):
            name, _, phase = key[len("handler:"):].rpartition(":")
            took = r.get("duration_seconds")
            started = instant(r.get("started_at"))
            spent = duration(took) if isinstance(took, (int, float)) else \
                duration((now - started).total_seconds()) if started else ""
            label = name if phase == PHASE_SCHEDULED else f"{name}/{phase}"
            runs.append(f"{label} {text(r.get('outcome'))} {spent}".strip())
    lines.append(f"  handlers  {' | '.join(runs) if runs else 'none run yet'}")
    lines.append(f"  approval  {_approval(e)}")
    vms = [v for v in (fleet or {}).get("vms") or [] if isinstance(v, Mapping)]
    others = [f"{text(v.get('name'))} {text(v.get('state'))}" for v in vms
              if str(v.get("name", "")).casefold() != str(e.get("vm_name", "")).casefold()]
    if fleet and fleet.get("store_error"):
        others.append(f"store: {text(fleet['store_error'])}")
    lines.append(f"  {'peers' if (fleet or {}).get('source') != 'store' else 'store'}     "
                 + (" | ".join(others) if others else "none: the event names only this VM"))
    return lines


def _approval(e: Mapping[str, Any]) -> str:
    a, held = e.get("approval"), e.get("approval_held")
    if isinstance(a, Mapping) and a:
        return f"{text(a.get('status'))} by {text(a.get('by'))} at {when(a.get('at'))}"
    if isinstance(held, Mapping) and held:
        return f"held by the {text(held.get('gate'))} gate: {text(held.get('reason'))}"
    return f"not sent: {text(e.get('approval_decision'))}"


# --- the terminal ---------------------------------------------------------------------------------

def _frame(lines: list[str], width: int, height: int) -> list[str]:
    """The lines cut to the terminal: `width - 1` columns (the last one would wrap on some terminals), `height`
    rows, the last saying how many were left out."""
    if len(lines) > height:
        lines = lines[:height - 1] + [f"... {len(lines) - height + 1} more lines (a taller terminal shows them)"]
    return [fit(line, max(1, width - 1)) for line in lines]


def run(fetch: Callable[[], tuple[Any, Any, Any]], out: TextIO = sys.stdout,
        sleep: Callable[[float], None] = time.sleep) -> int:
    """Redraw every second until Ctrl-C (or SIGTERM); the first fetch failing ends the command (the daemon is not
    there, the config is refused), a later one is shown on the view while the last answers stay."""
    answers = fetch()
    if not out.isatty():
        out.write("\n".join(screen(*answers, datetime.now(UTC))) + "\n")
        return 0
    restore = _quiet_keyboard()
    previous = signal.signal(signal.SIGTERM, _stop)
    out.write(ENTER)
    try:
        due = time.monotonic()
        problem = None
        while True:
            size = shutil.get_terminal_size()
            lines = _frame(screen(*answers, datetime.now(UTC), problem), size.columns, size.lines)
            out.write("\x1b[H" + "".join(line + "\x1b[K\r\n" for line in lines[:-1]) + lines[-1] + "\x1b[K\x1b[J")
            out.flush()
            due += INTERVAL
            sleep(max(0.0, due - time.monotonic()))
            try:
                answers, problem = fetch(), None
            except SystemExit as exc:  # the daemon went away or refused: say so, keep the last view, try again
                problem = str(exc.code).removeprefix("maintd: ").splitlines()[0]
    except KeyboardInterrupt:
        return 0
    finally:
        out.write(LEAVE)
        out.flush()
        signal.signal(signal.SIGTERM, previous)
        restore()


def _stop(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _quiet_keyboard() -> Callable[[], None]:
    """Keys typed while watching are not echoed over the view (Ctrl-C still interrupts); returns the undo."""
    try:
        import termios

        fd = sys.stdin.fileno()
        saved = termios.tcgetattr(fd)
    except (ImportError, OSError, ValueError):
        return lambda: None
    quiet = termios.tcgetattr(fd)
    quiet[3] &= ~(termios.ECHO | termios.ICANON)
    termios.tcsetattr(fd, termios.TCSANOW, quiet)
    return lambda: termios.tcsetattr(fd, termios.TCSADRAIN, saved)
