"""Small value parsers and the dataclass-driven section parser the config is built from.

A config section is a frozen dataclass whose fields carry ``metadata={"parse": fn, "doc": "..."}``.
`parse_section(cls, value)` checks the mapping (unknown keys with a did-you-mean, required keys,
each value through its parser) and builds the dataclass. Every parser raises `ConfigValueError`
with a key relative to the value it was given, so the loader can point at file:line:col.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from agent.errors import ConfigValueError

Parser = Callable[[Any], Any]
T = TypeVar("T")


class Named(Protocol):
    """A thing listed by name in the config (a handler, a profile, a rule)."""

    @property
    def name(self) -> str: ...


N = TypeVar("N", bound=Named)

REQUIRED: Any = dataclasses.MISSING

_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)\s*$")
_ISO_RE = re.compile(
    r"^P(?:(?P<d>\d+(?:\.\d+)?)D)?(?:T(?:(?P<h>\d+(?:\.\d+)?)H)?(?:(?P<m>\d+(?:\.\d+)?)M)?(?:(?P<s>\d+(?:\.\d+)?)S)?)?$"
)


def opt(parse: Parser, default: Any = REQUIRED, doc: str = "") -> Any:
    """A dataclass field for a config key: its parser, default and one-line documentation."""
    if isinstance(default, (list, dict)):
        value = default
        return dataclasses.field(default_factory=lambda: type(value)(value), metadata={"parse": parse, "doc": doc})
    return dataclasses.field(default=default, metadata={"parse": parse, "doc": doc})


def _type_name(value: Any) -> str:
    if value is None:
        return "nothing (null)"
    return {bool: "a boolean", int: "a number", float: "a number", str: "text", list: "a list", dict: "a mapping"}.get(
        type(value), type(value).__name__
    )


def parse_duration_text(value: Any) -> float:
    """Seconds from `500ms`, `1s`, `5m`, `2h`, `1d`, ISO 8601 `PT1M`, or a plain number of seconds."""
    if isinstance(value, bool):
        raise ValueError("not a duration")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str):
        match = _DURATION_RE.match(value)
        iso = _ISO_RE.match(value.strip().upper()) if not match else None
        if match:
            seconds = float(match.group(1)) * _DURATION_UNITS[match.group(2)]
        elif iso and any(iso.groupdict().values()):
            parts = {k: float(v) if v else 0.0 for k, v in iso.groupdict().items()}
            seconds = parts["d"] * 86400 + parts["h"] * 3600 + parts["m"] * 60 + parts["s"]
        else:
            try:
                seconds = float(value)
            except ValueError:
                raise ValueError("not a duration") from None
    else:
        raise ValueError("not a duration")
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError("not a duration")
    return seconds


def duration(min_s: float = 0.0, max_s: float | None = None) -> Parser:
    """Parser for a duration in seconds, bounded."""

    def parse(value: Any) -> float:
        try:
            seconds = parse_duration_text(value)
        except ValueError:
            raise ConfigValueError(
                "", f"{value!r} is not a duration; write e.g. 500ms, 1s, 5m, 2h, PT1M or a number of seconds"
            ) from None
        if seconds < min_s:
            raise ConfigValueError("", f"{value!r} is too short; the minimum is {fmt_duration(min_s)}")
        if max_s is not None and seconds > max_s:
            raise ConfigValueError("", f"{value!r} is too long; the maximum is {fmt_duration(max_s)}")
        return seconds

    return parse


def fmt_duration(seconds: float) -> str:
    if seconds < 1:
        return f"{seconds * 1000:g}ms"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds / size:g}{unit}"
    return f"{seconds:g}s"


def integer(min_v: int | None = None, max_v: int | None = None) -> Parser:
    """Parser for a whole number within bounds."""

    def parse(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigValueError("", f"expected a whole number, got {_type_name(value)} {value!r}")
        if min_v is not None and value < min_v:
            raise ConfigValueError("", f"{value} is below the minimum {min_v}")
        if max_v is not None and value > max_v:
            raise ConfigValueError("", f"{value} is above the maximum {max_v}")
        return value

    return parse


def number(min_v: float | None = None, max_v: float | None = None) -> Parser:
    """Parser for a number within bounds."""

    def parse(value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigValueError("", f"expected a number, got {_type_name(value)} {value!r}")
        if min_v is not None and value < min_v:
            raise ConfigValueError("", f"{value} is below the minimum {min_v}")
        if max_v is not None and value > max_v:
            raise ConfigValueError("", f"{value} is above the maximum {max_v}")
        return float(value)

    return parse


def text(pattern: str | None = None, hint: str = "", allow_empty: bool = False) -> Parser:
    """Parser for a string, optionally matching a regular expression."""
    regex = re.compile(pattern) if pattern else None

    def parse(value: Any) -> str:
        if not isinstance(value, str):
            want = f"text ({hint})" if hint else "text"
            raise ConfigValueError("", f"expected {want}, got {_type_name(value)} {value!r} (quote it)")
        if not value and not allow_empty:
            raise ConfigValueError("", "must not be empty")
        if regex and not regex.match(value):
            raise ConfigValueError("", f"{value!r} is not valid{': ' + hint if hint else ''}")
        return value

    return parse


def optional(parse: Parser) -> Parser:
    """Parser that also accepts null."""

    def wrapped(value: Any) -> Any:
        return None if value is None else parse(value)

    return wrapped


def boolean(value: Any) -> bool:
    """Parser for true/false."""
    if not isinstance(value, bool):
        raise ConfigValueError("", f"expected true or false, got {_type_name(value)} {value!r}")
    return value


def choice(*allowed: str) -> Parser:
    """Parser for one of a fixed set of words (case-sensitive, as written in the docs)."""

    def parse(value: Any) -> str:
        if not isinstance(value, str) or value not in allowed:
            raise ConfigValueError("", f"{value!r} is not allowed; use one of: {', '.join(allowed)}"
                                   f"{did_you_mean(value, allowed)}")
        return value

    return parse


def list_of(parse_item: Parser, min_len: int = 0, unique: bool = False) -> Parser:
    """Parser for a list whose items go through `parse_item`."""

    def parse(value: Any) -> tuple[Any, ...]:
        if not isinstance(value, list):
            raise ConfigValueError("", f"expected a list, got {_type_name(value)} {value!r}")
        if len(value) < min_len:
            raise ConfigValueError("", f"needs at least {min_len} item{'s' if min_len > 1 else ''}")
        out = []
        for i, item in enumerate(value):
            try:
                parsed = parse_item(item)
            except ConfigValueError as exc:
                raise exc.under(f"[{i}]") from None
            if unique and parsed in out:
                raise ConfigValueError(f"[{i}]", f"{item!r} is listed twice")
            out.append(parsed)
        return tuple(out)

    return parse


def mapping_of(parse_value: Parser) -> Parser:
    """Parser for a mapping from text keys to parsed values."""

    def parse(value: Any) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise ConfigValueError("", f"expected a mapping, got {_type_name(value)} {value!r}")
        out = {}
        for key, item in value.items():
            try:
                out[str(key)] = parse_value(item)
            except ConfigValueError as exc:
                raise exc.under(str(key)) from None
        return out

    return parse


def did_you_mean(word: Any, candidates: Any) -> str:
    """` (did you mean 'x'?)` naming the candidate closest to text `word`, else "" (difflib loads only then)."""
    if not isinstance(word, str):
        return ""
    import difflib

    close = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def section(cls: type[T]) -> Callable[[Any], T]:
    """Parser for a mapping into the dataclass `cls` (see the module docstring)."""

    def parse(value: Any) -> T:
        return parse_section(cls, value)

    return parse


def parse_section(cls: type[T], value: Any) -> T:
    """Build the dataclass `cls` from a mapping, refusing unknown keys and checking each value."""
    if value is None:
        value = {}
    if not isinstance(value, dict):
        raise ConfigValueError("", f"expected a mapping, got {_type_name(value)} {value!r}")
    fields = {f.name: f for f in dataclasses.fields(cls) if "parse" in f.metadata}  # type: ignore[arg-type]
    for key in value:
        if key not in fields:
            known = ", ".join(sorted(fields))
            raise ConfigValueError(str(key), f"unknown key{did_you_mean(key, fields)}; known keys here: {known}")
    kwargs: dict[str, Any] = {}
    for name, f in fields.items():
        if name in value:
            try:
                kwargs[name] = f.metadata["parse"](value[name])
            except ConfigValueError as exc:
                raise exc.under(name) from None
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigValueError("", f"missing required key {name!r} ({f.metadata.get('doc', '')})")
    obj = cls(**kwargs)
    check = getattr(obj, "validate", None)
    if check is not None:
        check()
    return obj


def named_list(items: list[Any], parse_item: Callable[[Any], N], what: str) -> tuple[N, ...]:
    """Parse each item of a list of named things (handlers, profiles, rules); names must be unique."""
    out: list[N] = []
    for i, item in enumerate(items):
        try:
            obj = parse_item(item)
        except ConfigValueError as exc:
            raise exc.under(f"[{i}]") from None
        name = obj.name
        if any(o.name == name for o in out):
            raise ConfigValueError(f"[{i}].name", f"{what} name {name!r} is used twice; names must be unique")
        out.append(obj)
    return tuple(out)


def describe(cls: type, prefix: str = "") -> list[tuple[str, str, str]]:
    """(key, default, doc) for every key of a section and its nested sections: the README's reference."""
    rows: list[tuple[str, str, str]] = []
    for f in dataclasses.fields(cls):
        if "parse" not in f.metadata:
            continue
        key = f"{prefix}{f.name}"
        if f.default is not dataclasses.MISSING:
            default: Any = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            rows.append((key, "required", f.metadata.get("doc", "")))
            continue
        if dataclasses.is_dataclass(default):
            rows.extend(describe(type(default), key + "."))
            continue
        rows.append((key, _default_text(default, f.metadata["parse"]), f.metadata.get("doc", "")))
    return rows


def _default_text(value: Any, parse: Parser) -> str:
    """A default as an operator would write it in YAML (durations as 31s, lists as [a, b])."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and "duration" in getattr(parse, "__qualname__", ""):
        return fmt_duration(value)
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(str(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{}" if not value else str(value)
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)
