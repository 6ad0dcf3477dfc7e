"""The state file on disk, apart from the store that owns its contents: refuse a state dir others
could write, read a file without following links, check a state object's shape, move an unusable
file aside, and replace the file atomically (`mkstemp`, fsync, rename, fsync of the directory).

`read_state` never raises for a bad file: what cannot be used is moved aside (`state.json.corrupt-*`)
and reported, so maintd starts fresh instead of dying at every restart. A file of a newer format than
`STATE_FORMAT` (written by a newer maintd, then downgraded) is moved aside the same way
(`state.json.format-N-*`), untouched, for that newer maintd to read again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NotRequired, TypedDict, cast

from agent.clock import Clock
from agent.errors import StateError
from agent.model.events import EventJson, parse_event
from agent.model.timefmt import parse_iso
from agent.model.tracker import TransitionKind, VanishOutcome
from agent.trust import jsonsafe
from agent.trust.pathtrust import first_problem

STATE_FILE = "state.json"
STATE_FORMAT = 1
"""The layout of state.json this maintd reads and writes (see `agent.state.state_store`). Bump it, and teach
`read_state` to convert the older layouts, when the layout changes. A file from before the `format`
field says `"version": 1` instead: that is format 1."""
MAX_STATE_BYTES = 64 * 1024 * 1024
"""Largest state file read back (a week of events with hook output tails is well under 10 MB)."""


class HistoryEntry(TypedDict):
    """One transition in an event's stored history (also in /v1/events/{id})."""

    kind: TransitionKind
    at: str
    status: str
    outcome: NotRequired[VanishOutcome]


class EventRecord(TypedDict):
    """One event in state.json, present or vanished (its layout: `agent.state.state_store`)."""

    event: EventJson
    names_self: bool
    first_seen: str
    history: list[HistoryEntry]
    boot_id: NotRequired[str]
    seen_started: NotRequired[bool]
    not_before: NotRequired[str]
    """The last NotBefore seen, kept once IMDS sends "" for a started event."""
    vanished_at: NotRequired[str | None]
    outcome: NotRequired[VanishOutcome | None]


class StateData(TypedDict):
    """The state object: `check_shape` makes sure a file read back has this shape."""

    format: int
    events: dict[str, EventRecord]
    results: dict[str, dict[str, dict[str, Any]]]
    """EventId -> key -> a handler's result, an approval record or a handler's note: each its writer's shape."""
    flags: dict[str, dict[str, Any]]
    """Name -> a JSON object (the drains)."""


@dataclass(frozen=True)
class LoadReport:
    """What `read_state` found: how many events, and the unusable file moved aside (if any)."""

    events: int
    moved_aside: str | None = None
    problem: str | None = None
    newer_format: bool = False
    journal_aside: tuple[str, ...] = ()
    """Journal files of a newer format, moved aside (see `agent.state.journal.set_aside_newer`)."""


def file_format(data: Any) -> int:
    """The format a state object says it is (`format`, or `version` before that field existed)."""
    value = data.get("format", data.get("version", 1)) if isinstance(data, dict) else None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"format is not a positive integer: {value!r}")
    return value


def check_dir(directory: str | os.PathLike[str], create: bool = False) -> None:
    """Refuse a state dir that anyone but root or maintd's user owns or could change, itself or through a directory
    above it (`agent.trust.pathtrust`): they could plant results, approvals or symlinks, or rename the state away.
    `create`: make a missing one first (mode 755, exclusively: one another user made in between is theirs)."""
    if create and not os.path.lexists(directory):
        # made in between: judged by its owner below; not makeable (read-only, no room): the first write says so
        with contextlib.suppress(OSError):
            Path(directory).mkdir(mode=0o755, parents=True)
    try:
        st = os.stat(directory)
    except FileNotFoundError:
        st = None  # created by the first write: the directories above it say who else could create it
    except OSError as exc:
        raise StateError(f"state dir {directory}: {exc}") from None
    if st is not None and not stat.S_ISDIR(st.st_mode):
        raise StateError(f"state dir {directory} is not a directory; fix state.dir")
    problem = first_problem(directory)
    if problem:
        raise StateError(f"state dir {directory} refused: {problem} (another user could forge or move maintd's "
                         "state)")


