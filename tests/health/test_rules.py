"""Health rules: config, the autoscale-shaped evaluation, cooldown against flapping, sampler failures."""

from __future__ import annotations

import math
import shutil
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest

from agent.clock import FakeClock
from agent.config.config import loads
from agent.errors import ConfigError
from agent.health.health_rules import RuleSpec, RuleState, aggregate, compare, describe, evaluate
from agent.health.health_store import HealthState, HealthStore
from agent.health.sampling import RuleEngine, SystemSampler
from agent.telemetry.metrics import Metrics
from tests.samples import sample

OK, W, E = HealthState.OK, HealthState.WARNING, HealthState.ERROR
T0 = datetime(2026, 1, 1, tzinfo=UTC)  # FakeClock's start


def rule(**kw) -> RuleSpec:
    base = dict(name="cpu-hot", metric="cpu_percent", operator=">", threshold=90.0)
    return RuleSpec(**{**base, **kw})


class Fake:
    """A sampler whose value the test sets; raises `fail` when it is set; counts its calls."""

    def __init__(self, value: float = 0.0) -> None:
        self.value, self.fail, self.calls = value, None, 0

    def sample(self, spec: RuleSpec) -> float:
        self.calls += 1
        if self.fail:
            raise self.fail
        return self.value


def engine(clock, *specs, sampler=None):
    health = HealthStore(clock)
    return RuleEngine(specs, health, clock, Metrics(), sampler or Fake()), health


def report(health, name="cpu-hot"):
    ev = next(e for e in health.snapshot() if e.report.property == name)
    assert ev.report.source_id == "rules"
    return ev.report.state, ev.report.description


def run(eng, clock, seconds: int) -> None:
    """Step once a second for `seconds` of fake time (the first step is at the current instant)."""
    for _ in range(seconds):
        eng.step()
        clock.advance(1)


def events(logs, name):
    return [e for e in logs if e["event"] == name]


# --- config ----------------------------------------------------------------------------------

GOOD = "health_rules:\n  - {name: cpu-hot, metric: cpu_percent, operator: '>', threshold: 90}\n"


def test_defaults_follow_the_issue():
    """A minimal rule samples per 1m grain over a 5m window, average/average, Error, 5m cooldown."""
    r = loads(GOOD).health_rules[0]
    assert (r.time_grain, r.time_window, r.cooldown) == (60, 300, 300)
    assert (r.statistic, r.time_aggregation, r.state, r.path, r.command) == ("average", "average", "Error", None, None)
    assert loads("health_rules: []\n").health_rules == ()


