"""Sampling health rules: readings from /proc, statvfs and commands, on the rule engine's own thread.

The pure side (spec, windows, evaluation, wording) is `rules.py`; this is the I/O edge. A slow or
hung metric command delays only this thread, never the poll loop.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import threading
from pathlib import Path
from typing import Protocol

from agent.clock import Clock
from agent.health.health_rules import SOURCE_ID, RuleSpec, RuleState, describe, evaluate, hms
from agent.health.health_store import HealthState, HealthStore
from agent.model.config_schema import fmt_duration
from agent.systemd import HOOK_ENV_STRIP
from agent.telemetry import logs
from agent.telemetry.metrics import Metrics

FAILURES_BEFORE_WARNING = 3
COMMAND_TIMEOUT = 10.0
"""Longest a metric command may run (less when the grain is shorter)."""
STEP_INTERVAL = 1.0
"""Longest the engine's thread waits between steps: cooldowns end within a second."""


# --- sampling --------------------------------------------------------------------------------

class Sampler(Protocol):
    def sample(self, spec: RuleSpec) -> float:
        """One reading of the rule's metric; any exception counts as a failed sample."""
        ...


class SystemSampler:
    """Reads the built-in metrics from /proc and statvfs, and runs metric commands (one thread only)."""

    def __init__(self, proc: Path = Path("/proc")) -> None:
        self.proc = proc
        self._cpu: dict[str, tuple[int, int]] = {}

    def sample(self, spec: RuleSpec) -> float:
        if spec.metric == "cpu_percent":
            return self._cpu_percent(spec.name)
        if spec.metric == "memory_percent":
            return self._memory_percent()
        if spec.metric == "disk_percent":
            return _disk_percent(spec.path or "/")
        if spec.metric == "load1":
            return float((self.proc / "loadavg").read_text().split()[0])
        return _command(spec)

    def _cpu_percent(self, key: str) -> float:
        """Busy share of all CPUs since this rule's previous reading (since boot at the first)."""
        fields = [int(x) for x in (self.proc / "stat").read_text().split("\n", 1)[0].split()[1:9]]
        idle, total = fields[3] + fields[4], sum(fields)  # idle + iowait; guest time is inside user already
        before_idle, before_total = self._cpu.get(key, (0, 0))
        self._cpu[key] = (idle, total)
        if total <= before_total:
            raise ValueError(f"{self.proc / 'stat'}: CPU counters did not advance")
        return 100.0 * (1 - (idle - before_idle) / (total - before_total))

    def _memory_percent(self) -> float:
        """Share of memory not available to new work: 1 - MemAvailable / MemTotal, as `free` reads it."""
        info = {}
        for line in (self.proc / "meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            info[key] = rest.split()[0] if rest.split() else ""
        if "MemAvailable" not in info or "MemTotal" not in info:
            raise ValueError(f"{self.proc / 'meminfo'} has no MemAvailable/MemTotal (kernel older than 3.14?)")
        return 100.0 * (1 - int(info["MemAvailable"]) / int(info["MemTotal"]))


def _disk_percent(path: str) -> float:
    """Used share of the filesystem as `df` shows it: used / (used + available to unprivileged users)."""
    st = os.statvfs(path)
    used = (st.f_blocks - st.f_bfree) * st.f_frsize
    available = st.f_bavail * st.f_frsize
    return 100.0 * used / (used + available) if used + available else 0.0


def _command(spec: RuleSpec) -> float:
    """Run the rule's command without a shell, in its own session; its output is one number."""
    assert spec.command is not None
    program = spec.command[0]
    limit = min(spec.time_grain, COMMAND_TIMEOUT)
    env = {k: v for k, v in os.environ.items() if k not in HOOK_ENV_STRIP}
    try:
        proc = subprocess.Popen(list(spec.command), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env=env, start_new_session=True, close_fds=True)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot run {program}: {exc}") from None
    with proc:
        try:
            out, err = proc.communicate(timeout=limit)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the whole tree, not only the leader
            except ProcessLookupError:
                pass
            try:
                proc.communicate(timeout=1.0)
            except subprocess.TimeoutExpired:  # a descendant left the group and holds the pipe
                pass
            raise ValueError(f"{program} timed out after {fmt_duration(limit)} "
                             "(its process group was killed)") from None
    printed = out.decode("utf-8", "replace").strip()
    if proc.returncode != 0:
        status = f"killed by signal {-proc.returncode}" if proc.returncode < 0 else f"exited {proc.returncode}"
        raise ValueError(f"{program} {status}: {err.decode('utf-8', 'replace').strip()[-200:]}")
    try:
        return float(printed)
    except ValueError:
        raise ValueError(f"{program} printed {printed[:80]!r}, not a number") from None


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
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._wanted = False
        self.update(specs)

    def update(self, specs: tuple[RuleSpec, ...]) -> None:
        """Apply a (re)loaded rule list: unchanged rules keep their data; removed rules lose their report."""
        now = self.clock.monotonic()
        with self._lock:
            old = self.states
            self.states = {s.name: old[s.name] if s.name in old and old[s.name].spec == s else RuleState(s, now)
                           for s in specs}
            for name in old.keys() - self.states.keys():
                self.health.remove(SOURCE_ID, name)
        if self._wanted:
            self.start()

    def step(self) -> float:
        """Take the samples that are due, refresh every report; returns seconds until the next sample is due."""
        with self._lock:
            states = list(self.states.values())
        wait = STEP_INTERVAL
        for st in states:
            now = self.clock.monotonic()
            slot = st.slot_index(now)
            if slot != st.slot:
                st.slot = slot
                self._sample(st, now)  # outside the lock: a command may take seconds
            with self._lock:
                if self.states.get(st.spec.name) is st:  # not removed by a reload meanwhile
                    self._report(st, self.clock.monotonic())
            wait = min(wait, st.started + (slot + 1) * st.spec.sample_every - self.clock.monotonic())
        return max(0.01, wait)

    def _sample(self, st: RuleState, now: float) -> None:
        spec = st.spec
        try:
            value = float(self.sampler.sample(spec))
            if not math.isfinite(value):
                raise ValueError(f"{value} is not a finite number")
        except Exception as exc:  # any sampler failure is a failed sample, never a dead rule thread
            st.failures += 1
            st.failure = str(exc) or type(exc).__name__
            self.metrics.rule_sample_failures.inc()
            if st.failures == 1:
                st.failing_since = self.clock.now()
                self.log.warning("rule.sample_failed", rule=spec.name, metric=spec.metric, error=st.failure)
            return
        if st.failures:
            self.log.info("rule.sample_recovered", rule=spec.name, metric=spec.metric, failures=st.failures)
            st.failures, st.failure, st.failing_since = 0, "", None
        st.add(now, value)

    def _report(self, st: RuleState, now: float) -> None:
        spec = st.spec
        was_triggered = st.triggered_wall is not None
        triggered, value = evaluate(st, now, self.clock.now())
        state = HealthState.parse(spec.state) if triggered else HealthState.OK
        description = describe(st, triggered)
        if st.failures >= FAILURES_BEFORE_WARNING and st.failing_since is not None:
            state = max(state, HealthState.WARNING)
            description = (f"cannot sample {spec.label} since {hms(st.failing_since)}: {st.failure}"
                           + (f"; last evaluation: {description}" if triggered else ""))
        self.health.set(SOURCE_ID, spec.name, state, description)
        if triggered and not was_triggered:
            self.log.warning("rule.triggered", rule=spec.name, state=spec.state, value=value,
                             operator=spec.operator, threshold=spec.threshold)
        elif was_triggered and not triggered:
            self.log.info("rule.cleared", rule=spec.name, value=value, threshold=spec.threshold)

    def start(self) -> None:
        """Run `step` on a daemon thread (from the first rule on; a reload adding rules starts it)."""
        self._wanted = True
        if self._thread is not None or not self.states:
            return
        self._thread = threading.Thread(target=self._run, name="rules", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        wait = 0.0
        while not self.clock.wait(self._stop, wait):
            try:
                wait = self.step()
            except Exception as exc:  # a bug in a rule must not end every rule
                self.log.error("rule.internal_error", error=repr(exc), exc_info=True)
                wait = STEP_INTERVAL

    def stop(self) -> None:
        """Stop the thread (a metric command still running is left to its timeout)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2.0)
