"""Start-up order in a real `maintd run`: the state is loaded before `/probe` (or `/healthz`) answers, so a
restart while drained never lets the load balancer back in, with or without a socket systemd bound."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import requests

from tests.e2e.harness import Agent, http, wait_until

RETAINED = 4000
"""Finished events kept in the state file: a large file widens the window between start and load."""


def widen(state_file: Path) -> None:
    """Add RETAINED finished events to a stopped agent's state file (still within `state.retention`)."""
    data = json.loads(state_file.read_text())
    now = time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime())
    for i in range(RETAINED):
        data["events"][f"old-{i:05d}"] = {
            "event": {"EventId": f"old-{i:05d}", "EventType": "Freeze", "ResourceType": "VirtualMachine",
                      "Resources": [f"vm{n}" for n in range(20)], "EventStatus": "Started", "NotBefore": "",
                      "Description": "an old host update " * 10, "EventSource": "Platform", "DurationInSeconds": 5},
            "names_self": False, "first_seen": now, "boot_id": "b", "seen_started": True, "vanished_at": now,
            "outcome": "completed", "history": [{"kind": "appeared", "at": now, "status": "Scheduled"}]}
    state_file.write_text(json.dumps(data))


def sample_probe(base: str, proc: subprocess.Popen, until_up: float) -> list[int]:
    """`/probe`'s status every 5 ms from the moment the process exists until `until_up` s after its first answer."""
    session, seen, first = http(), [], None
    while first is None or time.monotonic() - first < until_up:
        assert proc.poll() is None, "maintd exited"
        try:
            seen.append(session.get(base + "/probe", timeout=5).status_code)
            first = first or time.monotonic()
        except requests.ConnectionError:
            pass
        time.sleep(0.005)
    return seen


def drained_agent(start_emulator, start_agent) -> Agent:
    emu = start_emulator(["vm1"])
    agent = start_agent(emu, "vm1")
    assert agent.post("/v1/drain", {"reason": "kernel update"}).status_code == 200
    assert agent.get("/probe").status_code == 503
    assert agent.stop() == 0
    widen(agent.workdir / "state" / "state.json")
    return agent


def run_argv(agent: Agent) -> list[str]:
    return [sys.executable, "-m", "agent", "run", "--config", str(agent.config_path)]


def test_a_restart_while_drained_never_answers_the_probe_200(start_emulator, start_agent):
    """Sampled every 5 ms from process start, /probe is never 200 before the drain is lifted."""
    agent = drained_agent(start_emulator, start_agent)
    proc = subprocess.Popen(run_argv(agent), env=agent.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        seen = sample_probe(agent.base, proc, until_up=0.5)
        assert seen and 200 not in seen, f"{seen.count(200)} of {len(seen)} answers were 200: {seen[:40]}"
        assert agent.post("/v1/undrain").status_code == 200
        assert agent.http.get(agent.base + "/probe", timeout=5).status_code == 200
    finally:
        proc.terminate()
        proc.wait(15)


SOCKET_ACTIVATED = ("import os, sys; os.dup2(int(sys.argv[1]), 3); os.environ['LISTEN_PID'] = str(os.getpid()); "
                    "os.environ['LISTEN_FDS'] = '1'; os.execv(sys.executable, [sys.executable] + sys.argv[2:])")
"""Hands a listening socket over as systemd does: fd 3, LISTEN_FDS=1, LISTEN_PID of the process that runs maintd."""


def test_a_socket_activated_restart_while_drained_never_answers_the_probe_200(start_emulator, start_agent):
    """With the port already bound and listening (systemd socket activation), connections wait in the
    backlog from the first instant: every one of them is answered 503 until the drain is lifted."""
    agent = drained_agent(start_emulator, start_agent)
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", agent.port))
    listener.listen(128)
    proc = subprocess.Popen([sys.executable, "-c", SOCKET_ACTIVATED, str(listener.fileno()), *run_argv(agent)[1:]],
                            env=agent.env, pass_fds=(listener.fileno(),), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    listener.close()
    try:
        seen = sample_probe(agent.base, proc, until_up=0.5)
        assert seen and 200 not in seen, f"{seen.count(200)} of {len(seen)} answers were 200: {seen[:40]}"
        wait_until(lambda: agent.post("/v1/undrain").status_code == 200, 15, "undrain")
        assert agent.http.get(agent.base + "/probe", timeout=5).status_code == 200
    finally:
        proc.terminate()
        proc.wait(15)

