"""Pure rules of the `alertmanager` handler: Alertmanager's matcher syntax, the placeholders, and when
a maintenance silence starts and ends. No I/O: `alertmanager.py` talks to Alertmanager.

Matchers are written as in Alertmanager (`amtool`, routes): `name="value"`, `name!="value"`,
`name=~"regex"`, `name!~"regex"` (the value may be left unquoted when it holds no quote), and become
the v2 API's `{name, value, isRegex, isEqual}`. `{vm}`, `{computer_name}`, `{event_id}` and
`{event_type}` expand in values and in the comment; in a regex value the expansion is escaped as Go's
`regexp.QuoteMeta` does, so `web-1.prod` matches itself and nothing else. Other braces (`[0-9]{1,3}`,
`\\p{Greek}`) stay as written. Alertmanager anchors a regex at both ends and refuses a silence whose
every matcher matches the empty string (it would silence everything): both are checked at config load.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Final, Literal, NotRequired, TypedDict, cast

from agent.errors import ConfigValueError
from agent.model.config_schema import did_you_mean, text

PLACEHOLDERS = ("vm", "computer_name", "event_id", "event_type")
EXPECTED_IMPACT = {"Freeze": 30.0, "Reboot": 900.0, "Redeploy": 1800.0, "Preempt": 600.0, "Terminate": 600.0}
"""Seconds of impact assumed when DurationInSeconds is -1 (unknown), by EventType."""
OTHER_IMPACT = 1800.0
"""The same for an EventType maintd does not know."""

_MATCHER = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*(.*?)\s*$", re.DOTALL)
_FIELD = re.compile(r"(\\[pP])?\{([A-Za-z_][A-Za-z0-9_]*)\}")
_QUOTE_META = re.compile(r"([\\.+*?()|\[\]{}^$])")
_NOT_RE2 = re.compile(r"\(\?[=!<]|\\[1-9]")
_ESCAPES = {"\\": "\\", '"': '"', "n": "\n"}
SAMPLE = {"vm": "vm-1", "computer_name": "vm000001", "event_id": "00000000-0000-0000-0000-000000000000",
          "event_type": "Reboot"}
"""Values that stand in for the placeholders when a config is checked."""


class MatcherJson(TypedDict):
    """A matcher as Alertmanager's v2 API writes it (placeholders filled in)."""

    name: str
    value: str
    isRegex: bool
    isEqual: bool


NoteState = Literal["keeping", "expiring", "done"]
"""A note's state: silences kept while the event lasts; to expire once back in rotation; nothing left."""
KEEPING: Final = "keeping"
EXPIRING: Final = "expiring"
DONE: Final = "done"


class NotedSilence(TypedDict):
    """One replica's silence in the handler's note (`id` None: none made yet, the replica failed)."""

    id: str | None
    starts_at: NotRequired[str]
    ends_at: NotRequired[str]
    error: NotRequired[str]
    """The last failure, while the replica fails."""


class SilenceNote(TypedDict):
    """The `alertmanager` handler's note on an event (kept in the state store, shown in /v1/events/{id})."""

    state: NoteState
    created_by: str
    comment: str
    matchers: list[MatcherJson]
    not_before: str | None
    silences: dict[str, NotedSilence]
    """Replica URL -> its silence."""
    started_at: NotRequired[str]
    """When the event was first seen without a NotBefore (its silence's start)."""
    summary: NotRequired[str]


@dataclass(frozen=True)
class Matcher:
    """One matcher as written in the config (its value unexpanded)."""

    name: str
    op: str
    value: str

    @property
    def is_regex(self) -> bool:
        return "~" in self.op

    @property
    def is_equal(self) -> bool:
        return not self.op.startswith("!")

    def __str__(self) -> str:
        return f'{self.name}{self.op}"{self.value}"'

    def expanded(self, fields: dict[str, str]) -> MatcherJson:
        """The v2 API's matcher object with the placeholders filled in (escaped in a regex)."""
        return {"name": self.name, "value": expand(self.value, fields, regex=self.is_regex),
                "isRegex": self.is_regex, "isEqual": self.is_equal}


def quote_meta(value: str) -> str:
    """`value` as a regex matching exactly it (Go's regexp.QuoteMeta)."""
    return _QUOTE_META.sub(r"\\\1", value)


def expand(template: str, fields: dict[str, str], *, regex: bool = False) -> str:
    """`template` with each `{placeholder}` replaced (quoted for a regex when `regex`)."""
    def one(m: re.Match[str]) -> str:
        if m.group(1) or m.group(2) not in fields:
            return m.group(0)
        value = fields[m.group(2)]
        return quote_meta(value) if regex else value
    return _FIELD.sub(one, template)


