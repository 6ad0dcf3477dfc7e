"""Approval policy: rules, profiles, and the pure approval decision."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from agent.errors import ConfigValueError
from agent.model.events import Event
from agent.policy.approval_policy import ApprovalRule, Profile, decide, in_force, parse_profiles


def ev(etype="Reboot", source="Platform", duration=-1, description=""):
    return Event("E1", etype, "Scheduled", ("vm1", "vm2"), source=source, duration_seconds=duration,
                 description=description)


GUIDANCE = Profile(name="default", approval="auto", rules=(
    ApprovalRule(approval="immediate", event_sources=("User",)),
    ApprovalRule(approval="immediate", event_types=("Freeze",), max_duration_seconds=9),
))


@pytest.mark.parametrize("event,mode,rule", [
    (ev(source="User"), "immediate", 0),
    (ev("Freeze", duration=5), "immediate", 1),
    (ev("Freeze", duration=30), "auto", None),
    (ev("Freeze", duration=-1), "auto", None),
    (ev("Redeploy"), "auto", None),
])
def test_microsoft_listener_guidance_rules(event, mode, rule):
    """User events and Freezes under 9 s are immediate; the rest wait for handlers (first match wins)."""
    assert GUIDANCE.approval_for(event) == (mode, rule)


def test_live_migration_rule():
    """live_migration: false excludes live migrations from a rule."""
    p = Profile(name="p", approval="auto", rules=(ApprovalRule(approval="never", event_types=("Freeze",),
                                                                live_migration=False),))
    assert p.approval_for(ev("Freeze", description="memory-preserving Live Migration"))[0] == "auto"
    assert p.approval_for(ev("Freeze", description="host maintenance"))[0] == "never"


BASE = dict(mode="auto", status="Scheduled", already_sent=False, manual_requested=False, local_pending=[],
            peers_not_ready=[], lower_ranked_reachable=[], dry_run=False)


@pytest.mark.parametrize("changes,approve,words", [
    ({}, True, "every affected VM is ready"),
    ({"status": "Started"}, False, "Started"),
    ({"already_sent": True}, False, "already"),
    ({"mode": "never"}, False, "never"),
    ({"mode": "manual"}, False, "maintd approve"),
    ({"mode": "manual", "manual_requested": True}, True, "operator"),
    ({"mode": "manual", "manual_requested": True, "local_pending": ["drain"]}, False,
     "waiting for local handlers: drain"),
    ({"local_pending": ["checkpoint"]}, False, "checkpoint"),
    ({"peers_not_ready": ["vm2"]}, False, "vm2"),
    ({"lower_ranked_reachable": ["vm0"]}, False, "not the leader"),
    ({"mode": "immediate", "local_pending": ["checkpoint"], "peers_not_ready": ["vm2"]}, True, "immediate"),
    ({"dry_run": True}, False, "dry run"),
])
def test_decide(changes, approve, words):
    """Each condition that holds an approval back says why; only a ready leader under auto sends it."""
    d = decide(**{**BASE, **changes})
    assert d.approve is approve and words in d.reason


def test_profiles_default_and_fixed_date_selection():
    """A fixed-date change freeze wins over the default while it lasts."""
    profiles = parse_profiles([
        {"name": "freeze", "fixed_date": {"start": "2026-12-20T00:00:00Z", "end": "2027-01-04T00:00:00Z"},
         "approval": "never"},
        {"name": "default", "approval": "auto"},
    ])
    inside, _ = in_force(profiles, datetime(2026, 12, 24, tzinfo=UTC))
    outside, selection = in_force(profiles, datetime(2026, 12, 1, tzinfo=UTC))
    assert (inside.name, outside.name) == ("freeze", "default")
    assert selection.next_change == datetime(2026, 12, 20, tzinfo=UTC)


def test_profiles_need_exactly_one_default_and_unique_names():
    """Two defaults, no default, or a repeated name are config errors."""
    with pytest.raises(ConfigValueError):
        parse_profiles([{"name": "a"}, {"name": "b"}])
    with pytest.raises(ConfigValueError, match="used twice"):
        parse_profiles([{"name": "a"}, {"name": "a", "fixed_date": {"start": "2026-01-01T00:00:00Z",
                                                                     "end": "2026-01-02T00:00:00Z"}}])


def test_no_profiles_means_one_default_auto():
    """Leaving profiles out approves every event once all affected VMs are ready."""
    (p,) = parse_profiles(None)
    assert (p.name, p.approval, p.schedule) == ("default", "auto", None)
