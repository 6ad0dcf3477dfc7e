"""The append-only audit journal (`journal.jsonl`): append lines without following a planted
symlink, rotate by size (`journal.jsonl.1` … `.N`), and read entries back across the rotated files,
skipping damaged lines. The store decides what goes in and when; this module only touches files.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterator

from agent import jsonsafe

JOURNAL_FILE = "journal.jsonl"
MAX_JOURNAL_LINE = 1024 * 1024
"""Longest journal line read back; a longer one (a damaged file) is skipped."""


def append(path: Path, lines: list[str], max_bytes: int, keep: int) -> None:
    """Append each line to the journal at `path`, rotating first when it would pass `max_bytes`; OSError as is."""
    for line in lines:
        data = (line + "\n").encode()
        path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        _rotate_if_needed(path, len(data), max_bytes, keep)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)


def _rotate_if_needed(path: Path, incoming: int, max_bytes: int, keep: int) -> None:
    try:
        size = os.lstat(path).st_size
    except FileNotFoundError:
        return
    if size + incoming <= max_bytes:
        return
    for i in range(keep - 1, 0, -1):
        older = path.with_name(f"{path.name}.{i}")
        if os.path.lexists(older):
            os.replace(older, path.with_name(f"{path.name}.{i + 1}"))
    os.replace(path, path.with_name(f"{path.name}.1"))


def read_journal(directory: str | os.PathLike[str], keep: int = 100) -> Iterator[dict[str, Any]]:
    """Audit journal entries, oldest first, across rotated files; damaged lines and unreadable files are skipped."""
    base = Path(directory) / JOURNAL_FILE
    for path in [base.with_name(f"{JOURNAL_FILE}.{i}") for i in range(keep, 0, -1)] + [base]:
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
            if isinstance(entry, dict):
                yield entry
    except OSError:
        return  # a directory in the journal's place, an I/O error: what was read stands
