"""Files that can stop no daemon: real `maintd run` processes on damaged state, config and journal files.

A torn `state.json` used to make `maintd run` exit 1 with a UnicodeDecodeError traceback (and systemd
restarted it into the same crash); a config holding an impossible date exited 1 with a ValueError.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from tests.e2e.harness import CLEAN_ENV

pytestmark = pytest.mark.e2e

EX_CONFIG = 78


def maintd(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "agent", *args], capture_output=True, text=True, timeout=timeout,
                          env=CLEAN_ENV)


def test_a_state_file_of_random_bytes_is_moved_aside_and_maintd_serves(start_emulator, start_agent, tmp_path):
    """The daemon comes up (/healthz 200, probe in rotation), keeps the bad file aside, says so in the log,
    the metrics and /v1/health, and handles the next event."""
    garbage = os.urandom(4096) + b"\xff\xfe"
    state_dir = tmp_path / "vm-1" / "state"
    state_dir.mkdir(parents=True)
    (state_dir / "state.json").write_bytes(garbage)
    emu = start_emulator(["vm-1"])
    agent = start_agent(emu, "vm-1")
    assert agent.get("/healthz").status_code == 200 and agent.get("/probe").status_code == 200
    logged = agent.wait_log("state.corrupt")
    assert open(logged["moved_aside"], "rb").read() == garbage
    assert "maintd_state_load_failures_total 1.0" in agent.get("/metrics").text
    health = agent.get("/v1/health").json()["HealthEvents"]
    assert any(e["SourceId"] == "state" and e["Property"] == "load" and e["HealthState"] == "Warning" for e in health)
    eid = emu.add_event(event_type="Reboot", resources=["vm-1"], notice=600)
    agent.wait_log("approval.sent", event_id=eid)


def _config(tmp_path, body: bytes, mode: int = 0o600):
    path = tmp_path / "maintd.yaml"
    path.write_bytes(body)
    os.chmod(path, mode)
    return str(path)


@pytest.mark.parametrize("body,words", [
    (b"imds:\n  poll_interval: 1s\n\xff\xfe\x00", "not UTF-8"),
    (b"", "is empty"),
    (b"imds: 2026-13-01\n", "month must be in 1..12"),
    (b"handlers: " + b"[" * 3000 + b"]" * 3000, "nested more than"),
], ids=["not UTF-8", "empty", "impossible date", "deep nesting"])
def test_a_config_that_cannot_be_used_exits_78_with_the_file_named_never_a_traceback(tmp_path, body, words):
    """`maintd run` refuses with exit 78 (systemd does not restart-loop) and `check-config` with 1; both say
    which file and why, on one line."""
    path = _config(tmp_path, body)
    run = maintd("run", "--config", path)
    assert run.returncode == EX_CONFIG and path in run.stderr and words in run.stderr
    check = maintd("check-config", path)
    assert check.returncode == 1 and words in check.stderr
    assert "Traceback" not in run.stderr + check.stderr


def test_a_state_dir_others_can_write_is_refused_at_start(tmp_path):
    """Another user could forge approvals or plant symlinks there: exit 78 with the chmod that fixes it."""
    state = tmp_path / "state"
    state.mkdir()
    os.chmod(state, 0o777)
    path = _config(tmp_path, yaml.safe_dump({"identity": {"name": "vm-1"}, "state": {"dir": str(state)}}).encode())
    run = maintd("run", "--config", path)
    assert run.returncode == EX_CONFIG and f"chmod go-w {state}" in run.stderr and "Traceback" not in run.stderr


def test_events_history_reads_a_damaged_journal(tmp_path):
    """`maintd events --history` on a journal with bad bytes and torn lines prints the good entries."""
    state = tmp_path / "state"
    state.mkdir()
    good = {"t": "2026-01-01T00:00:00Z", "kind": "approval.sent", "event_id": "E1"}
    (state / "journal.jsonl").write_bytes(b"\xff\xfe\x00garbage\n" + json.dumps(good).encode() + b"\n{\"t\": \"2026")
    path = _config(tmp_path, yaml.safe_dump({"state": {"dir": str(state)}}).encode())
    history = maintd("events", "--history", "--json", "--config", path)
    assert history.returncode == 0 and [json.loads(line) for line in history.stdout.splitlines()] == [good]
