"""Health rules: config, the autoscale-shaped evaluation, cooldown against flapping, sampler failures."""

from __future__ import annotations

import math
import sys

import pytest

from agent.config import loads
from agent.errors import ConfigError
from agent.health import HealthState, HealthStore
from agent.metrics import Metrics
from agent.rules import RuleEngine, RuleSpec, SystemSampler, combine, compare


def rule(**kw):
    base = dict(name="cpu-hot", metric="cpu_percent", operator=">", threshold=90.0, time_grain=60.0,
                time_window=300.0, cooldown=300.0)
    return RuleSpec(**{**base, **kw})


class Fake:
    """A sampler whose value the test sets; raising when `fail` holds an exception."""

    def __init__(self, value=0.0):
        self.value, self.fail = value, None

    def sample(self, spec):
        if self.fail:
            raise self.fail
        return self.value


def engine(clock, *specs, sampler=None):
    health = HealthStore(clock)
    return RuleEngine(specs, health, clock, Metrics(), sampler or Fake()), health


def state(health, name="cpu-hot"):
    ev = next(e for e in health.snapshot() if e.report.property == name)
    return ev.report.state, ev.report.description


def run(eng, clock, seconds, step=10.0):
    for _ in range(int(seconds / step)):
        clock.advance(step)
        eng.step()


@pytest.mark.parametrize("how, expected", [("average", 2.0), ("min", 1.0), ("max", 3.0), ("sum", 6.0),
                                           ("last", 3.0), ("count", 3.0)])
def test_combine(how, expected):
    assert combine([1.0, 2.0, 3.0], how) == expected


def test_combine_empty_and_compare_every_operator():
    assert math.isnan(combine([], "average")) and combine([], "count") == 0
    assert compare(">", 2, 1) and compare(">=", 1, 1) and compare("<", 0, 1) and compare("<=", 1, 1)
    assert compare("==", 1, 1) and compare("!=", 1, 2) and not compare(">", math.nan, 0)


def test_reports_collecting_until_a_whole_grain_then_triggers_on_the_window(clock):
    sampler = Fake(95.0)
    eng, health = engine(clock, rule(), sampler=sampler)
    eng.step()
    s, text = state(health)
    assert s == HealthState.OK and "collecting" in text
    run(eng, clock, 70)
    s, text = state(health)
    assert s == HealthState.ERROR and "95 > 90" in text


def test_cooldown_keeps_a_rule_triggered_so_the_probe_does_not_flap(clock):
    """The value oscillates around the threshold every grain: the report stays Error throughout."""
    sampler = Fake(95.0)
    eng, health = engine(clock, rule(time_window=60.0, cooldown=300.0), sampler=sampler)
    run(eng, clock, 120)
    seen = set()
    for i in range(10):
        sampler.value = 80.0 if i % 2 else 95.0
        run(eng, clock, 60)
        seen.add(state(health)[0])
    assert seen == {HealthState.ERROR}
    sampler.value = 10.0
    run(eng, clock, 120)
    s, text = state(health)
    assert s == HealthState.ERROR and "cooldown" in text
    run(eng, clock, 300)
    assert state(health)[0] == HealthState.OK


def test_statistic_per_grain_and_aggregation_over_the_window(clock):
    """max per grain, min over the window: one quiet grain keeps the rule clear."""
    sampler = Fake(50.0)
    eng, health = engine(clock, rule(statistic="max", time_aggregation="min", time_window=180.0, cooldown=0.0),
                         sampler=sampler)
    run(eng, clock, 60)
    sampler.value = 99.0
    run(eng, clock, 120)
    assert state(health)[0] == HealthState.OK
    run(eng, clock, 180)
    assert state(health)[0] == HealthState.ERROR


def test_sampler_failures_turn_warning_after_three_and_are_counted(clock, logs):
    sampler = Fake()
    sampler.fail = ValueError("boom")
    eng, health = engine(clock, rule(state="Warning"), sampler=sampler)
    run(eng, clock, 30)
    s, text = state(health)
    assert s == HealthState.WARNING and "cannot sample" in text and "boom" in text
    assert eng.metrics.rule_sample_failures._value.get() == 3
    assert len([e for e in logs if e["event"] == "rule.sample_failed"]) == 1, "logged once per streak"


def test_command_metric_with_real_processes():
    sampler = SystemSampler()
    ok = rule(metric="command", command=(sys.executable, "-c", "print(42.5)"))
    assert sampler.sample(ok) == 42.5
    with pytest.raises(ValueError, match="not a number"):
        sampler.sample(rule(metric="command", command=(sys.executable, "-c", "print('lots')")))
    with pytest.raises(ValueError, match="exited 3"):
        sampler.sample(rule(metric="command", command=(sys.executable, "-c", "raise SystemExit(3)")))
    with pytest.raises(ValueError, match="cannot run"):
        sampler.sample(rule(metric="command", command=("/no/such/program",)))


def test_system_sampler_reads_sane_numbers():
    sampler = SystemSampler()
    for metric in ("cpu_percent", "memory_percent", "disk_percent"):
        assert 0.0 <= sampler.sample(rule(metric=metric, path="/" if metric == "disk_percent" else None)) <= 100.0
    assert sampler.sample(rule(metric="load1")) >= 0.0


def test_reload_keeps_unchanged_rules_and_removes_reports_of_deleted_ones(clock):
    eng, health = engine(clock, rule(), rule(name="mem", metric="memory_percent"), sampler=Fake(95.0))
    run(eng, clock, 70)
    kept = eng.states["cpu-hot"]
    eng.update((rule(),))
    assert eng.states["cpu-hot"] is kept
    assert {e.report.property for e in health.snapshot()} == {"cpu-hot"}


GOOD = "health_rules:\n  - {name: cpu-hot, metric: cpu_percent, operator: '>', threshold: 90}\n"


def test_rules_config_parses():
    cfg = loads(GOOD)
    assert cfg.health_rules[0].time_grain == 60 and cfg.health_rules[0].state == "Error"


@pytest.mark.parametrize("item, key", [
    ("{name: r, metric: cpu, operator: '>', threshold: 1}", "health_rules[0].metric"),
    ("{name: r, metric: command, operator: '>', threshold: 1}", "health_rules[0].command"),
    ("{name: r, metric: load1, operator: '>', threshold: 1, command: [x]}", "health_rules[0].command"),
    ("{name: r, metric: load1, operator: '>', threshold: 1, path: /var}", "health_rules[0].path"),
    ("{name: r, metric: load1, operator: '=>', threshold: 1}", "health_rules[0].operator"),
    ("{name: r, metric: load1, operator: '>', threshold: 1, time_grain: 5m, time_window: 1m}",
     "health_rules[0].time_window"),
    ("{name: r, metric: load1, operator: '>', threshold: high}", "health_rules[0].threshold"),
    ("{name: r, metric: load1, operator: '>', threshold: 1, state: Critical}", "health_rules[0].state"),
])
def test_bad_rules_are_refused_naming_the_key(item, key):
    with pytest.raises(ConfigError) as err:
        loads(f"health_rules:\n  - {item}\n", "maintd.yaml")
    assert err.value.key == key and err.value.line == 2


def test_duplicate_rule_names_are_refused():
    with pytest.raises(ConfigError) as err:
        loads(GOOD + "  - {name: cpu-hot, metric: load1, operator: '>', threshold: 4}\n", "maintd.yaml")
    assert err.value.key == "health_rules[1].name"