@pytest.mark.parametrize("item, key, fix", [
    ("{name: r, metric: cpu_precent, operator: '>', threshold: 1}", "health_rules[0].metric",
     "did you mean 'cpu_percent'"),
    ("{name: r, metric: command, operator: '>', threshold: 1}", "health_rules[0].command", "needs command: ["),
    ("{name: r, metric: load1, operator: '>', threshold: 1, command: [x]}", "health_rules[0].command",
     "only read with metric: command"),
    ("{name: r, metric: load1, operator: '>', threshold: 1, path: /var}", "health_rules[0].path",
     "only read with metric: disk_percent"),
    ("{name: r, metric: disk_percent, operator: '>', threshold: 1, path: var}", "health_rules[0].path",
     "absolute path"),
    ("{name: r, metric: load1, operator: '=>', threshold: 1}", "health_rules[0].operator", ">, >=, <, <=, ==, !="),
    ("{name: r, metric: load1, operator: '>', threshold: 1, time_grain: 5m, time_window: 1m}",
     "health_rules[0].time_window", "at least one grain"),
    ("{name: r, metric: load1, operator: '>', threshold: 1, time_grain: 1s, time_window: 1h}",
     "health_rules[0].time_window", "longer time_grain"),
    ("{name: r, metric: load1, operator: '>', threshold: 1, time_grain: 500ms}", "health_rules[0].time_grain",
     "minimum is 1s"),
    ("{name: r, metric: load1, operator: '>', threshold: high}", "health_rules[0].threshold", "expected a number"),
    ("{name: r, metric: load1, operator: '>', threshold: 1, state: Critical}", "health_rules[0].state",
     "Warning, Error"),
    ("{name: r, metric: load1, operator: '>', threshold: 1, statistic: median}", "health_rules[0].statistic",
     "average, min, max, sum"),
    ("{name: r, metric: load1, operator: '>', threshold: 1, time_aggregation: total}",
     "health_rules[0].time_aggregation", "last, count"),
    ("{name: r, metric: load1, operator: '>', treshold: 1}", "health_rules[0].treshold", "did you mean 'threshold'"),
    ("{name: r, metric: load1, threshold: 1}", "health_rules[0]", "missing required key 'operator'"),
    ("{name: 'a b', metric: load1, operator: '>', threshold: 1}", "health_rules[0].name", "letters, digits"),
])
def test_bad_rules_are_refused_naming_the_key_and_the_fix(item, key, fix):
    """Every mistake points at file:line, the key, and says what to write instead."""
    with pytest.raises(ConfigError) as err:
        loads(f"health_rules:\n  - {item}\n", "maintd.yaml")
    assert err.value.key == key and err.value.line == 2
    assert fix in err.value.message


def test_duplicate_rule_names_and_a_non_list_are_refused():
    """Two rules with one name, or health_rules that is not a list, are refused at the offending key."""
    with pytest.raises(ConfigError) as err:
        loads(GOOD + "  - {name: cpu-hot, metric: load1, operator: '>', threshold: 4}\n", "maintd.yaml")
    assert err.value.key == "health_rules[1].name" and "used twice" in err.value.message
    with pytest.raises(ConfigError) as err:
        loads("health_rules: {name: cpu-hot}\n", "maintd.yaml")
    assert err.value.key == "health_rules" and "list" in err.value.message


# --- pure evaluation -------------------------------------------------------------------------

@pytest.mark.parametrize("how, expected", [("average", 2.0), ("min", 1.0), ("max", 3.0), ("sum", 6.0),
                                           ("last", 2.0), ("count", 3.0)])
def test_aggregate_every_statistic_and_time_aggregation(how, expected):
    """Each statistic and time aggregation; `last` is the newest value, not the largest."""
    assert aggregate([3.0, 1.0, 2.0], how) == expected


@pytest.mark.parametrize("how", ["average", "min", "max", "sum", "last"])
def test_aggregate_of_nothing_is_no_data_except_count(how):
    """An empty set has no average/min/max/sum/last (NaN); its count is 0."""
    assert math.isnan(aggregate([], how)) and aggregate([], "count") == 0.0


@pytest.mark.parametrize("operator, true, false", [(">", (2, 1), (1, 1)), (">=", (1, 1), (0, 1)),
                                                   ("<", (0, 1), (1, 1)), ("<=", (1, 1), (2, 1)),
                                                   ("==", (1, 1), (1, 2)), ("!=", (1, 2), (1, 1))])
def test_compare_every_operator(operator, true, false):
    """Each operator both ways; no data (NaN) never satisfies one, not even `!=`."""
    assert compare(operator, *true) and not compare(operator, *false)
    assert not compare(operator, math.nan, 1)