def check_fields(template: str) -> None:
    """Refuse a `{name}` that is not a placeholder (a typo would otherwise stay in the value)."""
    for m in _FIELD.finditer(template):
        if not m.group(1) and m.group(2) not in PLACEHOLDERS:
            raise ConfigValueError("", f"unknown placeholder {{{m.group(2)}}}{did_you_mean(m.group(2), PLACEHOLDERS)};"
                                   f" placeholders: {', '.join('{' + p + '}' for p in PLACEHOLDERS)}")


def _unquote(raw: str) -> str:
    if not raw.startswith('"'):
        if '"' in raw:
            raise ValueError('a value with a quote must be quoted: name="a\\"b"')
        return raw
    out, i = [], 1
    while i < len(raw):
        c = raw[i]
        if c == "\\" and i + 1 < len(raw) and raw[i + 1] in _ESCAPES:
            out.append(_ESCAPES[raw[i + 1]])
            i += 2
            continue
        if c == '"':
            if i != len(raw) - 1:
                raise ValueError(f"text after the closing quote: {raw[i + 1:]!r}")
            return "".join(out)
        out.append(c)
        i += 1
    raise ValueError("the value's closing quote is missing")


def parse_matcher(value: Any) -> Matcher:
    """One matcher in Alertmanager's syntax, checked as Alertmanager will check it once expanded."""
    raw = text()(value)
    m = _MATCHER.match(raw)
    fix = 'write it as name="value", name!="value", name=~"regex" or name!~"regex"'
    if m is None:
        raise ConfigValueError("", f"{raw!r} is not a matcher; {fix} (label names: letters, digits, _)")
    try:
        matcher = Matcher(m.group(1), m.group(2), _unquote(m.group(3)))
    except ValueError as exc:
        raise ConfigValueError("", f"{raw!r}: {exc}; {fix}") from None
    check_fields(matcher.value)
    if matcher.is_regex:
        if _NOT_RE2.search(matcher.value):
            raise ConfigValueError("", f"{raw!r}: Alertmanager's regexes (Go RE2) have no lookarounds or "
                                   "backreferences; rewrite the regex without them")
        try:
            re.compile(expand(matcher.value, SAMPLE, regex=True))
        except re.error as exc:
            raise ConfigValueError("", f"{raw!r}: not a valid regex ({exc})") from None
    return matcher


def matches_empty(matcher: Matcher) -> bool:
    """Whether the matcher (placeholders filled with sample values) matches an absent label."""
    value = expand(matcher.value, SAMPLE, regex=matcher.is_regex)
    hit = re.fullmatch(value, "") is not None if matcher.is_regex else value == ""
    return hit == matcher.is_equal


def check_matchers(matchers: tuple[Matcher, ...]) -> None:
    """Refuse a set Alertmanager would refuse: every matcher matching the empty string."""
    if all(matches_empty(m) for m in matchers):
        raise ConfigValueError("", "every matcher matches an absent label, so the silence would cover every alert "
                               "and Alertmanager refuses it; add one such as instance=~\"{computer_name}(:[0-9]+)?\"")


def comment_template(value: Any) -> str:
    """The comment: must name the event (`{event_id}`): maintd finds its own silences by it."""
    tpl = text()(value)
    check_fields(tpl)
    if "{event_id}" not in tpl:
        raise ConfigValueError("", "the comment must name the event: include {event_id} (maintd recognises its "
                               "silences by their comment after a restart)")
    return cast(str, tpl)


# --- when -----------------------------------------------------------------------------------

def impact(event_type: str, duration_seconds: int) -> float:
    """Seconds the event is expected to last: DurationInSeconds, or the type's default when unknown (-1)."""
    if duration_seconds >= 0:
        return float(duration_seconds)
    return EXPECTED_IMPACT.get(event_type, OTHER_IMPACT)


@dataclass(frozen=True)
class Window:
    """When a silence should start and end."""

    starts: datetime
    ends: datetime


def window(*, now: datetime, begins: datetime | None, impact_seconds: float, margin: float, start_now: bool) -> Window:
    """The silence for an event still present: it starts now when `start_now` (the VM left rotation, or the
    event started), else when the event may begin (`begins`, its NotBefore); it ends `margin` after the
    expected end (`begins` + impact), and never less than `margin` from now (extended while it lasts)."""
    begin = begins if begins is not None else now
    starts = now if start_now or begin <= now else begin
    ends = max(begin + timedelta(seconds=impact_seconds), now) + timedelta(seconds=margin)
    return Window(starts, ends)


def needs_update(have: Window, want: Window, now: datetime, slack: float) -> bool:
    """Whether a silence that runs `have` must be changed for `want`: it should start earlier than it does
    (pending while it should be active, or NotBefore moved up), or end more than `slack` seconds later."""
    start_earlier = have.starts > now and want.starts < have.starts - timedelta(seconds=1)
    return start_earlier or want.ends > have.ends + timedelta(seconds=slack)
