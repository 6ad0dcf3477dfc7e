"""The store backend under faults, with real agents and Azurite: a claimer killed before its POST, the store gone
mid-event, a VM that never becomes ready."""

from __future__ import annotations

import signal
import time
from datetime import datetime
from pathlib import Path

import pytest

import tests.needs_azure  # noqa: F401 - skips this module without the azure extra
from tests.azurite import start
from tests.e2e.harness import wait_until
from tests.e2e.test_store_e2e import FLEX, hook, metric, store_config

pytestmark = pytest.mark.e2e


def approvals(emu, vms: list[str]) -> list[dict]:
    return [a for vm in vms for a in emu.approvals(vm)]


def more_polls(emu, vms: list[str], n: int = 10) -> None:
    """Wait until each of `vms` has polled IMDS `n` more times: each poll is one tick of its agent, a chance to
    POST (a wait that proves something does not happen, as short as a few ticks of every VM)."""
    seen = {vm: len(emu.requests(vm)) for vm in vms}
    wait_until(lambda: all(len(emu.requests(vm)) >= seen[vm] + n for vm in vms), 30, f"{n} more polls of {vms}")


def fleet(start_emulator, start_agent, tmp_path: Path, server, hook_seconds: tuple[float, ...]):
    """Agents with Flexible names on one new container, each with a hook of its own length (and its
    `done` marker file): (emulator, VM names, agents by name, the done dir, the container)."""
    container = server.new_container()
    vms = FLEX[:len(hook_seconds)]
    emu = start_emulator(vms)
    done = tmp_path / "done"
    done.mkdir()
    agents = {vm: start_agent(emu, vm, {**store_config(server, container, tmp_path / f"{vm}-conf"),
                                        **hook(seconds, done)}) for vm, seconds in zip(vms, hook_seconds, strict=True)}
    return emu, vms, agents, done, container


def test_a_claimer_killed_between_claim_and_post_is_taken_over_with_one_post_in_all(
        start_emulator, start_agent, tmp_path: Path) -> None:
    """The slowest VM claims; its POST hangs at IMDS; it is killed (SIGKILL) holding the claim. Another VM takes
    the claim over once it is takeover_after (4 s) old on the store's clock and sends the only POST."""
    server = start(tmp_path)
    try:
        emu, vms, agents, done, container = fleet(start_emulator, start_agent, tmp_path, server, (0.5, 0.5, 2.0))
        claimer = vms[2]
        emu.admin("POST", "faults", claimer, vm=claimer, kind="hang", path="/metadata/scheduledevents",
                  method="POST")
        eid = emu.add_event(event_type="Reboot", resources=vms, notice=300)
        claimed = agents[claimer].wait_log("store.claimed", event_id=eid, timeout=30)
        agents[claimer].proc.send_signal(signal.SIGKILL)
        agents[claimer].proc.wait(5)
        wait_until(lambda: approvals(emu, vms), 40, "the takeover's approval")
        # from the claim itself (its log line's time), not from the kill: the test sees the line, and kills, late
        # on a loaded host; the store's whole-second clock makes an age up to 1 s long, the line comes a little
        # after the write
        took = approvals(emu, vms)[0]["time"] - datetime.fromisoformat(claimed["timestamp"]).timestamp()
        assert [a["vm"] for a in approvals(emu, vms)] != [claimer] and len(approvals(emu, vms)) == 1
        assert 2.5 <= took <= 4 + 10 + 5, f"takeover {took:.1f}s after the claim"
        assert any(e.get("event_id") == eid for vm in vms[:2] for e in agents[vm].events("store.claimed"))
    finally:
        server.stop()


def test_the_store_gone_mid_event_holds_the_approval_warns_and_recovers(start_emulator, start_agent,
                                                                        tmp_path: Path) -> None:
    """Azurite stops while the last VM is still preparing: no POST, a Warning `coordination`/`store` report and
    store failures in the metric, and the polls keep their 100 ms cadence throughout; Azurite back (empty: in
    memory), the agents rewrite their markers by themselves and the one POST goes out."""
    server = start(tmp_path)
    try:
        emu, vms, agents, done, container = fleet(start_emulator, start_agent, tmp_path, server, (0.2, 4.0))
        eid = emu.add_event(event_type="Reboot", resources=vms, notice=300)
        agents[vms[0]].wait_log("store.listed", event_id=eid, timeout=20)
        server.stop()
        down_at = time.time()
        slow = agents[vms[1]]
        slow.wait_log("store.request_failed", timeout=30)
        wait_until(lambda: (done / f"{vms[1]}.done").exists(), 20, "the slow hook")
        more_polls(emu, vms)
        assert approvals(emu, vms) == []
        polls = [r["time"] for r in emu.requests(vms[1]) if "scheduledevents" in r["path"] and r["time"] >= down_at]
        # a poll waiting on the store's 2 retries would stall >= 2 s (their 1 s backoffs); a loaded host alone
        # stalls up to ~1 s
        assert max(b - a for a, b in zip(polls, polls[1:], strict=False)) < 1.5, "the poll loop waited on the store"
        health = slow.get("/v1/health").json()["HealthEvents"]
        assert any(r["SourceId"] == "coordination" and r["Property"] == "store" and r["HealthState"] == "Warning"
                   for r in health), health
        assert metric(slow, "maintd_store_requests_total", outcome="unreachable") > 0
        server.start()
        server.create_container(container)
        wait_until(lambda: approvals(emu, vms), 60, "the approval after the store came back")
        slow.wait_log("store.recovered", timeout=15)
        assert len(approvals(emu, vms)) == 1
    finally:
        server.stop()


