"""A test run killed by a signal leaves nothing running: the servers the tests start die with the run."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUN = ("import os, signal, subprocess, sys\n"
       "from tests.reaper import die_with_parent\n"
       "child = subprocess.Popen(['sleep', '60'], preexec_fn=die_with_parent)\n"
       "print(child.pid, flush=True)\n"
       "os.kill(os.getpid(), signal.SIGKILL)\n")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_server_started_by_a_killed_run_dies_with_it():
    """The run SIGKILLed (no teardown at all): the server it started is gone within seconds."""
    run = subprocess.run([sys.executable, "-c", RUN], cwd=ROOT, capture_output=True, text=True, timeout=30)
    pid = int(run.stdout.split()[0])
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = _alive(pid)
    if alive:
        os.kill(pid, 9)
    assert not alive, "the server outlived the run that started it"
