"""The append-only audit journal (`journal.jsonl`): append lines without following a planted
symlink, rotate by size (`journal.jsonl.1` … `.N`), and read entries back across the rotated files,
skipping damaged lines. The store decides what goes in and when; this module only touches files.

Each file starts with a header line, `{"kind": "journal.format", "format": N}` (a file without one was
written before the header existed: format 1). A file of a newer format than `JOURNAL_FORMAT` is
neither read nor appended to: `set_aside_newer` moves it aside at start (`journal.jsonl.format-N-*`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from agent.clock import Clock
from agent.state.state_file import set_aside
from agent.trust import jsonsafe

JOURNAL_FILE = "journal.jsonl"
JOURNAL_FORMAT = 1
"""The journal's line format; bump it when a reader of today's lines could misread the new ones."""
HEADER_KIND = "journal.format"
_HEADER = (json.dumps({"kind": HEADER_KIND, "format": JOURNAL_FORMAT}, separators=(",", ":")) + "\n").encode()
MAX_JOURNAL_LINE = 1024 * 1024
"""Longest journal line read back; a longer one (a damaged file) is skipped."""


def append(path: Path, lines: list[str], max_bytes: int, keep: int) -> None:
    """Append each line to the journal at `path`, rotating first when it would pass `max_bytes`; OSError as is."""
    for line in lines:
        data = (line + "\n").encode()
        path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        if _rotate_if_needed(path, len(data), max_bytes, keep) == 0:
            data = _HEADER + data
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)


def _rotate_if_needed(path: Path, incoming: int, max_bytes: int, keep: int) -> int:
    """Rotate when `incoming` bytes would take the file past `max_bytes`; the size of the file left (0: new)."""
    try:
        size = os.lstat(path).st_size
    except FileNotFoundError:
        return 0
    if size + incoming <= max_bytes:
        return size
    for i in range(keep - 1, 0, -1):
        older = path.with_name(f"{path.name}.{i}")
        if os.path.lexists(older):
            os.replace(older, path.with_name(f"{path.name}.{i + 1}"))
    os.replace(path, path.with_name(f"{path.name}.1"))
    return 0


def _files(directory: str | os.PathLike[str], keep: int) -> list[Path]:
    """The journal's files, oldest first (they need not exist)."""
    base = Path(directory) / JOURNAL_FILE
    return [base.with_name(f"{JOURNAL_FILE}.{i}") for i in range(keep, 0, -1)] + [base]


def _newer(entry: dict[str, Any]) -> int | None:
    """The format a header line names when it is not this maintd's (None for an entry or a header of ours)."""
    if entry.get("kind") != HEADER_KIND or entry.get("format") == JOURNAL_FORMAT:
        return None
    found = entry.get("format")
    return found if isinstance(found, int) and not isinstance(found, bool) else JOURNAL_FORMAT + 1


def set_aside_newer(directory: str | os.PathLike[str], clock: Clock, keep: int) -> tuple[str, ...]:
    """Move aside each journal file a newer maintd wrote (never appended to, never deleted by rotation)."""
    moved = []
    for path in _files(directory, keep):
        try:
            with open(path, "rb") as fh:
                head = jsonsafe.loads(fh.readline(MAX_JOURNAL_LINE + 1), max_bytes=MAX_JOURNAL_LINE)
            found = _newer(head) if isinstance(head, dict) else None
            if found is not None:
                moved.append(set_aside(path, clock, f"format-{found}"))
        except (OSError, ValueError):
            continue  # absent, unreadable or damaged: read_journal skips what it cannot use
    return tuple(moved)


def read_journal(directory: str | os.PathLike[str], keep: int = 100) -> Iterator[dict[str, Any]]:
    """Audit journal entries, oldest first, across rotated files; damaged lines, unreadable files and files of
    a newer format are skipped."""
    for path in _files(directory, keep):
        try:
            fh = open(path, "rb")
        except OSError:
            continue
        with fh:
            yield from _entries(fh)


def _entries(fh: Any) -> Iterator[dict[str, Any]]:
    """The JSON objects among a journal file's lines (a bad byte, a torn or deep line is skipped)."""
    try:
        for line in iter(lambda: fh.readline(MAX_JOURNAL_LINE + 1), b""):
            try:
                entry = jsonsafe.loads(line, max_bytes=MAX_JOURNAL_LINE)
            except ValueError:
                continue
            if not isinstance(entry, dict):
                continue
            if entry.get("kind") != HEADER_KIND:
                yield entry
            elif _newer(entry) is not None:
                return  # a newer maintd's file: not ours to read
    except OSError:
        return  # a directory in the journal's place, an I/O error: what was read stands