def test_a_vm_that_never_becomes_ready_means_no_post_and_the_event_starts_at_not_before(
        start_emulator, start_agent, tmp_path: Path) -> None:
    """One VM's hook never ends: nobody claims, no POST; the platform starts the event at NotBefore."""
    server = start(tmp_path)
    try:
        emu, vms, agents, done, container = fleet(start_emulator, start_agent, tmp_path, server, (0.2, 600))
        eid = emu.add_event(event_type="Reboot", resources=vms, notice=8)

        def started() -> bool:
            events = emu.admin("GET", "events", vms[0])["Events"]
            return bool(events) and events[0]["EventStatus"] == "Started"

        wait_until(started, 30, "the platform to start the event at NotBefore")
        assert eid
        assert approvals(emu, vms) == []
        assert not any(a.events("store.claimed") for a in agents.values())
    finally:
        server.stop()


def test_an_approval_record_with_an_empty_attempt_is_taken_over_and_one_post_goes(
        start_emulator, start_agent, tmp_path: Path) -> None:
    """An `approval` blob whose `attempt` is empty is in the event's folder before any VM looks: it is a problem,
    one summary line, and the record is taken over once it is takeover_after (4 s) old: one POST (today: the
    parse raises on every VM, their lanes stay busy, 0 POSTs)."""
    from azure.storage.blob import ContainerClient

    from agent.coordination.store.store_protocol import CLAIMED, approval_blob, approval_record

    server = start(tmp_path)
    try:
        emu, vms, agents, done, container = fleet(start_emulator, start_agent, tmp_path, server, (0.5, 0.5, 0.5))
        eid = "0D6F4B8E-1C2A-4E3B-9F70-5A6B7C8D9E0F"
        odd = {**approval_record(eid, vms[0], CLAIMED, 1), "attempt": ""}
        with ContainerClient.from_connection_string(server.connection_string(), container) as client:
            client.upload_blob(approval_blob(eid), b"", metadata=odd)
        emu.add_event(event_type="Reboot", resources=vms, notice=300, event_id=eid)
        wait_until(lambda: approvals(emu, vms), 40, "the POST after the unreadable record was taken over")
        more_polls(emu, vms)
        assert len(approvals(emu, vms)) == 1
        lines = [e for a in agents.values() for e in a.events("store.invalid_record")]
        assert lines and all(e["count"] == 1 for e in lines)
        assert not any(a.events("lane.internal_error") for a in agents.values())
    finally:
        server.stop()


def test_a_forged_ready_marker_is_noticed_rewritten_and_no_post_before_the_victims_hook_ends(
        start_emulator, start_agent, tmp_path: Path) -> None:
    """While the victim's 8 s hook runs, something holding the container's role writes `ready` under its name.
    The victim notices at its next check (store.marker_forged), writes `preparing` again and reports Error
    `coordination`/`store_marker`; the other VM, ready at 5 s, waits, and the one POST comes after the victim's
    hook (today: the forged `ready` stands, the POST goes at ~5 s, 3 s before the victim is done)."""
    from azure.storage.blob import ContainerClient

    from agent.coordination.store.store_protocol import PREPARING, READY, marker_blob, marker_record

    server = start(tmp_path)
    try:
        emu, vms, agents, done, container = fleet(start_emulator, start_agent, tmp_path, server, (8.0, 5.0))
        victim = vms[0]
        eid = emu.add_event(event_type="Reboot", resources=vms, notice=300)
        agents[victim].wait_log("handler.started", timeout=20)
        with ContainerClient.from_connection_string(server.connection_string(), container) as client:
            blob = client.get_blob_client(marker_blob(eid, victim))
            # forged over the victim's own `preparing`, not before it (the victim would overwrite it unseen)
            wait_until(lambda: blob.exists() and blob.get_blob_properties().metadata.get("state") == PREPARING, 20,
                       "the victim's `preparing` marker in the store")
            client.upload_blob(marker_blob(eid, victim), b"", metadata=marker_record(eid, victim, READY),
                               overwrite=True)
        agents[victim].wait_log("store.marker_forged", event_id=eid, timeout=20)
        health = agents[victim].get("/v1/health").json()["HealthEvents"]
        assert any(r["SourceId"] == "coordination" and r["Property"] == "store_marker" and r["HealthState"] == "Error"
                   for r in health), health
        wait_until(lambda: approvals(emu, vms), 60, "the one POST")
        ended = float((done / f"{victim}.done").read_text())
        assert len(approvals(emu, vms)) == 1
        assert approvals(emu, vms)[0]["time"] >= ended, "POSTed before the victim's hook ended"
    finally:
        server.stop()


