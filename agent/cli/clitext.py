"""How the CLI writes values for people: `-` for none, yes/no, instants in UTC with `Z`, durations as
`1m30s`, aligned sections and tables, lines cut (never wrapped) to a terminal's width.

Pure: no I/O, time is a parameter. `--json` never comes here: it prints the daemon's answer as it is.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from agent.model.timefmt import parse_iso

NONE = "-"
"""What every empty value (None, "", [], {}) reads as."""
_FRACTION = re.compile(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)\.\d+(Z|[+-]00:00)")
_ISO = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d(:\d\d(\.\d+)?)?(Z|[+-]\d\d:\d\d)")


def duration(seconds: float | None) -> str:
    """`0.4s`, `45s`, `1m30s`, `2h5m`, `3d4h` (the two largest units); `-` for None."""
    if seconds is None:
        return NONE
    sign, s = ("-", -seconds) if seconds < 0 else ("", seconds)
    if s < 10:
        return sign + f"{s:.1f}".rstrip("0").rstrip(".") + "s"
    whole = int(round(s))
    parts = [(whole // 86400, "d"), (whole % 86400 // 3600, "h"), (whole % 3600 // 60, "m"), (whole % 60, "s")]
    first = next(i for i, (n, _) in enumerate(parts) if n)
    return sign + "".join(f"{n}{unit}" for n, unit in parts[first:first + 2] if n)


def instant(value: Any) -> datetime | None:
    """The instant an ISO 8601 text names (any offset), or None."""
    if isinstance(value, datetime):
        return value if value.tzinfo else value.replace(tzinfo=UTC)
    if not isinstance(value, str) or not _ISO.fullmatch(value.strip()):
        return None
    try:
        return parse_iso(value.strip())
    except ValueError:
        return None


def when(value: Any) -> str:
    """An instant as `2026-11-27T00:17:38Z` (UTC, whole seconds); `-` for none; other text as it is."""
    t = instant(value)
    if t is None:
        return text(value)
    return t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def relative(value: Any, now: datetime) -> str:
    """`in 9m12s` or `3s ago` from `now`; `-` when `value` is no instant."""
    t = instant(value)
    if t is None:
        return NONE
    seconds = (t - now).total_seconds()
    return f"in {duration(seconds)}" if seconds >= 0 else f"{duration(-seconds)} ago"


def yes_no(value: Any) -> str:
    """yes / no; `-` when unknown."""
    return NONE if value is None else ("yes" if value else "no")


def tidy(s: str) -> str:
    """A daemon's text with its instants cut to whole seconds (`...T00:17:14.271663Z` → `...T00:17:14Z`)."""
    return _FRACTION.sub(lambda m: m.group(1) + "Z", s)


def text(value: Any) -> str:
    """Any JSON value as people read it: `-` for none, yes/no, instants cut to seconds, lists joined with
    commas, objects as `key=value` pairs (nested keys dotted)."""
    if value is None or value == "" or value == [] or value == {}:
        return NONE
    if isinstance(value, bool):
        return yes_no(value)
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, str):
        return when(value) if _ISO.fullmatch(value) else tidy(value)
    if isinstance(value, Mapping):
        return ", ".join(f"{k}={v}" for k, v in pairs(value))
    if isinstance(value, (list, tuple)):
        return ", ".join(text(v) for v in value)
    return str(value)


def pairs(value: Mapping[str, Any], prefix: str = "") -> list[tuple[str, str]]:
    """`(key, text)` for each non-empty field; nested objects flattened as `outer.inner`."""
    out: list[tuple[str, str]] = []
    for key, v in value.items():
        name = f"{prefix}{key}"
        if isinstance(v, Mapping) and v:
            out += pairs(v, name + ".")
        elif key.endswith("_seconds") and isinstance(v, (int, float)) and not isinstance(v, bool):
            out.append((name, duration(v)))
        elif text(v) != NONE:
            out.append((name, text(v)))
    return out


def label(key: str) -> str:
    """A JSON key as a label: `events_naming_this_vm` → `events naming this vm`."""
    return key.replace("_", " ")


Row = tuple[str, Any]
"""A section's row: its label and its value (a text, or several lines as a list of texts)."""


def section(title: str, rows: Iterable[Row], indent: str = "  ", width: int = 0) -> list[str]:
    """The title, then each row as `label  value` with the values aligned (at `width` at least, so that several
    sections line up); a list value takes one line each."""
    rows = list(rows)
    width = max([width] + [len(name) for name, _ in rows])
    lines = [title]
    for name, value in rows:
        values = [text(v) for v in value] if isinstance(value, list) else [str(value)]
        for i, v in enumerate(values or [NONE]):
            lines.append(f"{indent}{(name if i == 0 else ''):{width}}  {v}".rstrip())
    return lines


def table(header: Sequence[str], rows: Iterable[Sequence[str]], indent: str = "") -> list[str]:
    """Columns aligned to their widest cell; trailing blanks trimmed."""
    body = [list(header)] + [list(r) for r in rows]
    widths = [max(len(r[i]) for r in body) for i in range(len(header))]
    return [(indent + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True))).rstrip() for r in body]


def fit(line: str, width: int) -> str:
    """`line` cut to `width` columns, a `~` marking the cut (never wrapped)."""
    return line if len(line) <= width else line[:max(0, width - 1)] + "~"