def test_evaluate_combines_samples_per_grain_then_grains_over_the_window():
    """sum per grain, max over the window, evaluated once whole grains fill the window."""
    spec = rule(metric="load1", time_grain=10.0, time_window=20.0, statistic="sum", time_aggregation="max",
                operator=">=", threshold=7, cooldown=0)
    st = RuleState(spec, started=0.0)
    for at, value in [(0, 1), (5, 2), (10, 3), (15, 4), (20, 0)]:
        st.add(at, value)
    assert evaluate(st, 19.0, T0) == (False, None), "collecting: one grain of two"
    assert "collecting (1 of 2 grains of 10s so far)" in describe(st, False)
    assert evaluate(st, 20.0, T0) == (True, 7.0), "grains 1+2=3 and 3+4=7"
    assert describe(st, True) == "load1 max over 20s = 7 >= 7 (triggered 00:00:00Z)", "no cooldown to show"
    st.add(25, 1)
    assert evaluate(st, 30.0, T0) == (True, 7.0), "grains 7 and 0+1=1: max is still 7"
    st.add(30, 0)
    assert evaluate(st, 40.0, T0) == (False, 1.0)
    assert describe(st, False) == "load1 max over 20s = 1 (not >= 7)"


def test_an_empty_window_is_no_data_but_count_sees_it():
    """Sampling failed for a whole window: average has no value, count is 0 (a `count < 1` rule fires)."""
    st = RuleState(rule(time_grain=10.0, time_window=10.0), started=0.0)
    triggered, value = evaluate(st, 10.0, T0)
    assert not triggered and value is not None and math.isnan(value)
    assert describe(st, False) == "cpu_percent average over 10s: no samples in the window"
    dead = RuleState(rule(time_grain=10.0, time_window=10.0, time_aggregation="count", operator="<", threshold=1),
                     started=0.0)
    assert evaluate(dead, 10.0, T0) == (True, 0.0)


# --- the engine ------------------------------------------------------------------------------

def test_collecting_until_a_whole_window_then_triggered_with_a_readable_description(clock, logs):
    """Ok "collecting" for the first window, then the rule's state with a self-explaining description."""
    eng, health = engine(clock, rule(), sampler=Fake(95.0))
    run(eng, clock, 300)
    assert report(health) == (OK, "cpu_percent: collecting (4 of 5 grains of 1m so far)")
    eng.step()
    assert report(health) == (E, "cpu_percent average over 5m = 95 > 90 "
                                 "(triggered 00:05:00Z, cooldown until 00:10:00Z)")
    assert [(e["rule"], e["value"]) for e in events(logs, "rule.triggered")] == [("cpu-hot", 95.0)]


def test_samples_six_times_per_grain_and_never_more_than_once_a_second(clock):
    """Six samples per grain, fewer for short grains: at most one a second."""
    for grain, expected in ((60.0, 6), (3.0, 3), (1.0, 1)):
        sampler = Fake(1.0)
        eng, _ = engine(clock, rule(time_grain=grain, time_window=grain), sampler=sampler)
        for _ in range(int(grain) * 4):  # steps every 250 ms for one grain
            eng.step()
            clock.advance(0.25)
        assert sampler.calls == expected, grain


def test_step_says_how_long_until_the_next_sample(clock):
    """The thread wakes when a sample is due, and at least once a second (cooldowns end on time)."""
    eng, _ = engine(clock, rule(time_grain=3.0, time_window=3.0))
    eng.step()
    clock.advance(0.75)
    assert eng.step() == pytest.approx(0.25)
    eng2, _ = engine(clock, rule(time_grain=60.0))
    assert eng2.step() == 1.0


def test_cooldown_keeps_a_rule_triggered_so_the_probe_does_not_flap(clock, logs):
    """The value hovers around the threshold grain by grain: Error throughout, one trigger, one clear."""
    sampler = Fake(95.0)
    eng, health = engine(clock, rule(time_window=60.0, cooldown=300.0), sampler=sampler)
    run(eng, clock, 61)
    seen = set()
    for i in range(10):
        sampler.value = 80.0 if i % 2 == 0 else 95.0  # grain i+1 holds 80 or 95
        run(eng, clock, 60)
        seen.add(report(health)[0])
    assert seen == {E}
    sampler.value = 10.0  # the last true evaluation was at 00:11:00 (grain 10 held mostly 95)
    run(eng, clock, 299)
    state, text = report(health)
    assert state == E and "(not > 90)" in text and "cooldown until 00:16:00Z" in text
    eng.step()
    assert report(health) == (OK, "cpu_percent average over 1m = 10 (not > 90)")
    assert len(events(logs, "rule.triggered")) == 1 and len(events(logs, "rule.cleared")) == 1