def test_a_50_mb_listing_is_refused_with_little_memory_and_the_polls_keep_their_cadence(
        start_emulator, start_agent, tmp_path: Path) -> None:
    """The store (or something in its place) answers the event's listing with ~50 MB of junk, again and again:
    each answer is dropped after 4 MiB (`too_large`), the agent's peak RSS stays far below the answer, no POST,
    a Warning `coordination`/`store`, a few log lines, and the IMDS polls keep their cadence (today: 863 MB RSS,
    a 5 s stall, 80,784 log lines)."""
    import os

    from tests.store.test_store_listing import JunkStore

    junk = JunkStore(160_000)
    try:
        vm = FLEX[0]
        emu = start_emulator([vm])
        conf = tmp_path / "conf"
        conf.mkdir()
        (conf / "storage.conn").write_text(junk.connection_string())
        os.chmod(conf / "storage.conn", 0o600)
        agent = start_agent(emu, vm, {"coordination": {
            "backend": "azure_blob", "takeover_after": "4s",
            "azure_blob": {"container": "junk", "connection_string_file": str(conf / "storage.conn")}}})
        emu.add_event(event_type="Reboot", resources=[vm], notice=300)
        since = time.time()
        wait_until(lambda: metric(agent, "maintd_store_requests_total", op="list", outcome="too_large") >= 3, 60,
                   "three listings refused")
        status = Path(f"/proc/{agent.proc.pid}/status").read_text()
        peak_mb = int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM"))) / 1024
        assert peak_mb < 200, f"peak RSS {peak_mb:.0f} MB"
        assert approvals(emu, [vm]) == []
        health = agent.get("/v1/health").json()["HealthEvents"]
        assert any(r["Property"] == "store" and r["HealthState"] == "Warning" and "too_large" in r["Description"]
                   for r in health), health
        assert len(agent.events()) < 200
        polls = [r["time"] for r in emu.requests(vm) if "scheduledevents" in r["path"] and r["time"] >= since]
        gap = max(b - a for a, b in zip(polls, polls[1:], strict=False))
        print(f"peak RSS {peak_mb:.0f} MB after {junk.lists} listings of ~50 MB ({junk.sent / 2**20:.1f} MiB sent in "
              f"all), largest poll gap {gap * 1000:.0f} ms, {len(agent.events())} log lines")
        assert gap < 2.0, "the poll loop waited on the store (5 s before the cap; a loaded host alone stalls ~1 s)"
    finally:
        junk.stop()


def test_a_claimer_paused_after_its_claim_posts_nothing_once_another_vm_took_over(
        start_emulator, start_agent, tmp_path: Path) -> None:
    """The claimer's first POST is answered 500 and it is paused (SIGSTOP: a VM freeze, a live migration) right
    after its claim, until another VM has taken the claim over (past takeover_after, 4 s) and POSTed. Resumed,
    the claimer rechecks its claim before its retry (the deadline, the record's ETag) and sends nothing: one POST
    accepted in all (before: the woken claimer POSTed again, 2 POSTs in 3 of 3 runs)."""
    server = start(tmp_path)
    try:
        emu, vms, agents, done, container = fleet(start_emulator, start_agent, tmp_path, server, (0.5, 0.5, 2.0))
        claimer = vms[2]
        emu.admin("POST", "faults", claimer, vm=claimer, kind="status", status=500, count=1,
                  path="/metadata/scheduledevents", method="POST")
        eid = emu.add_event(event_type="Reboot", resources=vms, notice=300)
        agents[claimer].wait_log("store.claimed", event_id=eid, timeout=30)
        agents[claimer].proc.send_signal(signal.SIGSTOP)
        try:
            wait_until(lambda: approvals(emu, vms), 20, "the taker's POST")
        finally:
            agents[claimer].proc.send_signal(signal.SIGCONT)
        # the woken claimer's attempt ends (withheld on its recheck, or failed), then it decides again after a
        # fresh poll: ten ticks of every VM for a second POST to show
        wait_until(lambda: agents[claimer].events("approval.withheld") or agents[claimer].events("approval.failed"),
                   30, "the woken claimer's attempt to end")
        more_polls(emu, vms)
        assert [a["vm"] for a in approvals(emu, vms)] != [claimer] and len(approvals(emu, vms)) == 1
        sent = [r for r in emu.requests(claimer) if r.get("method") == "POST" and r.get("status") == 200]
        assert sent == [], sent
    finally:
        server.stop()
