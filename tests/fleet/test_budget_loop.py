"""B2 through the whole loop, as the operator sees it (a scripted IMDS, in-memory stores, a fake clock): a holder
whose store fails for longer than its lease is back in rotation (its drain lifted: /probe would answer 200), its
`completed` phase ran, it sent no POST, it queues again, and once seated it prepares again (a new round of the
event: the drain and the hook run anew) and approves."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

import tests.needs_azure  # noqa: F401 - skips this module without the azure extra
from agent.clock import FakeClock
from agent.config.config import loads
from agent.loop.daemon import Daemon
from agent.prepare.run_records import ROUND_KEY, RunKey
from agent.systemd import Notifier
from tests.budget_fakes import CasStore
from tests.fleet.test_budget_lease import Link
from tests.imds_server import FakeImds, wait_for
from tests.loop.test_daemon import SE, doc, reboot
from tests.store.test_store_exchange import MemoryStore

HOOK = "import os, time\nwhile not os.path.exists(os.environ['GO']): time.sleep(0.005)\n"


def config(tmp_path: Path, url: str) -> Any:
    return loads(
        f"identity: {{name: vm1}}\nstate: {{dir: {tmp_path}}}\nimds: {{endpoint: '{url}'}}\n"
        "probe: {lb_timeout: 11s, lb_interval: 5s, drain_grace: 0s}\n"
        "coordination:\n  backend: azure_blob\n  azure_blob: {account_url: 'https://a.blob.core.windows.net'}\n"
        "  budget: {group: web, release_after: 60s, advertise: none}\n"
        "handlers:\n  - {name: drain, type: drain, phases: [scheduled, completed]}\n"
        "  - {name: checkpoint, type: exec, phases: [scheduled], "
        f"command: ['{sys.executable}', -c, {HOOK!r}], env: {{GO: '{tmp_path / 'go'}'}}}}\n")


@pytest.fixture
def imds():
    server = FakeImds()
    server.post(SE, status=200)
    server.get(SE, json=doc(reboot()))
    yield server
    server.close()


def posts(imds: FakeImds) -> int:
    return sum(1 for c in imds.calls if c.method == "POST" and c.path == SE)


def passes(d: Daemon, clock: FakeClock, seconds: float) -> None:
    """Loop passes for `seconds` of fake time, each one's store steps answered before the next."""
    end = clock.monotonic() + seconds
    while clock.monotonic() < end:
        d.tick()
        assert d.parts.budget is not None and d.parts.budget.wait_idle(5)
        d.coordinator.wait_idle(5)
        d.store.wait_saved(5)
        d._sleep_until_due()


def test_a_holder_cut_off_from_the_store_past_its_lease_returns_to_rotation_and_prepares_again(
        tmp_path: Path, clock: FakeClock, imds: FakeImds) -> None:
    d = Daemon(config(tmp_path, imds.url), clock, boot_id="boot-1", notifier=Notifier({}))
    places, markers = CasStore(clock), MemoryStore()
    link = Link(places)
    assert d.parts.budget is not None
    d.parts.budget.open_store = lambda: link
    d.coordinator.backend.exchange.client.open_store = lambda: markers  # type: ignore[attr-defined]
    d.start()
    try:
        wait_for(lambda: (passes(d, clock, 1), d.rotation.drains())[1])
        assert not d.rotation.verdict().in_rotation, "out of rotation on its place"
        link.cut = True  # its store requests fail from now on, for longer than its lease
        wait_for(lambda: (passes(d, clock, 5), d.rotation.verdict().in_rotation)[1], timeout=30)
        assert d.rotation.drains() == {}, "the drain is lifted: /probe answers 200"
        results = d.store.results("E1")
        assert results[str(RunKey("drain", "completed"))]["outcome"] == "ok"
        assert results[ROUND_KEY]["round"] == 2
        assert posts(imds) == 0
        (tmp_path / "go").touch()  # the hook would finish now: still nothing is sent without a place
        passes(d, clock, 10)
        assert posts(imds) == 0 and d.rotation.verdict().in_rotation
        link.cut = False  # the store answers again: it takes the place again (its own write) and prepares anew
        wait_for(lambda: (passes(d, clock, 5), posts(imds))[1], timeout=60)
        results = d.store.results("E1")
        assert results[str(RunKey("drain", "scheduled", 2))]["outcome"] == "ok"
        assert results[str(RunKey("checkpoint", "scheduled", 2))]["outcome"] == "ok"
        assert posts(imds) == 1
    finally:
        (tmp_path / "go").touch()
        d.shutdown()


def test_a_vm_paused_past_its_lease_looks_first_and_approves_nothing_on_the_place_it_lost(
        tmp_path: Path, clock: FakeClock, imds: FakeImds) -> None:
    """Its hook finished while the process was stopped longer than its lease (SIGSTOP): the first pass after the
    pause, which would otherwise take that result and approve at once, first finds the place lost: no POST, back
    in rotation, queued again."""
    d = Daemon(config(tmp_path, imds.url), clock, boot_id="boot-1", notifier=Notifier({}))
    places, markers = CasStore(clock), MemoryStore()
    assert d.parts.budget is not None
    d.parts.budget.open_store = lambda: places
    d.coordinator.backend.exchange.client.open_store = lambda: markers  # type: ignore[attr-defined]
    d.start()
    try:
        wait_for(lambda: (passes(d, clock, 1), d.rotation.drains())[1])
        wait_for(lambda: (passes(d, clock, 1), d.runner._running.get("E1") == "checkpoint")[1])
        (tmp_path / "go").touch()
        assert d.runner.wait_idle(10)  # the hook is done; the loop has not run since
        clock.advance(61)  # the pause: longer than release_after (60 s)
        d.tick()
        d.coordinator.wait_idle(5)
        assert posts(imds) == 0
        assert d.store.results("E1")[ROUND_KEY]["round"] == 2
        wait_for(lambda: d.runner.wait_idle(5) and d.rotation.verdict().in_rotation)
        assert posts(imds) == 0
    finally:
        d.shutdown()
