"""The plan: when preparation starts and from when approval may be sent, on a fake clock (pure)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from agent.config.config import loads
from agent.errors import ConfigError
from agent.model.events import Event
from agent.policy.approval_policy import NOW, parse_profiles
from agent.prepare.prepare_plan import PrepareConfig, first_window, make_plan, with_coordination

UTC = UTC
MONDAY_10 = datetime(2026, 1, 5, 10, 0, tzinfo=UTC)  # a Monday

BUSINESS_HOURS_AND_NIGHTLY = parse_profiles([
    {"name": "business-hours", "approval": "never",
     "recurrence": {"frequency": "week", "schedule": {"hours": [8], "minutes": [0], "week_days":
                                                     ["monday", "tuesday", "wednesday", "thursday", "friday"]}}},
    {"name": "nightly", "approval": "auto",
     "recurrence": {"frequency": "day", "schedule": {"hours": [22], "minutes": [0]}}},
    {"name": "default", "approval": "never"},
])
CHANGE_FREEZE = parse_profiles([
    {"name": "freeze", "approval": "never",
     "fixed_date": {"start": "2026-12-20T00:00:00Z", "end": "2027-01-04T00:00:00Z"}},
    {"name": "default", "approval": "auto"},
])
ALWAYS_AUTO = parse_profiles(None)


def ev(etype="Reboot", notice=timedelta(days=3), now=MONDAY_10, source="Platform"):
    return Event("E1", etype, "Scheduled", ("vm1",), not_before=now + notice, source=source)


def at(text):
    return datetime.fromisoformat(text).replace(tzinfo=UTC)


def prepare(lead=NOW, **by_type):
    return PrepareConfig(lead_time=lead, lead_time_by_type=by_type)


def test_a_reboot_three_days_ahead_prepares_before_the_night_window_and_approves_inside_it():
    """Business hours `never` + nightly `auto`: prepare at 22:00 − 30 min on the first night,
    approve from 22:00 until business hours start again; NotBefore three days later does not matter."""
    p = make_plan(ev(), BUSINESS_HOURS_AND_NIGHTLY, prepare(Reboot=1800.0), MONDAY_10)
    assert (p.prepare_at, p.prepare_reason) == (at("2026-01-05T21:30:00"), "window")
    assert (p.approve_not_before, p.approve_reason) == (at("2026-01-05T22:00:00"), "window")
    assert p.window is not None and p.window.profile == "nightly" and p.window.end == at("2026-01-06T08:00:00")
    assert not p.due(at("2026-01-05T21:29:59")) and p.due(at("2026-01-05T21:30:00"))
    assert p.to_json()["lead_time"] == "30m" and p.to_json()["not_before"] == "2026-01-08T10:00:00Z"


def test_a_preempt_prepares_at_once_whatever_the_profile():
    """Preempt: now by type, or its 30 s notice is shorter than any lead time; either way at once."""
    for config in (prepare(3600.0, Preempt=NOW), prepare(600.0)):
        p = make_plan(ev("Preempt", timedelta(seconds=30)), BUSINESS_HOURS_AND_NIGHTLY, config, MONDAY_10)
        assert p.prepare_at == MONDAY_10 and p.due(MONDAY_10)
        assert p.approve_reason == "no_window", "business hours never: this VM does not approve it"
    assert make_plan(ev("Preempt", timedelta(seconds=30)), BUSINESS_HOURS_AND_NIGHTLY, prepare(600.0),
                     MONDAY_10).prepare_detail.endswith("at once")


def test_a_change_freeze_holds_preparation_until_notbefore_minus_lead_time():
    """Inside a freeze that lasts past NotBefore there is no window: prepare at NotBefore − 2h, never approve."""
    now = at("2026-12-22T09:00:00")
    p = make_plan(ev(notice=timedelta(days=2), now=now), CHANGE_FREEZE, prepare(7200.0), now)
    assert (p.prepare_at, p.prepare_reason) == (at("2026-12-24T07:00:00"), "lead_time")
    assert p.approve_not_before is None and p.approve_reason == "no_window"
    assert "no window before NotBefore" in p.approve_detail


def test_the_end_of_a_freeze_before_notbefore_is_the_window():
    """NotBefore after the freeze: prepare lead time before the freeze ends, approve when it has."""
    now = at("2026-12-30T09:00:00")
    p = make_plan(ev(notice=timedelta(days=7), now=now), CHANGE_FREEZE, prepare(3600.0), now)
    assert (p.prepare_at, p.prepare_reason) == (at("2027-01-03T23:00:00"), "window")
    assert p.approve_not_before == at("2027-01-04T00:00:00") and p.window and p.window.end is None


def test_the_default_config_prepares_every_event_at_first_sight():
    """lead_time now (the default) is today's behaviour, under any profile."""
    for profiles in (ALWAYS_AUTO, BUSINESS_HOURS_AND_NIGHTLY, CHANGE_FREEZE):
        p = make_plan(ev(), profiles, PrepareConfig(), MONDAY_10)
        assert (p.prepare_at, p.prepare_reason) == (MONDAY_10, "now")


