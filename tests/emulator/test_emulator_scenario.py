"""Scenario files: parsing with errors that name the key, and playing a timeline on a fake clock."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.clock import FakeClock
from agent.emulator import Emulator
from agent.emulator.scenario import ScenarioError, load, parse

SHIPPED = sorted((Path(__file__).resolve().parents[2] / "config" / "scenarios").glob("*.yaml"))


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_the_shipped_scenarios_parse(path):
    """config/scenarios/*.yaml stay valid."""
    scenario = load(path)
    assert scenario.vms and scenario.steps


def test_a_scenario_becomes_ordered_steps_with_emulator_arguments():
    """Keys map to add_event/add_fault arguments; *_at keys become their own steps; steps sorted by time."""
    s = parse("""
vms: [web-1, web-2]
time_scale: 60
started_duration: 600
events:
  - {at: 60, type: Reboot, resources: [web-2], notice: 900, source: User, description: d, cancel_at: 300, id: E-1}
  - {at: 0, type: Freeze, resources: [web-1, web-2], duration: 5}
faults:
  - {at: 30, kind: status, status: 503, vm: web-1, duration: 20}
""")
    assert (s.vms, s.time_scale, s.started_duration) == (["web-1", "web-2"], 60.0, 600.0)
    assert [(st.at, st.action) for st in s.steps] == [(0, "add"), (30, "fault"), (60, "add"), (300, "cancel")]
    assert s.steps[2].args == {"event_type": "Reboot", "resources": ["web-2"], "status": "Scheduled",
                               "description": "d", "event_source": "User", "duration_seconds": -1,
                               "event_id": "E-1", "notice": 900.0}
    assert "notice" not in s.steps[0].args, "no notice: the type's documented minimum"
    assert s.steps[1].args == {"kind": "status", "status": 503, "vm": "web-1", "duration": 20}
    assert s.steps[3].args == {"event_id": "E-1"}


@pytest.mark.parametrize("text, error", [
    ("[1, 2]", "scenario: expected a mapping"),
    ("nonsense: 1", "scenario.nonsense: unknown key"),
    ("vms: []", "vms: expected a non-empty list"),
    ("vms: [a, a]", "vms: expected a non-empty list of distinct"),
    ("vms: [a]\nvms: [b]\n", "line 2: vms: duplicate key"),
    ("time_scale: 0", "time_scale: must be above 0"),
    ("events: {a: 1}", "events: expected a list"),
    ("events: [{at: 0}]", "events[0].type: required"),
    ("events: [{type: Reboot, notice: -5}]", "events[0].notice: expected seconds >= 0"),
    ("events: [{type: Reboot, bogus: 1}]", "events[0].bogus: unknown key"),
    ("events: [{type: Reboot, at: 10, cancel_at: 5}]", "events[0].cancel_at: 5 is before"),
    ("events: [{type: Reboot, status: Done}]", "events[0].status: expected Scheduled or Started"),
    ("events: [{type: Reboot, duration: 1.5}]", "events[0].duration: expected whole seconds"),
    ("events: [{type: Reboot, resources: []}]", "events[0].resources: expected a non-empty list"),
    ("events: [{type: Reboot, id: X}, {type: Freeze, id: X}]", "events: two events have the same id"),
    ("faults: [{at: 1}]", "faults[0].kind: required"),
    ("faults: [{kind: explode}]", "faults[0].kind: unknown fault kind"),
    ("faults: [{kind: status, status: 200}]", "faults[0].status: expected an HTTP error status"),
    ("faults: [{kind: status, vm: nope}]", "faults[0].vm: 'nope' is not one of vms"),
    ("faults: [{kind: hang, duration: soon}]", "faults[0].duration: expected seconds >= 0"),
    ("events: [", "not valid YAML"),
])
def test_errors_name_the_key(text, error):
    """Every refusal says where: `events[0].notice: ...`."""
    with pytest.raises(ScenarioError) as info:
        parse(text)
    assert str(info.value).startswith(error)


def test_load_prefixes_errors_with_the_file(tmp_path):
    """The file name leads, for a missing file too."""
    bad = tmp_path / "s.yaml"
    bad.write_text("events: [{type: Reboot, at: -1}]")
    with pytest.raises(ScenarioError, match=rf"^{bad}: events\[0\].at: "):
        load(bad)
    with pytest.raises(ScenarioError, match="cannot read"):
        load(tmp_path / "missing.yaml")


def test_playing_a_scenario_follows_the_clock_in_emulated_seconds(clock: FakeClock):
    """At time_scale 10, `at: 10` is one clock second; cancel and start steps act on the scenario's event."""
    s = parse("""
vms: [vm-1]
time_scale: 10
events:
  - {at: 10, type: Reboot, notice: 600, id: A, cancel_at: 20}
  - {at: 10, type: Freeze, notice: 600, id: B, start_at: 15, complete_at: 25}
faults:
  - {at: 5, kind: status, status: 500, duration: 10}
""")
    steps: list[tuple[str, str]] = []
    emu = Emulator(s.vms, clock=clock, time_scale=s.time_scale,
                   listener=lambda name, fields: steps.append((name, fields.get("action", ""))))
    emu.play(s)
    assert emu.document("vm-1")["Events"] == []
    clock.advance(0.5)
    emu.tick()
    assert emu.fault_count() == 1
    clock.advance(0.5)
    emu.tick()
    assert [e["EventId"] for e in emu.document("vm-1")["Events"]] == ["A", "B"]
    clock.advance(0.5)
    emu.tick()
    assert emu.fault_count() == 0, "the fault's 10 emulated seconds are over"
    assert [(e["EventId"], e["EventStatus"]) for e in emu.document("vm-1")["Events"]] == \
        [("A", "Scheduled"), ("B", "Started")]
    clock.advance(1.0)
    emu.tick()
    assert emu.document("vm-1")["Events"] == []
    assert [a for name, a in steps if name == "scenario.step"] == ["fault", "add", "add", "start", "cancel", "complete"]


def test_a_step_that_no_longer_applies_is_skipped_not_fatal(clock: FakeClock):
    """Canceling an event the agent already got started is logged as skipped; the timeline goes on."""
    s = parse("events:\n  - {at: 0, type: Reboot, notice: 600, id: A, cancel_at: 10}\n"
              "  - {at: 20, type: Freeze, id: B}\n")
    heard: list[tuple[str, dict]] = []
    emu = Emulator(s.vms, clock=clock, listener=lambda name, fields: heard.append((name, fields)))
    emu.play(s)
    emu.start_event("A")
    clock.advance(20)
    emu.tick()
    skipped = [f for name, f in heard if name == "scenario.skipped"]
    assert len(skipped) == 1 and skipped[0]["action"] == "cancel" and "only a Scheduled event" in skipped[0]["reason"]
    assert "B" in [e["EventId"] for e in emu.document("vm-1")["Events"]]
