"""Signals and the loop's sleep: handlers only record and take no lock, every signal wakes the loop,
each sleeper keeps its own wake, and a real `maintd run` outlives bursts of SIGHUP and stops on SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from agent.clock import SystemClock
from agent.config.config import loads
from agent.loop.daemon import Daemon
from agent.systemd import Notifier
from tests.e2e.harness import CLEAN_ENV, Agent, Emulator, free_port, wait_until
from tests.imds_server import FakeImds

ROOT = Path(__file__).resolve().parents[2]

# A `maintd run` whose main thread sends itself a SIGHUP at every line it runs in the loop's own code,
# its clock and `threading` (so also while it holds a threading lock), outside the handlers themselves.
SIGNAL_AT_EVERY_LINE = """
import os, signal, sys, threading, time
from agent.cli import commands as cli

FILES = (threading.__file__, os.path.join("agent", "daemon.py"), os.path.join("agent", "clock.py"))
HANDLERS = {"request_stop", "request_reload", "<lambda>"}
sent = 0

def in_handler(frame):
    while frame is not None:
        if frame.f_code.co_name in HANDLERS:
            return True
        frame = frame.f_back
    return False

def tracer(frame, event, arg):
    global sent
    if not frame.f_code.co_filename.endswith(FILES):
        return None
    if (event == "line" and sent < 3000 and signal.getsignal(signal.SIGHUP) not in (signal.SIG_DFL, None)
            and not in_handler(frame)):
        sent += 1
        os.kill(os.getpid(), signal.SIGHUP)
    return tracer

def stop_later():  # 2.5 s after maintd took SIGTERM over (a fixed 2.5 s from here: a slow start died of it, -15)
    while signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
        time.sleep(0.05)
    time.sleep(2.5)
    os.kill(os.getpid(), signal.SIGTERM)

threading.Thread(target=stop_later, daemon=True).start()
sys.settrace(tracer)
code = cli.main(["run", "--config", sys.argv[1]])
sys.settrace(None)
print(sent, file=sys.stdout, flush=True)
sys.exit(code)
"""


def write_config(path: Path, endpoint: str, **extra: object) -> Path:
    cfg = {"imds": {"endpoint": endpoint, "poll_interval": "100ms", "max_backoff": "200ms", "timeout": "1s"},
           "identity": {"name": "vm-1"}, "state": {"dir": str(path.parent / "state")},
           "server": {"listen": f"127.0.0.1:{free_port()}", "unix_socket": None},
           "log": {"format": "json", "level": "info"}, **extra}
    path.write_text(yaml.safe_dump(cfg))
    os.chmod(path, 0o600)
    return path


def test_a_signal_landing_anywhere_in_the_loop_even_under_a_lock_never_hangs_it(tmp_path):
    """Finding 1: a SIGHUP delivered at every line the loop runs (its sleep, its flags, inside
    `threading` while it holds a lock) is handled without a deadlock, and SIGTERM still stops maintd.
    (A handler that sets a `threading.Event` deadlocked here at the first signal inside `Event.wait`.)"""
    config = write_config(tmp_path / "maintd.yaml", f"http://127.0.0.1:{free_port()}")  # nobody listens
    child = subprocess.Popen([sys.executable, "-c", SIGNAL_AT_EVERY_LINE, str(config)], cwd=ROOT, env=CLEAN_ENV,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = child.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        child.kill()
        out, err = child.communicate()
        pytest.fail("maintd hung: a signal handler waited for a lock its own thread held\n" + err[-2000:])
    assert child.returncode == 0, err[-2000:]
    assert int(out.split()[-1]) >= 100, "signals were sent at many lines of the loop"
    reloads = [json.loads(line) for line in err.splitlines() if '"config.reloaded"' in line]
    assert reloads, "the loop acted on the SIGHUPs (reloaded) on its next wake"


def test_a_wake_is_kept_by_its_own_sleeper():
    """Finding 2: a wake for the loop that arrives while it is busy ends its next sleep at once, even if
    another thread (the approval worker pacing IMDS requests) sleeps and wakes in between."""
    clock = SystemClock()
    loop = clock.sleeper()
    loop.wake()
    other = threading.Thread(target=clock.sleep, args=(0.05,))
    other.start()
    other.join()
    started = time.monotonic()
    loop.sleep(5)
    assert time.monotonic() - started < 0.5


@pytest.fixture
def restore_signals():
    """Put back the handlers and the wakeup fd an in-process daemon installs."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    yield
    signal.set_wakeup_fd(-1)
    for s, handler in saved.items():
        signal.signal(s, handler)


