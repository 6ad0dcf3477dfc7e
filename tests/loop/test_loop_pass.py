"""One loop pass reads top-down: readiness reaches the approval through the loop's inbox (a handler's
thread only hands its result over, the loop decides on it at once, not at the next poll, and nothing
of the loop's is read on another thread), and the profile in force is chosen on every pass, not only
after a successful poll. A fake clock: the loop never sleeps; the hook is a real process."""

from __future__ import annotations

import sys
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from agent.config.config import loads
from agent.loop.daemon import Daemon
from agent.systemd import Notifier
from tests.loop.test_daemon import SE, doc, imds, reboot, run_for  # noqa: F401 (IMDS scripted for the daemon's life; approvals succeed)

HOOK = "import os, time\nwhile not os.path.exists(os.environ['GO']): time.sleep(0.005)\n"


def config(tmp_path: Path, url: str) -> Any:
    """vm1, approval auto, one scheduled hook that finishes once `go` exists."""
    return loads(f"identity: {{name: vm1}}\nstate: {{dir: {tmp_path}}}\nimds: {{endpoint: '{url}'}}\n"
                 "handlers:\n  - {name: checkpoint, type: exec, phases: [scheduled], "
                 f"command: ['{sys.executable}', -c, {HOOK!r}], env: {{GO: '{tmp_path / 'go'}'}}}}\n")


def requests_of(imds, method: str) -> int:
    return sum(1 for c in imds.calls if c.method == method and c.path == SE)


@pytest.fixture
def started(tmp_path, clock, imds):
    """A daemon that polled once: E1 appeared, its hook runs and waits for `go`; nothing was approved yet."""
    imds.get(SE, json=doc(reboot()))
    made: list[Daemon] = []

    def start(cls: type[Daemon] = Daemon) -> Daemon:
        d = cls(config(tmp_path, imds.url), clock, boot_id="boot-1", notifier=Notifier({}))
        made.append(d)
        d.start()
        d.tick()
        assert d.coordinator.wait_idle(5) and requests_of(imds, "POST") == 0, "not ready: nothing is sent"
        return d

    yield start
    for d in made:
        (tmp_path / "go").touch()
        d.shutdown()


def test_a_vm_that_becomes_ready_approves_at_once_not_at_the_next_poll(started, tmp_path, clock, imds):
    """The hook finishes between two polls: the loop wakes (a fake sleep would jump to the next poll), decides
    and the one POST goes out with the fake clock where it was and no second GET."""
    d = started()
    polls, at = requests_of(imds, "GET"), clock.monotonic()
    (tmp_path / "go").touch()
    assert d.runner.wait_idle(5)
    d._sleep_until_due()
    d.tick()
    assert d.coordinator.wait_idle(5)
    assert requests_of(imds, "POST") == 1
    assert (requests_of(imds, "GET"), clock.monotonic()) == (polls, at), "the approval did not wait for a poll"


def test_a_finished_handler_reads_nothing_of_the_loop_on_its_thread(started, tmp_path, clock, imds):
    """One owner: the handler's thread hands its result to the inbox and reads none of the loop's fields (the
    tracked events, this VM's name, the runner's readiness through the loop); the loop takes it on its pass."""
    elsewhere: list[tuple[str, str]] = []

    class Watched(Daemon):
        def __getattribute__(self, name: str) -> Any:
            if threading.current_thread() is not threading.main_thread():
                elsewhere.append((threading.current_thread().name, name))
            return object.__getattribute__(self, name)

    d = started(Watched)
    (tmp_path / "go").touch()
    assert d.runner.wait_idle(5)
    assert elsewhere == []
    d.tick()
    assert d.coordinator.wait_idle(5) and requests_of(imds, "POST") == 1


def test_the_profile_in_force_follows_the_clock_while_imds_does_not_answer(tmp_path, clock, imds):
    """IMDS answers 500 for the whole hour; at 10:20 the slot opens: `maintd status` and maintd_profile_active
    say so at once, not only after the next successful poll."""
    imds.get(SE, status=500)
    start = clock.now()
    d = Daemon(loads(f"identity: {{name: vm1}}\nstate: {{dir: {tmp_path}}}\nimds: {{endpoint: '{imds.url}'}}\n"
                     "profiles:\n  - {name: slot, approval: auto, fixed_date: "
                     f"{{start: '{(start + timedelta(minutes=20)).isoformat()}', "
                     f"end: '{(start + timedelta(hours=1)).isoformat()}'}}}}\n"
                     "  - {name: default, approval: never}\n"), clock, boot_id="boot-1", notifier=Notifier({}))
    d.start()
    try:
        run_for(d, clock, 19 * 60)
        assert d.view.profile.name == "default"
        run_for(d, clock, 2 * 60)
        assert d.cadence.last_success is None, "IMDS never answered"
        assert d.view.profile.name == "slot"
        assert 'maintd_profile_active{profile="slot"} 1.0' in d.metrics.render().decode()
    finally:
        d.shutdown()