def test_a_profile_allowing_approval_now_prepares_now_whatever_the_lead_time():
    p = make_plan(ev(), ALWAYS_AUTO, prepare(3600.0), MONDAY_10)
    assert (p.prepare_at, p.prepare_reason, p.approve_not_before) == (MONDAY_10, "now", MONDAY_10)
    assert "allows approval (auto) now" in p.prepare_detail


def test_lead_time_precedence_type_then_profile_then_global():
    profiles = parse_profiles([{"name": "freeze", "approval": "never", "lead_time": "1h",
                                "fixed_date": {"start": "2026-12-20T00:00:00Z", "end": "2027-01-04T00:00:00Z"}},
                               {"name": "default", "approval": "auto"}])
    now = at("2026-12-22T09:00:00")
    event = ev(notice=timedelta(days=1), now=now)
    assert make_plan(event, profiles, prepare(7200.0), now).prepare_at == at("2026-12-23T08:00:00"), "profile wins"
    assert make_plan(event, profiles, prepare(7200.0, Reboot=600.0), now).prepare_at == at("2026-12-23T08:50:00")
    assert make_plan(event, CHANGE_FREEZE, prepare(7200.0), now).prepare_at == at("2026-12-23T07:00:00")


def test_a_window_lead_time_now_prepares_at_once():
    """`now` before a window means: prepare at first sight, then wait for the window to approve."""
    profiles = parse_profiles([{"name": "nightly", "approval": "auto", "lead_time": "now",
                                "recurrence": {"frequency": "day", "schedule": {"hours": [22], "minutes": [0]}}},
                               {"name": "day", "approval": "never",
                                "recurrence": {"frequency": "day", "schedule": {"hours": [6], "minutes": [0]}}},
                               {"name": "default", "approval": "never"}])
    p = make_plan(ev(), profiles, prepare(3600.0), MONDAY_10)
    assert (p.prepare_at, p.prepare_reason, p.approve_not_before) == (MONDAY_10, "window", at("2026-01-05T22:00:00"))


def test_a_manual_profile_waits_for_an_operator():
    profiles = parse_profiles([{"name": "default", "approval": "manual"}])
    p = make_plan(ev(), profiles, prepare(600.0), MONDAY_10)
    assert p.prepare_at == MONDAY_10 + timedelta(days=3, minutes=-10)
    assert (p.approve_not_before, p.approve_reason) == (None, "operator")


def test_a_rule_decides_whether_a_window_allows_this_event():
    """A window whose rules say never for Redeploy is no window for a Redeploy."""
    profiles = parse_profiles([
        {"name": "day", "approval": "never",
         "recurrence": {"frequency": "day", "schedule": {"hours": [6], "minutes": [0]}}},
        {"name": "nightly", "approval": "auto", "rules": [{"approval": "never", "event_types": ["Redeploy"]}],
         "recurrence": {"frequency": "day", "schedule": {"hours": [22], "minutes": [0]}}},
        {"name": "default", "approval": "never"}])
    assert make_plan(ev("Reboot"), profiles, prepare(600.0), MONDAY_10).approve_reason == "window"
    redeploy = make_plan(ev("Redeploy"), profiles, prepare(600.0), MONDAY_10)
    assert redeploy.approve_reason == "no_window" and redeploy.prepare_reason == "lead_time"


def test_a_window_opening_only_after_notbefore_is_no_window():
    now = at("2026-12-30T09:00:00")
    assert first_window(ev(notice=timedelta(days=1), now=now), CHANGE_FREEZE, now, now + timedelta(days=1)) is None
    assert first_window(ev(notice=timedelta(days=1), now=now), CHANGE_FREEZE, now, at("2027-01-04T00:00:00")) is None