def test_without_cooldown_the_same_oscillation_flaps(clock, logs):
    """The contrast that shows what cooldown is for."""
    sampler = Fake(95.0)
    eng, health = engine(clock, rule(time_window=60.0, cooldown=0.0), sampler=sampler)
    run(eng, clock, 61)
    for i in range(4):
        sampler.value = 80.0 if i % 2 == 0 else 95.0
        run(eng, clock, 60)
    assert len(events(logs, "rule.triggered")) == 3 and len(events(logs, "rule.cleared")) == 2


def test_statistic_per_grain_and_aggregation_over_the_window(clock):
    """max per grain, min over the window: one quiet grain in the window keeps the rule clear."""
    sampler = Fake(50.0)
    eng, health = engine(clock, rule(statistic="max", time_aggregation="min", time_window=180.0, cooldown=0.0),
                         sampler=sampler)
    run(eng, clock, 60)
    sampler.value = 99.0
    run(eng, clock, 121)
    assert report(health)[0] == OK
    run(eng, clock, 60)
    assert report(health) == (E, "cpu_percent min over 3m = 99 > 90 (triggered 00:04:00Z)")


def test_a_report_changes_at_most_once_a_grain(clock):
    """Health sinks see one report per grain, not one per second."""
    sampler = Fake(95.0)
    eng, health = engine(clock, rule(time_window=60.0), sampler=sampler)
    run(eng, clock, 121)
    seq = health.snapshot()[0].sequence_number
    sampler.value = 96.0
    run(eng, clock, 59)
    assert health.snapshot()[0].sequence_number == seq
    eng.step()
    assert health.snapshot()[0].sequence_number == seq + 1


def test_sampler_failures_turn_warning_after_three_counted_and_logged_once(clock, logs):
    """Three failures in a row: Warning "cannot sample", three counted, one log line; recovery is logged."""
    sampler = Fake()
    sampler.fail = ValueError("boom")
    eng, health = engine(clock, rule(time_grain=60.0), sampler=sampler)
    run(eng, clock, 21)  # samples at 0, 10, 20 s
    assert report(health) == (W, "cannot sample cpu_percent since 00:00:00Z: boom")
    assert sample(eng.metrics, "maintd_rule_sample_failures_total") == 3
    assert len(events(logs, "rule.sample_failed")) == 1, "logged once per streak"
    sampler.fail = None
    run(eng, clock, 10)
    assert report(health)[0] == OK and "collecting" in report(health)[1]
    assert events(logs, "rule.sample_recovered")[0]["failures"] == 3


def test_two_failures_in_a_row_are_not_yet_a_warning(clock):
    """A blip or two does not change the report."""
    sampler = Fake()
    sampler.fail = OSError("/proc/stat: permission denied")
    eng, health = engine(clock, rule(), sampler=sampler)
    run(eng, clock, 11)
    assert report(health)[0] == OK


@pytest.mark.parametrize("failure", [RuntimeError("plugin bug"), None])
def test_any_exception_and_a_non_finite_number_count_as_failures(clock, failure):
    """A plugin's unexpected exception or an infinite value is a failed sample, not a dead thread."""
    sampler = Fake(math.inf)
    sampler.fail = failure
    eng, health = engine(clock, rule(), sampler=sampler)
    run(eng, clock, 21)
    assert report(health)[0] == W and sample(eng.metrics, "maintd_rule_sample_failures_total") == 3


