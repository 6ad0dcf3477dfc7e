"""Three real agents (three ports on 127.0.0.1, static peers map) against one emulator."""

from __future__ import annotations

import os
import signal
import sys

import pytest

from tests.e2e.harness import free_port, wait_until

pytestmark = pytest.mark.e2e

VMS = ["vm-1", "vm-2", "vm-3"]
WAIT_FOR_GO = "import os, time\nwhile not os.path.exists(os.environ['GO']): time.sleep(0.05)\n"
SAY_STARTED = "import os\nopen(os.environ['STARTED'], 'w').close()\n"
SAY_DONE = "open(os.environ['DONE'], 'w').close()\n"
"""Around WAIT_FOR_GO: the hook says it runs and that it has ended, which the test waits for (`handler.started` is
logged before the hook's process exists: an agent frozen right after it had started none)."""


def fleet(start_emulator, start_agent, extra_for=lambda vm: {}, coordination=None):
    emu = start_emulator(VMS, "--started-duration", "5")  # each VM must see Started, even after a stalled poll
    ports = {vm: free_port() for vm in VMS}
    peers = {vm: f"http://127.0.0.1:{p}" for vm, p in ports.items()}
    agents = {}
    for vm in VMS:
        extra = {"coordination": {"peers": peers, "request_timeout": "500ms", **(coordination or {})},
                 **extra_for(vm)}
        agents[vm] = start_agent(emu, vm, extra, port=ports[vm])
    return emu, agents


def more_polls(emu, vms, n):
    """Wait until each of `vms` has polled IMDS `n` more times (each poll is one tick of its agent)."""
    seen = {vm: len(emu.requests(vm)) for vm in vms}
    wait_until(lambda: all(len(emu.requests(vm)) >= seen[vm] + n for vm in vms), 20, f"{n} more polls of {vms}")


def all_approvals(emu):
    return [a for vm in VMS for a in emu.approvals(vm)]


def test_one_post_per_event_and_none_while_a_peers_checkpoint_runs(start_emulator, start_agent, tmp_path):
    go = tmp_path / "go"
    checkpoint = {"handlers": [{"name": "checkpoint", "type": "exec", "phases": ["scheduled"],
                                "command": [sys.executable, "-c", WAIT_FOR_GO], "env": {"GO": str(go)}}]}
    emu, agents = fleet(start_emulator, start_agent, lambda vm: checkpoint if vm == "vm-3" else {})
    eid = emu.add_event(event_type="Reboot", resources=VMS, notice=300)
    for vm in VMS:
        agents[vm].wait_log("event.appeared", event_id=eid)
    skipped = agents["vm-1"].wait_log("approval.skipped", event_id=eid)
    assert "vm-3" in skipped["reason"] or "not ready" in skipped["reason"]
    polls = len(emu.requests("vm-1"))
    wait_until(lambda: len(emu.requests("vm-1")) >= polls + 10, 10, "ten more polls while vm-3 checkpoints")
    assert not all_approvals(emu), "no approval while a peer's checkpoint hook is still running"
    go.touch()
    agents["vm-1"].wait_log("approval.sent", event_id=eid)
    for vm in VMS:
        agents[vm].wait_log("event.status_changed", event_id=eid, status="Started")
    approvals = all_approvals(emu)
    assert len(approvals) == 1 and approvals[0]["vm"] == "vm-1", approvals
    assert not agents["vm-2"].events("approval.sent") and not agents["vm-3"].events("approval.sent")


def test_a_killed_leader_is_taken_over_but_never_approved_for_with_wait(start_emulator, start_agent):
    """S1: vm-2 leads once vm-1 is silent for takeover_after, says it cannot approve early, and never POSTs."""
    emu, agents = fleet(start_emulator, start_agent, coordination={"takeover_after": "2s"})
    agents["vm-1"].kill()
    eid = emu.add_event(event_type="Reboot", resources=VMS, notice=300)
    silent = agents["vm-2"].wait_log("approval.leader_silent", event_id=eid, timeout=20)
    assert silent["peers"] == ["vm-1"]
    health = agents["vm-2"].get("/v1/health").json()["HealthEvents"]
    assert any(r["Property"] == f"takeover/{eid}" and r["HealthState"] == "Warning" for r in health)
    polls = len(emu.requests("vm-2"))
    wait_until(lambda: len(emu.requests("vm-2")) >= polls + 5, 10, "five more polls")
    assert not all_approvals(emu)