def test_a_signal_from_another_thread_wakes_the_loops_sleep_at_once(tmp_path, restore_signals):
    """The loop asleep until its next poll 5 s away wakes within a fraction of a second on a SIGHUP
    (whichever thread the kernel gives it to, the wakeup fd reaches the loop's self-pipe), and the
    reload is done on that wake."""
    cfg = loads(f"identity: {{name: vm1}}\nstate: {{dir: {tmp_path}}}\nimds: {{endpoint: 'http://127.0.0.1:9'}}\n")
    d = Daemon(cfg, SystemClock(), boot_id="boot-1", notifier=Notifier({}))
    d.control.install()
    d.cadence.next_poll = d.clock.monotonic() + 5
    timer = threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGHUP))
    timer.start()
    try:
        started = time.monotonic()
        d._sleep_until_due()
        assert 0.15 < time.monotonic() - started < 1.5
        assert d.control.reload.is_set()
    finally:  # the signal never outlives its handler: a sleep that failed at once must not let it kill the run
        timer.cancel()
        timer.join()


RECORD_RUN = ("import os\n"
              "with open(os.environ['OUT'], 'a') as f:\n"
              "    f.write(os.environ['MAINTD_PHASE'] + ' ' + os.environ['MAINTD_EVENT_ID'] + '\\n')\n")
ROUNDS = 25


def burst(pid: int, sig: int, count: int) -> None:
    for _ in range(count):
        os.kill(pid, sig)


@pytest.mark.e2e
def test_maintd_outlives_bursts_of_sighup_with_events_in_flight_and_stops_on_sigterm(tmp_path):
    """Findings 1-2 on a real `maintd run` against the emulator: rounds of 200 back-to-back SIGHUPs (and
    one of 20 000) while events come and go: no hang, no poll gap over 2 s, every handler run done
    (scheduled and completed for each event), and a burst of SIGTERMs stops it with exit 0."""
    out = tmp_path / "runs.txt"
    hook = {"name": "record", "type": "exec", "phases": ["scheduled", "completed"],
            "command": [sys.executable, "-c", RECORD_RUN], "env": {"OUT": str(out)}}
    emu = Emulator(["vm-1"], "--started-duration", "1")
    agent: Agent | None = None
    try:
        agent = Agent(tmp_path / "vm-1", emu.urls["vm-1"], "vm-1", {"handlers": [hook]})
        pid = agent.proc.pid

        def polls() -> list[float]:
            return [r["time"] for r in emu.requests("vm-1") if r["method"] == "GET" and "scheduledevents" in r["path"]]

        ids = []
        for _ in range(ROUNDS):
            ids.append(emu.add_event(event_type="Reboot", resources=["vm-1"], notice=120))
            before = len(polls())
            burst(pid, signal.SIGHUP, 200)
            wait_until(lambda: len(polls()) >= before + 2, 5, "polls to go on after a burst")
        burst(pid, signal.SIGHUP, 20_000)
        expected = {f"{phase} {eid}" for eid in ids for phase in ("scheduled", "completed")}
        wait_until(lambda: out.exists() and expected <= set(out.read_text().splitlines()), 60,
                   "every event's scheduled and completed runs")
        times = polls()
        assert max(b - a for a, b in zip(times, times[1:], strict=False)) < 2.0
        assert len(out.read_text().splitlines()) == len(expected), "each run once"
        burst(pid, signal.SIGTERM, 200)
        assert agent.proc.wait(15) == 0, "".join(agent.raw[-20:])
        assert agent.events("config.reloaded"), "the SIGHUPs were acted on"
    finally:
        if agent is not None:
            agent.stop()
        emu.stop()


def test_a_sigterm_cuts_the_identity_retries_at_start_short(tmp_path, restore_signals):
    """While IMDS fails the compute call at start (retries for several seconds), start returns at once (the
    lookup runs off the loop), the loop goes on, and a SIGTERM ends the loop and the lookup's retries at once."""
    imds = FakeImds()
    try:
        imds.get("/metadata/instance/compute", status=503, json={})
        cfg = loads(f"state: {{dir: {tmp_path}}}\nimds: {{endpoint: '{imds.url}', max_backoff: 10s}}\n")
        d = Daemon(cfg, SystemClock(), boot_id="boot-1", notifier=Notifier({}))
        d.control.install()
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()
        started = time.monotonic()
        d.start()
        assert time.monotonic() - started < 0.25, "start waits for no compute call"
        d.run()
        assert time.monotonic() - started < 1.5 and d.vm_name is None
        assert d.control.stop.is_set()
        d.shutdown()
        wait_until(lambda: not any(t.name.startswith("identity") for t in threading.enumerate()), 1.0,
                   "the identity lookup to end")
    finally:
        imds.close()
