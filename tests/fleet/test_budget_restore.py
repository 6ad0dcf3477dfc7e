"""A lost place's return to rotation survives a kill -9 (issue 34's follow-ups), through the whole loop: a holder
cut off from the store past its lease returns to rotation (its `completed` phase: a flush hook, then the undrain);
maintd is killed while the flush runs (the state on disk at that moment is all a restart gets). The restarted
maintd runs what was left of that return again (the flush, attempt 2, and the undrain): the VM is back in rotation
while it waits for a place again, never left drained until its event ends. The cut work says why in its record:
its budget place was lost, not "the event left the document". And a restart that finds no place for an event an
operator approved by hand keeps the VM out, counted as forced: the platform acts on it."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import tests.needs_azure  # noqa: F401 - skips this module without the azure extra
from agent.clock import FakeClock
from agent.config.config import loads
from agent.fleet.budget_rules import (
    CHOSEN,
    FORCED,
    Me,
    Places,
    parse_places,
    places_blob,
    render_places,
    take,
)
from agent.loop import wiring
from agent.loop.daemon import Daemon
from agent.model.outcomes import CANCELED, OK, RUNNING
from agent.prepare.run_records import ROUND_KEY, RunKey
from agent.systemd import Notifier
from tests.budget_fakes import CasStore
from tests.fleet.test_budget_lease import Link
from tests.fleet.test_budget_loop import imds, passes, posts
from tests.imds_server import FakeImds, wait_for
from tests.store.test_store_exchange import MemoryStore

__all__ = ["imds"]

HOOK = "import os, time\nwhile not os.path.exists(os.environ['GO']): time.sleep(0.005)\n"


def config(state: Path, go: Path, url: str) -> Any:
    hook = f"type: exec, timeout: 900s, command: ['{sys.executable}', -c, {HOOK!r}]"  # fake time runs fast
    return loads(
        f"identity: {{name: vm1}}\nstate: {{dir: {state}}}\nimds: {{endpoint: '{url}'}}\n"
        "probe: {lb_timeout: 11s, lb_interval: 5s, drain_grace: 0s}\n"
        "coordination:\n  backend: azure_blob\n  azure_blob: {account_url: 'https://a.blob.core.windows.net'}\n"
        "  budget: {group: web, release_after: 60s, advertise: none}\n"
        f"handlers:\n  - {{name: flush, {hook}, phases: [completed], env: {{GO: '{go / 'flushed'}'}}}}\n"
        "  - {name: drain, type: drain, phases: [scheduled, completed]}\n"
        f"  - {{name: checkpoint, {hook}, phases: [scheduled], env: {{GO: '{go / 'checkpointed'}'}}}}\n")


def daemon(state: Path, go: Path, imds: FakeImds, clock: FakeClock, places: CasStore) -> tuple[Daemon, Link]:
    d = Daemon(config(state, go, imds.url), clock, boot_id="boot-1", notifier=Notifier({}))
    link, markers = Link(places), MemoryStore()
    assert d.parts.budget is not None
    d.parts.budget.open_store = lambda: link
    d.coordinator.backend.exchange.open_store = lambda: markers  # type: ignore[attr-defined]
    return d, link


def test_a_restart_after_a_kill_during_a_lost_places_return_to_rotation_finishes_it(
        tmp_path: Path, clock: FakeClock, imds: FakeImds) -> None:
    go, places = tmp_path / "go", CasStore(clock)
    go.mkdir()
    d, link = daemon(tmp_path / "state", go, imds, clock, places)
    d.start()
    try:
        wait_for(lambda: (passes(d, clock, 1), d.runner._running.get("E1") == "checkpoint")[1], timeout=60)
        assert not d.rotation.verdict().in_rotation, "out of rotation on its place, its checkpoint running"
        link.cut = True  # past its lease: the place is lost, the return to rotation starts with the flush
        flush = str(RunKey("flush", "completed"))
        wait_for(lambda: (passes(d, clock, 5), (d.store.result("E1", flush) or {}).get("outcome") == RUNNING)[1],
                 timeout=60)
        d.store.flush()  # what the loop saw is on disk (its writer may lag behind it, loaded)
        shutil.copytree(tmp_path / "state", tmp_path / "killed")  # kill -9 now: what the disk holds
        checkpoint = d.store.result("E1", str(RunKey("checkpoint", "scheduled")))
        assert not d.rotation.verdict().in_rotation, "the undrain comes after the flush"
    finally:
        (go / "flushed").touch()
        (go / "checkpointed").touch()
        d.shutdown()
    assert checkpoint is not None and checkpoint["outcome"] == CANCELED
    assert "its budget place was lost" in checkpoint["detail"] and "left the document" not in checkpoint["detail"]

    again, link = daemon(tmp_path / "killed", go, imds, clock, places)  # the restart, the store still unreachable
    link.cut = True
    again.start()
    try:
        wait_for(lambda: (passes(again, clock, 1), again.rotation.verdict().in_rotation)[1], timeout=60)
        results = again.store.results("E1")
        assert results[str(RunKey("flush", "completed"))]["outcome"] == OK
        assert results[str(RunKey("flush", "completed"))]["attempt"] == 2, "the cut flush ran again"
        assert results[str(RunKey("drain", "completed"))]["outcome"] == OK
        assert results[ROUND_KEY]["round"] == 2 and again.rotation.drains() == {}
        passes(again, clock, 5)
        assert posts(imds) == 0 and again.rotation.verdict().in_rotation, "it waits for a place in rotation"
    finally:
        again.shutdown()


def test_a_restart_after_an_operator_approved_an_event_without_a_place_keeps_the_vm_out_and_counted(
        tmp_path: Path, clock: FakeClock, imds: FakeImds) -> None:
    """vmb holds the only place; vm1's operator approves E1 by hand (`maintd approve`): vm1 prepares (drained)
    without a place. maintd restarts: its first read finds no entry of vm1's. vm1 stays out of rotation (the
    platform acts on the operator's go), written into the record as forced, and nothing is returned to rotation."""
    go, places = tmp_path / "go", CasStore(clock)
    go.mkdir()
    blob = places_blob("web")
    places.blobs[blob] = (render_places("web", take(Places(), Me("vmb", "1", "0"), "eb", CHOSEN, clock.now())), "v0")
    d, _ = daemon(tmp_path / "state", go, imds, clock, places)
    d.start()
    try:
        passes(d, clock, 2)
        assert d.rotation.verdict().in_rotation, "no place: it waits in rotation"
        wiring.make_api(d.parts, lambda: d.view).approve("E1", "ops")
        wait_for(lambda: (passes(d, clock, 1), d.runner._running.get("E1") == "checkpoint")[1], timeout=60)
        assert not d.rotation.verdict().in_rotation
        d.store.flush()  # what the loop saw is on disk (its writer may lag behind it, loaded)
        shutil.copytree(tmp_path / "state", tmp_path / "killed")
    finally:
        (go / "checkpointed").touch()
        d.shutdown()
    again, _ = daemon(tmp_path / "killed", go, imds, clock, places)
    again.start()
    try:
        passes(again, clock, 5)
        assert not again.rotation.verdict().in_rotation, "still out: never handed back while the platform acts"
        assert ROUND_KEY not in again.store.results("E1")
        record = parse_places(places.blobs[blob][0])
        assert not isinstance(record, str) and (h := record.holder("vm1")) is not None and h.why == FORCED
    finally:
        again.shutdown()