def read_file(path: Path, limit: int) -> bytes:
    """The bytes of a regular file at `path` (not a symlink, FIFO or directory); OSError otherwise."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        if st.st_size > limit:
            raise OSError(errno.EFBIG, f"{st.st_size} bytes, more than the {limit} read")
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def check_shape(data: Any) -> None:
    """Raise ValueError unless `data` is a state object every reader of the store can use as it is."""
    if not isinstance(data, dict) or not isinstance(data.get("events"), dict):
        raise ValueError("not a maintd state object")
    for eid, rec in data["events"].items():
        where = f"events.{eid}"
        _need(isinstance(rec, dict), where, "is not an object")
        parse_event(rec.get("event"))
        _need(isinstance(rec.get("names_self"), bool), where, "names_self is not true/false")
        _need(isinstance(rec.get("first_seen"), str), where, "first_seen is not a time")
        parse_iso(rec["first_seen"])
        _need(isinstance(rec.get("boot_id", ""), str) and isinstance(rec.get("seen_started", False), bool),
              where, "boot_id or seen_started has the wrong type")
        _need(isinstance(rec.get("history", []), list) and all(isinstance(h, dict) for h in rec.get("history", [])),
              where, "history is not a list of objects")
        if rec.get("vanished_at") is not None:
            _need(isinstance(rec["vanished_at"], str), where, "vanished_at is not a time")
            parse_iso(rec["vanished_at"])
        _need(rec.get("outcome") is None or isinstance(rec["outcome"], str), where, "outcome is not text")
    for part in ("results", "flags"):
        _need(isinstance(data.get(part, {}), dict), part, "is not an object")
    for eid, results in data.get("results", {}).items():
        _need(isinstance(results, dict) and all(isinstance(v, dict) for v in results.values()),
              f"results.{eid}", "is not an object of objects")
    _need(all(isinstance(v, dict) for v in data.get("flags", {}).values()),
          "flags", "holds a value that is not an object")


def _need(ok: bool, where: str, problem: str) -> None:
    if not ok:
        raise ValueError(f"{where}: {problem}")


def read_state(path: Path, clock: Clock) -> tuple[StateData | None, LoadReport]:
    """The state object at `path` (None when there is none or it was unusable and moved aside)."""
    for leftover in path.parent.glob(f".{path.name}.*"):  # temp files of a write cut short by a crash
        try:
            leftover.unlink()
        except OSError:
            pass
    try:
        data = jsonsafe.loads(read_file(path, MAX_STATE_BYTES), max_bytes=MAX_STATE_BYTES)
        if (found := file_format(data)) > STATE_FORMAT:
            report = _set_aside(path, clock, f"{path} is format {found}, newer than the {STATE_FORMAT} this maintd "
                                             "reads (written by a newer maintd)", f"format-{found}")
            return None, dataclasses.replace(report, newer_format=True)
        check_shape(data)
    except FileNotFoundError:
        return None, LoadReport(0)
    except OSError as exc:
        why = "it is a symbolic link, which maintd does not follow" if exc.errno == errno.ELOOP else exc.strerror
        return None, _set_aside(path, clock, f"cannot read {path}: {why or exc}")
    except (ValueError, KeyError, TypeError) as exc:
        return None, _set_aside(path, clock, f"corrupt state file: {exc}")
    data.setdefault("results", {})
    data.setdefault("flags", {})
    data.pop("version", None)  # format 1 as written before the `format` field
    data["format"] = STATE_FORMAT
    return cast(StateData, data), LoadReport(len(data["events"]))


def set_aside(path: Path, clock: Clock, label: str) -> str:
    """Rename `path` to `<path>.<label>-<UTC stamp>` (a free name) and return it; OSError as is."""
    stamp = clock.now().strftime("%Y%m%dT%H%M%SZ")
    for n in range(100):
        aside = path.with_name(f"{path.name}.{label}-{stamp}" + (f"-{n}" if n else ""))
        if not os.path.lexists(aside):
            break
    os.rename(path, aside)
    return str(aside)


def _set_aside(path: Path, clock: Clock, problem: str, label: str = "corrupt") -> LoadReport:
    try:
        aside = set_aside(path, clock, label)
    except OSError as exc:
        return LoadReport(0, problem=f"{problem}; cannot move it aside: {exc.strerror or exc}")
    return LoadReport(0, moved_aside=aside, problem=problem)


def replace_file(path: Path, payload: bytes) -> None:
    """Write `payload` as `path` atomically and durably; a planted symlink is never followed (O_EXCL temp)."""
    directory = path.parent
    directory.mkdir(mode=0o755, parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=directory)
    try:
        try:
            view = memoryview(payload)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
