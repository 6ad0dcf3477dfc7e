"""Health rules on local metrics, in the shape of Azure autoscale's metricTrigger.

A rule samples a metric (`cpu_percent`, `memory_percent`, `disk_percent` of a `path`, `load1`, or
a `command` printing a number) several times per `time_grain`; the samples of each grain are
combined by `statistic` (average/min/max/sum), the grains inside `time_window` by
`time_aggregation` (average/min/max/sum/last/count), and the result is compared with `threshold`
by `operator`. While the comparison holds — and for `cooldown` after it last held, so the probe
does not flap — the rule reports `state` (Warning or Error) into the health store as SourceId
`rules`, Property = the rule's name; otherwise Ok. Until a first whole grain exists the report
is Ok ("collecting"). A metric that cannot be sampled three times in a row reports Warning.

The evaluation (`combine`, `compare`, `RuleState.evaluate`) is pure; `SystemSampler` reads /proc
and runs commands; `RuleEngine` runs sampling on its own thread so a slow command never delays
the poll loop.
"""

from __future__ import annotations

import math
import operator as op
import os
import subprocess
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from agent import logs
from agent.clock import Clock
from agent.configschema import choice, duration, list_of, named_list, number, opt, optional, parse_section, text
from agent.errors import ConfigValueError
from agent.health import HealthState, HealthStore
from agent.metrics import Metrics

SOURCE_ID = "rules"
METRICS = ("cpu_percent", "memory_percent", "disk_percent", "load1", "command")
STATISTICS = ("average", "min", "max", "sum")
AGGREGATIONS = ("average", "min", "max", "sum", "last", "count")
OPERATORS: dict[str, Callable[[float, float], bool]] = {">": op.gt, ">=": op.ge, "<": op.lt, "<=": op.le,
                                                        "==": op.eq, "!=": op.ne}
SAMPLES_PER_GRAIN = 6
FAILURES_BEFORE_WARNING = 3
COMMAND_TIMEOUT = 10.0
STEP_INTERVAL = 1.0


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
        if self.metric == "command" and not self.command:
            raise ConfigValueError("command", "metric: command needs command: [program, args...]")
        if self.command and self.metric != "command":
            raise ConfigValueError("command", "command is only for metric: command")
        if self.path and self.metric != "disk_percent":
            raise ConfigValueError("path", "path is only for metric: disk_percent")
        if self.time_window < self.time_grain:
            raise ConfigValueError("time_window", f"must be at least time_grain ({self.time_grain:g}s)")

    @property
    def sample_every(self) -> float:
        return max(1.0, self.time_grain / SAMPLES_PER_GRAIN)


def parse_rules(value: Any) -> tuple[RuleSpec, ...]:
    """The `health_rules:` list; names must be unique."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise ConfigValueError("", "health_rules is a list of rules (- name: ..., metric: ..., operator: ...)")
    return named_list(value, lambda item: parse_section(RuleSpec, item), "rule")


# --- pure evaluation -------------------------------------------------------------------------

def combine(values: list[float], how: str) -> float:
    """Combine values by a statistic or time aggregation (average, min, max, sum, last, count)."""
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
    """`value operator threshold`; NaN (no data) is never true."""
    return not math.isnan(value) and OPERATORS[operator](value, threshold)


@dataclass
class RuleState:
    """Samples and trigger bookkeeping of one rule; times are monotonic seconds."""

    spec: RuleSpec
    started: float
    samples: deque[tuple[float, float]] = field(default_factory=deque)
    last_sample: float = -math.inf
    last_true: float | None = None
    failures: int = 0
    failure: str = ""

    def add(self, at: float, value: float) -> None:
        self.samples.append((at, value))
        self.failures, self.failure = 0, ""
        horizon = at - self.spec.time_window - self.spec.time_grain
        while self.samples and self.samples[0][0] < horizon:
            self.samples.popleft()

    def grains(self, now: float) -> list[float]:
        """One value per whole grain inside the window, oldest first."""
        g = self.spec.time_grain
        current = math.floor((now - self.started) / g)
        first = current - math.floor(self.spec.time_window / g)
        buckets: dict[int, list[float]] = {}
        for at, value in self.samples:
            index = math.floor((at - self.started) / g)
            if first <= index < current:
                buckets.setdefault(index, []).append(value)
        return [combine(buckets[i], self.spec.statistic) for i in sorted(buckets)]

    def evaluate(self, now: float) -> tuple[HealthState, float | None, bool]:
        """(state to report, window value or None while collecting, whether the condition holds now)."""
        grains = self.grains(now)
        if not grains:
            return HealthState.OK, None, False
        value = combine(grains, self.spec.time_aggregation)
        holds = compare(self.spec.operator, value, self.spec.threshold)
        if holds:
            self.last_true = now
        cooling = self.last_true is not None and now - self.last_true < self.spec.cooldown
        triggered = holds or cooling
        return (HealthState.parse(self.spec.state) if triggered else HealthState.OK), value, holds


def describe(spec: RuleSpec, value: float | None, holds: bool, state: HealthState, cooldown_left: float) -> str:
    """The health report's Description, readable on its own."""
    what = f"{spec.metric}" + (f" {spec.path}" if spec.path else "")
    if value is None:
        return f"{what}: collecting (first {spec.time_grain:g}s grain not complete)"
    text_ = f"{what} {spec.time_aggregation} over {spec.time_window:g}s = {value:.4g} " \
            f"{'' if holds else 'not '}{spec.operator} {spec.threshold:g}"
    if state != HealthState.OK and not holds:
        text_ += f" (cooldown: {cooldown_left:.0f}s left)"
    return f"{text_}: {spec.description}" if spec.description else text_