def test_an_event_without_notbefore_prepares_at_once():
    event = Event("E1", "Reboot", "Scheduled", ("vm1",))
    p = make_plan(event, CHANGE_FREEZE, prepare(3600.0), at("2026-12-22T09:00:00"))
    assert p.prepare_reason == "now" and p.not_before is None


def test_the_coordinator_view_says_what_holds_the_approval():
    plan = make_plan(ev(), ALWAYS_AUTO, prepare(), MONDAY_10).to_json()
    gate = with_coordination(plan, {"approval_held": {"gate": "fleet", "reason": "2 of 5 VMs unhealthy"}})
    assert gate["approve_reason"] == "gate" and "fleet" in gate["approve_detail"]
    peers = with_coordination(plan, {"approval_decision": "waiting for peers: vm2"})
    assert peers["approve_reason"] == "peers"
    assert with_coordination(plan, {"approval_decision": "already approved"}) == plan


@pytest.mark.parametrize("yaml_text,line,words", [
    ("prepare:\n  lead_time: -5m\n", 2, "negative"),
    ("prepare:\n  lead_time: 8d\n", 2, "longer than any notice Azure gives"),
    ("prepare:\n  lead_time_by_type:\n    Reboot: 10m\n    Preempt: -1\n", 4, "negative"),
    ("prepare:\n  lead_time_by_type:\n    reboot: 10m\n", 3, "Reboot"),
    ("profiles:\n  - name: default\n    lead_time: 30d\n", 3, "longer"),
    ("prepare:\n  lead_time: soon\n", 2, "neither now nor a duration"),
])
def test_bad_lead_times_are_refused_with_file_and_line(yaml_text, line, words):
    with pytest.raises(ConfigError) as caught:
        loads(yaml_text, "maintd.yaml")
    assert f"maintd.yaml:{line}" in str(caught.value) and words in str(caught.value)


def test_lead_times_parse():
    cfg = loads("prepare:\n  lead_time: 2h\n  lead_time_by_type: {Reboot: PT10M, Preempt: now}\n"
                "profiles:\n  - name: default\n    lead_time: 7d\n")
    assert cfg.prepare == PrepareConfig(7200.0, {"Reboot": 600.0, "Preempt": NOW})
    assert cfg.profiles[0].lead_time == 7 * 86400.0
    assert loads("").prepare.lead_time == NOW


def test_inside_an_open_window_the_plan_says_since_when_and_until_when():
    """At 23:00 the night window opened at 22:00: prepare now, approval allowed from 22:00 until 08:00."""
    now = at("2026-01-05T23:00:00")
    p = make_plan(ev(now=now), BUSINESS_HOURS_AND_NIGHTLY, prepare(1800.0), now)
    assert (p.prepare_at, p.prepare_reason) == (now, "now")
    assert p.window and (p.window.start, p.window.end) == (at("2026-01-05T22:00:00"), at("2026-01-06T08:00:00"))
    assert p.approve_not_before == at("2026-01-05T22:00:00")


def test_a_window_is_found_among_profiles_that_change_every_few_minutes():
    """Two `never` profiles alternating every 30 minutes, and a Saturday 02:00 `auto` one: the window
    is Saturday 02:00 until the next alternation, and a hidden default opens when a freeze ends."""
    profiles = parse_profiles([
        {"name": "a", "approval": "never", "recurrence": {"frequency": "hour", "schedule": {"minutes": [0]}}},
        {"name": "b", "approval": "never", "recurrence": {"frequency": "hour", "schedule": {"minutes": [30]}}},
        {"name": "saturday", "approval": "auto",
         "recurrence": {"frequency": "week", "schedule": {"week_days": ["saturday"], "hours": [2], "minutes": [10]}}},
        {"name": "default", "approval": "never"}])
    w = first_window(ev(notice=timedelta(days=7)), profiles, MONDAY_10, MONDAY_10 + timedelta(days=7))
    assert w and (w.profile, w.start, w.end) == ("saturday", at("2026-01-10T02:10:00"), at("2026-01-10T02:30:00"))
    assert first_window(ev(), profiles, MONDAY_10, at("2026-01-10T02:10:00")) is None
