"""Health rules on local metrics, in the shape of Azure autoscale's metricTrigger.

A rule samples its `metric` (`cpu_percent`, `memory_percent`, `disk_percent` of a `path`, `load1`,
or a `command` printing one number) six times per `time_grain` (at most once a second, on a grid
aligned to the rule's start so every grain gets the same number of samples). The samples of each
grain are combined by `statistic` (average/min/max/sum) into one value per grain; when a grain
completes, the grains inside `time_window` are combined by `time_aggregation`
(average/min/max/sum/last/count) and the result is compared with `threshold` by `operator`. The
window is evaluated once per grain, so a report changes at most once a grain (plus when a
cooldown ends).

Until a whole `time_window` has passed since the rule started, the rule reports Ok "collecting":
a partial window would make `sum` and `count` mean something else than they will later, and a
short burst at boot (when maintd starts) would take the VM out of rotation. While the comparison
holds, and for `cooldown` after it last held (so the probe does not flap when the value hovers
around the threshold), the rule reports `state` (Warning or Error) into the health store as
SourceId `rules`, Property = the rule's name; otherwise Ok. `count` counts the grains of the
window that have a sample; an empty window has no `average`/`min`/`max`/`sum`/`last` (never true).
Three failed samples in a row report Warning "cannot sample" (or keep the triggered state if it is
worse) instead of a silent Ok.

`cpu_percent` is the busy share of all CPUs between two /proc/stat readings (since boot at a rule's
first reading), `memory_percent` 1 - MemAvailable/MemTotal, `disk_percent` used/(used+available)
as `df` shows it. A `command` runs without a shell in its own session, with maintd's environment
minus systemd's variables, for at most min(time_grain, 10 s); then its process group is killed.

This module is the spec and the pure evaluation (`aggregate`, `compare`, `RuleState`, `evaluate`,
`describe`); the I/O edge is `sampling.py`: `SystemSampler` reads /proc and statvfs and runs
commands, and `RuleEngine` samples and reports on its own thread so a slow command never delays
the poll loop.
"""

from __future__ import annotations

import math
import operator as op
import os
from collections import deque
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any, Callable

from agent.model.config_schema import (choice, duration, fmt_duration, list_of, named_list, number, opt, optional,
                                 parse_section, text)
from agent.errors import ConfigValueError

SOURCE_ID = "rules"
METRICS = ("cpu_percent", "memory_percent", "disk_percent", "load1", "command")
STATISTICS = ("average", "min", "max", "sum")
AGGREGATIONS = ("average", "min", "max", "sum", "last", "count")
OPERATORS: dict[str, Callable[[float, float], bool]] = {">": op.gt, ">=": op.ge, "<": op.lt, "<=": op.le,
                                                        "==": op.eq, "!=": op.ne}
SAMPLES_PER_GRAIN = 6
"""Samples per grain (fewer for grains under 6 s: never more than one a second)."""
MAX_WINDOW_GRAINS = 1440
"""Grains one window may span (a day of 1m grains; autoscale allows 12h): bounds memory and work."""