def test_a_triggered_rule_that_cannot_sample_keeps_its_worse_state(clock):
    """Error does not soften to Warning because the metric became unreadable."""
    sampler = Fake(95.0)
    eng, health = engine(clock, rule(time_window=60.0), sampler=sampler)
    run(eng, clock, 61)
    sampler.fail = ValueError("gone")
    run(eng, clock, 30)
    state, text = report(health)
    assert state == E and text.startswith("cannot sample cpu_percent since 00:01:10Z: gone; last evaluation: ")


def test_reload_keeps_unchanged_rules_resets_changed_ones_and_removes_deleted_reports(clock):
    """On reload an unchanged rule keeps its data, a changed one collects anew, a deleted one's report goes."""
    eng, health = engine(clock, rule(), rule(name="mem", metric="memory_percent"),
                         rule(name="load", metric="load1", threshold=4), sampler=Fake(95.0))
    run(eng, clock, 301)
    kept = eng.states["cpu-hot"]
    eng.update((rule(), rule(name="load", metric="load1", threshold=8)))
    eng.step()
    assert eng.states["cpu-hot"] is kept and report(health)[0] == E
    assert report(health, "load")[1].startswith("load1: collecting")
    assert {e.report.property for e in health.snapshot()} == {"cpu-hot", "load"}


def test_a_rule_removed_while_it_samples_does_not_come_back(clock):
    """A reload during a slow command: the finished step must not resurrect the deleted report."""
    holder = {}

    class Reloading(Fake):
        def sample(self, spec):
            holder["engine"].update(())
            return 1.0

    eng, health = engine(clock, rule(), sampler=Reloading())
    holder["engine"] = eng
    eng.step()
    assert health.snapshot() == []


def test_runs_on_its_own_thread_until_stopped():
    """start() steps on a daemon thread (here with a FakeClock, whose waits return at once)."""
    clock = FakeClock()
    sampled = threading.Event()

    class Signalling(Fake):
        def sample(self, spec):
            sampled.set()
            return 1.0

    eng, health = engine(clock, sampler=Signalling())
    eng.start()
    assert eng._thread is None, "no rules: no thread"
    eng.update((rule(time_grain=1.0, time_window=1.0),))
    try:
        assert sampled.wait(5)
    finally:
        eng.stop()
    assert eng._thread is not None and not eng._thread.is_alive()
    assert report(health)[0] == OK


# --- the system sampler ----------------------------------------------------------------------

def test_command_metric_with_real_processes():
    """A command's output is one number; garbage, a non-zero exit and a missing program are failures."""
    sampler = SystemSampler()
    assert sampler.sample(rule(metric="command", command=(sys.executable, "-c", "print(42)"))) == 42.0
    with pytest.raises(ValueError, match="printed 'lots', not a number"):
        sampler.sample(rule(metric="command", command=(sys.executable, "-c", "print('lots')")))
    with pytest.raises(ValueError, match="exited 3: disk gone"):
        sampler.sample(rule(metric="command", command=(sys.executable, "-c",
                                                       "import sys; sys.stderr.write('disk gone'); sys.exit(3)")))
    with pytest.raises(ValueError, match="cannot run /no/such/program"):
        sampler.sample(rule(metric="command", command=("/no/such/program",)))


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_command_that_hangs_is_killed_with_its_children_at_min_grain_10s(tmp_path):
    """time_grain 1s: the command gets one second, then its whole process group is killed."""
    pidfile = tmp_path / "child.pid"
    hang = ("import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)']);"
            f" open({str(pidfile)!r}, 'w').write(str(c.pid)); time.sleep(30)")
    started = time.monotonic()
    with pytest.raises(ValueError, match="timed out after 1s"):
        SystemSampler().sample(rule(metric="command", time_grain=1.0, time_window=1.0,
                                    command=(sys.executable, "-c", hang)))
    assert time.monotonic() - started < 3
    child, gone_by = int(pidfile.read_text()), time.monotonic() + 2  # SIGKILL is delivered, not instant
    while _running(child) and time.monotonic() < gone_by:
        time.sleep(0.02)
    assert not _running(child), "the command's child was killed too"