# --- sampling --------------------------------------------------------------------------------

class Sampler(Protocol):
    def sample(self, spec: RuleSpec) -> float: ...


class SystemSampler:
    """Reads the built-in metrics from /proc and statvfs, and runs metric commands."""

    def __init__(self) -> None:
        self._cpu: dict[str, tuple[int, int]] = {}

    def sample(self, spec: RuleSpec) -> float:
        if spec.metric == "cpu_percent":
            return self._cpu_percent(spec.name)
        if spec.metric == "memory_percent":
            info = {}
            with open("/proc/meminfo") as f:
                for line in f:
                    key, _, rest = line.partition(":")
                    info[key] = int(rest.split()[0])
            return 100.0 * (1 - info["MemAvailable"] / info["MemTotal"])
        if spec.metric == "disk_percent":
            st = os.statvfs(spec.path or "/")
            total = st.f_blocks * st.f_frsize
            available = st.f_bavail * st.f_frsize
            used = total - st.f_bfree * st.f_frsize
            return 100.0 * used / (used + available) if used + available else 0.0
        if spec.metric == "load1":
            return os.getloadavg()[0]
        return self._command(spec)

    def _cpu_percent(self, key: str) -> float:
        """Busy share of all CPUs since this rule's previous reading (0 at the first)."""
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        idle, total = fields[3] + (fields[4] if len(fields) > 4 else 0), sum(fields[:8])
        previous = self._cpu.get(key)
        self._cpu[key] = (idle, total)
        if previous is None or total <= previous[1]:
            return 0.0
        return 100.0 * (1 - (idle - previous[0]) / (total - previous[1]))

    @staticmethod
    def _command(spec: RuleSpec) -> float:
        assert spec.command is not None
        try:
            done = subprocess.run(list(spec.command), capture_output=True, text=True,
                                  timeout=min(spec.time_grain, COMMAND_TIMEOUT), stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise ValueError(f"command timed out after {min(spec.time_grain, COMMAND_TIMEOUT):g}s") from None
        except OSError as exc:
            raise ValueError(f"command cannot run: {exc}") from None
        if done.returncode != 0:
            raise ValueError(f"command exited {done.returncode}: {done.stderr.strip()[:200]}")
        try:
            return float(done.stdout.strip())
        except ValueError:
            raise ValueError(f"command printed {done.stdout.strip()[:80]!r}, not a number") from None


# --- the engine ------------------------------------------------------------------------------

class RuleEngine:
    """Samples every rule when due, evaluates it, and keeps its health report current."""

    def __init__(self, specs: tuple[RuleSpec, ...], health: HealthStore, clock: Clock, metrics: Metrics,
                 sampler: Sampler | None = None) -> None:
        self.health = health
        self.clock = clock
        self.metrics = metrics
        self.sampler = sampler or SystemSampler()
        self.log = logs.get("rules")
        self.states: dict[str, RuleState] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._wanted = False
        self._lock = threading.Lock()
        self.update(specs)

    def update(self, specs: tuple[RuleSpec, ...]) -> None:
        """Apply a (re)loaded rule list: unchanged rules keep their samples; removed rules lose their report."""
        now = self.clock.monotonic()
        with self._lock:
            old = self.states
            self.states = {s.name: old[s.name] if s.name in old and old[s.name].spec == s else RuleState(s, now)
                           for s in specs}
            for name in set(old) - set(self.states):
                self.health.remove(SOURCE_ID, name)
        if self._wanted:
            self.start()

    def step(self) -> None:
        """Take the samples that are due and refresh every rule's report."""
        now = self.clock.monotonic()
        with self._lock:
            states = list(self.states.values())
        for st in states:
            if now - st.last_sample >= st.spec.sample_every:
                st.last_sample = now
                self._sample(st, now)
            self._report(st, now)

    def _sample(self, st: RuleState, now: float) -> None:
        try:
            st.add(now, float(self.sampler.sample(st.spec)))
        except (OSError, ValueError, KeyError, IndexError, ZeroDivisionError) as exc:
            st.failures += 1
            st.failure = str(exc)
            self.metrics.rule_sample_failures.inc()
            if st.failures == 1:
                self.log.warning("rule.sample_failed", rule=st.spec.name, metric=st.spec.metric, error=str(exc))

    def _report(self, st: RuleState, now: float) -> None:
        spec = st.spec
        if st.failures >= FAILURES_BEFORE_WARNING:
            self.health.set(SOURCE_ID, spec.name, HealthState.WARNING,
                            f"cannot sample {spec.metric} ({st.failures} failures in a row): {st.failure}")
            return
        previous = next((e.report.state for e in self.health.snapshot()
                         if e.report.source_id == SOURCE_ID and e.report.property == spec.name), HealthState.OK)
        state, value, holds = st.evaluate(now)
        left = spec.cooldown - (now - st.last_true) if st.last_true is not None else 0.0
        self.health.set(SOURCE_ID, spec.name, state, describe(spec, value, holds, state, max(0.0, left)))
        if state != previous:
            event = "rule.triggered" if state != HealthState.OK else "rule.cleared"
            self.log.warning(event, rule=spec.name, state=state.label, value=value, threshold=spec.threshold)

    def start(self) -> None:
        """Run `step` about once a second on a daemon thread (from the first rule on)."""
        self._wanted = True
        if self._thread is not None or not self.states:
            return
        self._thread = threading.Thread(target=self._run, name="rules", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.step()
            except Exception as exc:  # a rule must never take the daemon down
                self.log.error("rule.internal_error", error=repr(exc), exc_info=True)
            self._stop.wait(STEP_INTERVAL)  # real time: the clock may be a test's, which a wait would advance

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