@dataclass(frozen=True)
class RuleSpec:
    name: str = opt(text(r"^[A-Za-z0-9_.-]{1,64}$", "letters, digits, _ . - (up to 64)"), doc="unique rule name")
    metric: str = opt(choice(*METRICS), doc="cpu_percent, memory_percent, disk_percent, load1 or command")
    operator: str = opt(choice(*OPERATORS), doc="> >= < <= == !=")
    threshold: float = opt(number(), doc="the value compared with")
    path: str | None = opt(optional(text(r"^/", "an absolute path")), None, "disk_percent: the filesystem (default /)")
    command: tuple[str, ...] | None = opt(optional(list_of(text(), min_len=1)), None,
                                          "metric command: program and arguments printing one number (no shell)")
    time_grain: float = opt(duration(1, 86400), 60.0, "sampling period: samples are combined per grain")
    statistic: str = opt(choice(*STATISTICS), "average", "how the samples of one grain are combined")
    time_window: float = opt(duration(1, 7 * 86400), 300.0, "look-back over which grains are aggregated")
    time_aggregation: str = opt(choice(*AGGREGATIONS), "average", "how the grains in the window are combined")
    state: str = opt(choice("Warning", "Error"), "Error", "the health state while the rule is triggered")
    cooldown: float = opt(duration(0, 86400), 300.0, "a triggered rule stays triggered at least this long")
    description: str = opt(text(allow_empty=True), "", "shown in the health report")

    def validate(self) -> None:
        """Refuse keys that do not go with the metric, and windows shorter than a grain."""
        if self.metric == "command" and not self.command:
            raise ConfigValueError("command", "metric: command needs command: [program, args...] "
                                              "(a program printing one number)")
        if self.command and self.metric != "command":
            raise ConfigValueError("command", f"command is only read with metric: command (this rule has "
                                              f"metric: {self.metric}); remove command or set metric: command")
        if self.path and self.metric != "disk_percent":
            raise ConfigValueError("path", f"path is only read with metric: disk_percent (this rule has "
                                           f"metric: {self.metric}); remove path")
        if self.time_window < self.time_grain:
            raise ConfigValueError("time_window", f"{fmt_duration(self.time_window)} is shorter than time_grain "
                                                  f"({fmt_duration(self.time_grain)}); make it at least one grain")
        if self.time_window / self.time_grain > MAX_WINDOW_GRAINS:
            raise ConfigValueError("time_window", f"spans {self.time_window / self.time_grain:.0f} grains of "
                                                  f"{fmt_duration(self.time_grain)}; at most {MAX_WINDOW_GRAINS}: "
                                                  "use a longer time_grain or a shorter time_window")

    @property
    def label(self) -> str:
        """What the rule measures, as its report says it (`disk_percent /var`, `command queue-depth`)."""
        if self.metric == "disk_percent":
            return f"disk_percent {self.path or '/'}"
        if self.metric == "command" and self.command:
            return f"command {os.path.basename(self.command[0])}"
        return self.metric

    @property
    def sample_every(self) -> float:
        """Seconds between samples: a whole fraction of the grain, never under one second."""
        return self.time_grain / max(1, min(SAMPLES_PER_GRAIN, int(self.time_grain)))

    @property
    def window_grains(self) -> int:
        """Whole grains in the window (a window that is not a multiple of the grain is rounded down)."""
        return int(self.time_window // self.time_grain)


def parse_rules(value: Any) -> tuple[RuleSpec, ...]:
    """The `health_rules:` list; names must be unique."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise ConfigValueError("", "health_rules is a list of rules (- name: ..., metric: ..., operator: ..., "
                                   "threshold: ...)")
    return named_list(value, lambda item: parse_section(RuleSpec, item), "rule")


# --- pure evaluation -------------------------------------------------------------------------

def aggregate(values: list[float], how: str) -> float:
    """Combine values by a statistic or time aggregation; NaN when there is nothing to combine (count: 0)."""
    if how == "count":
        return float(len(values))
    if not values:
        return math.nan
    if how == "average":
        return sum(values) / len(values)
    if how == "min":
        return min(values)
    if how == "max":
        return max(values)
    if how == "sum":
        return float(sum(values))
    if how == "last":
        return values[-1]
    raise ValueError(f"unknown aggregation {how!r}")


def compare(operator: str, value: float, threshold: float) -> bool:
    """`value operator threshold`; NaN (no data) is never true, not even for `!=`."""
    return not math.isnan(value) and OPERATORS[operator](value, threshold)


@dataclass
class RuleState:
    """One rule's grains and trigger bookkeeping. Times are monotonic seconds, `*_wall` UTC datetimes."""

    spec: RuleSpec
    started: float
    grains: deque[tuple[int, float]] = field(default_factory=deque)
    """Completed grains as (index since start, value by statistic), oldest first."""
    current: int = 0
    pending: list[float] = field(default_factory=list)
    """Samples of grain `current`, still being filled."""
    slot: int = -1
    """The last sampling slot taken (slot k starts at started + k * sample_every)."""
    evaluated: int = -1
    value: float | None = None
    holds: bool = False
    last_true: float | None = None
    last_true_wall: datetime | None = None
    triggered_wall: datetime | None = None
    failures: int = 0
    failure: str = ""
    failing_since: datetime | None = None

    def grain_index(self, at: float) -> int:
        return math.floor((at - self.started) / self.spec.time_grain)

    def slot_index(self, at: float) -> int:
        return math.floor((at - self.started) / self.spec.sample_every)

    def add(self, at: float, value: float) -> None:
        """Record a sample taken at `at`."""
        index = self.grain_index(at)
        self.close(index)
        self.current = index
        self.pending.append(value)

    def close(self, index: int) -> None:
        """Complete the pending grain if `index` is past it, and drop grains that left the window."""
        if self.pending and self.current < index:
            self.grains.append((self.current, aggregate(self.pending, self.spec.statistic)))
            self.pending = []
        while self.grains and self.grains[0][0] < index - self.spec.window_grains:
            self.grains.popleft()


def evaluate(state: RuleState, now: float, wall: datetime) -> tuple[bool, float | None]:
    """(triggered, window value) at monotonic `now` (`wall`: the same instant in UTC).

    The window is evaluated when a grain completes; in between the last result stands. The value is
    None while collecting (less than one whole window since the rule started), NaN for an empty window.
    """
    spec = state.spec
    index = state.grain_index(now)
    if index != state.evaluated:
        state.evaluated = index
        state.close(index)
        if index < spec.window_grains:
            state.value, state.holds = None, False
        else:
            state.value = aggregate([v for i, v in state.grains if i >= index - spec.window_grains],
                                    spec.time_aggregation)
            state.holds = compare(spec.operator, state.value, spec.threshold)
            if state.holds:
                state.last_true, state.last_true_wall = now, wall
    triggered = state.holds or (state.last_true is not None and now - state.last_true < spec.cooldown)
    if not triggered:
        state.triggered_wall = None
    elif state.triggered_wall is None:
        state.triggered_wall = wall
    return triggered, state.value


def hms(at: datetime) -> str:
    """A wall-clock time as rule descriptions show it."""
    return at.astimezone(timezone.utc).strftime("%H:%M:%SZ")


def _number(value: float) -> str:
    return f"{value:.4g}" if abs(value) < 10_000 else f"{value:.0f}"


def describe(state: RuleState, triggered: bool) -> str:
    """The report's Description, readable on its own (it changes at most once a grain)."""
    spec = state.spec
    if state.value is None:
        text_ = (f"{spec.label}: collecting ({max(0, state.evaluated)} of {spec.window_grains} grains of "
                 f"{fmt_duration(spec.time_grain)} so far)")
    elif math.isnan(state.value):
        text_ = f"{spec.label} {spec.time_aggregation} over {fmt_duration(spec.time_window)}: no samples in the window"
    else:
        comparison = f"{spec.operator} {_number(spec.threshold)}"
        text_ = (f"{spec.label} {spec.time_aggregation} over {fmt_duration(spec.time_window)} = "
                 f"{_number(state.value)} " + (comparison if state.holds else f"(not {comparison})"))
    if triggered and state.triggered_wall is not None and state.last_true_wall is not None:
        until = state.last_true_wall + timedelta(seconds=spec.cooldown)
        cooldown = f", cooldown until {hms(until)}" if spec.cooldown else ""
        text_ += f" (triggered {hms(state.triggered_wall)}{cooldown})"
    return f"{spec.description}: {text_}" if spec.description else text_