def test_a_command_does_not_inherit_the_systemd_notify_socket(monkeypatch):
    """A metric command cannot talk to systemd in maintd's name."""
    monkeypatch.setenv("NOTIFY_SOCKET", "/run/systemd/notify")
    printed = "import os; print(len(os.environ.get('NOTIFY_SOCKET', '')))"
    assert SystemSampler().sample(rule(metric="command", command=(sys.executable, "-c", printed))) == 0


def test_command_rule_end_to_end(clock):
    """A real command through the engine: one 1s grain of 12000 > 10000 reports Warning."""
    spec = rule(name="queue", metric="command", command=(sys.executable, "-c", "print(12000)"), time_grain=1.0,
                time_window=1.0, operator=">", threshold=10000, state="Warning")
    eng, health = engine(clock, spec, sampler=SystemSampler())
    run(eng, clock, 2)
    assert report(health, "queue") == (W, f"command {Path(sys.executable).name} average over 1s = 12000 > 10000 "
                                          "(triggered 00:00:01Z, cooldown until 00:05:01Z)")


def test_system_sampler_reads_sane_numbers_on_this_box():
    """The built-in metrics read from this Linux box are in range."""
    sampler = SystemSampler()
    for metric in ("cpu_percent", "memory_percent", "disk_percent"):
        assert 0.0 <= sampler.sample(rule(metric=metric)) <= 100.0, metric
    assert sampler.sample(rule(metric="load1")) >= 0.0
    assert sampler.sample(rule(metric="disk_percent", path="/tmp")) >= 0.0


def test_disk_percent_is_what_df_shows():
    """used / (used + available to users), so the reserved blocks do not hide a full disk."""
    usage = shutil.disk_usage("/")
    expected = 100.0 * usage.used / (usage.used + usage.free)
    assert SystemSampler().sample(rule(metric="disk_percent", path="/")) == pytest.approx(expected, abs=0.5)


def test_cpu_is_the_busy_share_between_readings_and_memory_uses_mem_available(tmp_path):
    """Exact values from a fake /proc: CPU busy share between readings, memory from MemAvailable, load1."""
    proc = tmp_path
    sampler = SystemSampler(proc)
    (proc / "stat").write_text("cpu  100 0 100 700 100 0 0 0 0 0\ncpu0 1 2 3 4 5 6 7 8 9 10\n")
    assert sampler.sample(rule()) == pytest.approx(20.0), "first reading: since boot"
    (proc / "stat").write_text("cpu  250 0 200 750 100 0 0 0 0 0\n")
    assert sampler.sample(rule()) == pytest.approx(100 * 250 / 300), "idle+iowait grew by 50 of 300 jiffies"
    assert sampler.sample(rule(name="other")) == pytest.approx(100 * 450 / 1300), "each rule has its own baseline"
    (proc / "meminfo").write_text("MemTotal:  1000 kB\nMemFree:  100 kB\nMemAvailable:  250 kB\n")
    assert sampler.sample(rule(metric="memory_percent")) == pytest.approx(75.0)
    (proc / "meminfo").write_text("MemTotal:  1000 kB\nMemFree:  100 kB\n")
    with pytest.raises(ValueError, match="MemAvailable"):
        sampler.sample(rule(metric="memory_percent"))
    (proc / "loadavg").write_text("0.50 0.40 0.30 1/100 1234\n")
    assert sampler.sample(rule(metric="load1")) == 0.5


def test_unreadable_proc_is_a_failed_sample(clock, tmp_path):
    """An unreadable /proc ends in Warning "cannot sample", not a silent Ok."""
    eng, health = engine(clock, rule(), sampler=SystemSampler(tmp_path / "missing"))
    run(eng, clock, 21)
    state, text = report(health)
    assert state == W and "No such file" in text