def test_rank_1_takes_over_a_killed_leader_with_ignore(start_emulator, start_agent):
    emu, agents = fleet(start_emulator, start_agent, coordination={"takeover_after": "2s", "peer_timeout": "2s",
                                                                   "unreachable_peers": "ignore"})
    agents["vm-1"].kill()
    eid = emu.add_event(event_type="Reboot", resources=VMS, notice=300)
    sent = agents["vm-2"].wait_log("approval.sent", event_id=eid, timeout=20)
    assert sent["by"] == "vm-2"
    approvals = all_approvals(emu)
    assert len(approvals) == 1 and approvals[0]["vm"] == "vm-2"
    assert not agents["vm-3"].events("approval.sent")


def test_a_leader_paused_past_takeover_after_mid_checkpoint_gets_no_post_before_its_hook_ends(
        start_emulator, start_agent, tmp_path):
    """Issue 27, S1 end to end: the leader's checkpoint runs while the leader itself is frozen (SIGSTOP:
    its answers go silent for 4x takeover_after, its hook runs on). vm-2 takes over but, without vm-1's
    ready, never POSTs; the hook ends while vm-1 is still frozen: still no POST; vm-1 wakes and POSTs,
    once."""
    go, running, done = tmp_path / "go", tmp_path / "running", tmp_path / "done"
    checkpoint = {"handlers": [{"name": "checkpoint", "type": "exec", "phases": ["scheduled"],
                                "command": [sys.executable, "-c", SAY_STARTED + WAIT_FOR_GO + SAY_DONE],
                                "env": {"GO": str(go), "STARTED": str(running), "DONE": str(done)}}]}
    emu, agents = fleet(start_emulator, start_agent, lambda vm: checkpoint if vm == "vm-1" else {},
                        coordination={"takeover_after": "2s"})
    eid = emu.add_event(event_type="Reboot", resources=VMS, notice=300)
    agents["vm-1"].wait_log("handler.started", event_id=eid, handler="checkpoint")
    wait_until(running.exists, 30, "the leader's hook to run")
    leader = agents["vm-1"].proc.pid
    os.kill(leader, signal.SIGSTOP)
    try:
        # vm-2 says it leads (takeover_after of silence), vm-3 is ready: the old rule POSTed here; ten more
        # ticks of both (each a peer round) give it every chance to
        silent = agents["vm-2"].wait_log("approval.leader_silent", event_id=eid)
        assert silent["peers"] == ["vm-1"]
        more_polls(emu, ["vm-2", "vm-3"], 10)
        assert not all_approvals(emu), "no POST while the frozen leader's hook still runs"
        go.touch()  # the hook ends while its agent is still frozen: vm-1 has not said ready, nobody may POST
        wait_until(done.exists, 30, "the frozen leader's hook to end")
        more_polls(emu, ["vm-2", "vm-3"], 10)
        assert not all_approvals(emu), "a silent leader's readiness is never assumed"
    finally:
        os.kill(leader, signal.SIGCONT)
    agents["vm-1"].wait_log("approval.sent", event_id=eid, timeout=30)
    # vm-2's Warning goes once vm-1 answers again or the event is over, whichever vm-2 sees first: the
    # approval may start the event before vm-2's next peer round, and a Started event is never weighed again
    wait_until(lambda: not any(r["Property"] == f"takeover/{eid}"
                               for r in agents["vm-2"].get("/v1/health").json()["HealthEvents"]),
               20, "vm-2's takeover Warning to clear")
    polls = len(emu.requests("vm-2"))
    wait_until(lambda: len(emu.requests("vm-2")) >= polls + 3, 10, "three more polls")
    approvals = all_approvals(emu)
    assert len(approvals) == 1 and approvals[0]["vm"] == "vm-1", approvals


def test_no_approval_inside_a_never_profile(start_emulator, start_agent):
    never = {"profiles": [{"name": "freeze", "approval": "never"}]}
    emu, agents = fleet(start_emulator, start_agent, lambda vm: never)
    eid = emu.add_event(event_type="Reboot", resources=VMS, notice=300)
    skipped = agents["vm-1"].wait_log("approval.skipped", event_id=eid)
    assert "never" in skipped["reason"]
    polls = len(emu.requests("vm-1"))
    wait_until(lambda: len(emu.requests("vm-1")) >= polls + 10, 10, "ten more polls")
    assert not all_approvals(emu)
    assert agents["vm-1"].get("/v1/status").json()["profile"] == "freeze"
