"""The belief model checker's three findings in the budget's real code (issue 34, B1/B2), as the operator sees them
(an in-memory store with conditional writes, one fake clock): a member a release seated in the same second as its
own read is listed by a write of its own before it leaves rotation; a maintd restarted after another's write seated
it writes before it is out; a loop polling IMDS every 60 s wakes at its place's lease end and is back in rotation
before the others may drop its entry."""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import tests.needs_azure  # noqa: F401 - skips the loop's test without the azure extra
from agent.clock import FakeClock
from agent.config.config import loads
from agent.fleet.budget_rules import CHOSEN, places_blob
from agent.loop.daemon import Daemon
from agent.systemd import Notifier
from tests.budget_fakes import CasStore
from tests.fleet.test_budget_lease import RELEASE_AFTER, Link, Vm, record, run
from tests.fleet.test_budget_loop import HOOK
from tests.imds_server import FakeImds, wait_for
from tests.loop.test_daemon import SE, doc, reboot
from tests.store.test_store_exchange import MemoryStore

NAME = places_blob("web")


class Writes(Link):
    """A member's way to the store that counts the writes it made itself."""

    def __init__(self, store: CasStore) -> None:
        super().__init__(store)
        self.writes = 0

    def write_body(self, name: str, body: bytes, etag: str | None) -> str | None:
        self.writes += 1
        return super().write_body(name, body, etag)


def test_a_member_seated_in_the_same_second_is_listed_by_a_write_of_its_own_before_it_leaves_rotation() -> None:
    """vmb waits; vma's release seats it, and vmb's confirming read falls in the same second (the fake clock does
    not move): the entry it would write equals the one vma wrote. vmb still writes it (If-Match: a new ETag) and
    leaves rotation only then."""
    clock = FakeClock()
    store = CasStore(clock)
    nb = clock.now() + timedelta(hours=2)
    a, b = Vm(store, clock, "vma", "ea", nb), Vm(store, clock, "vmb", "eb", nb)
    run([a], clock, 2)
    for _ in range(3):  # from here on the clock stands still: vmb's queue write, vma's release, vmb's read
        b.tick()
    assert a.out and not b.out and [w.vm for w in record(store).waiting] == ["vmb"]
    a.finish()
    a.tick()
    a.tick()
    held = record(store).holder("vmb")
    assert held is not None and held.why == CHOSEN, "vma's release seated vmb"
    writes, tag = store.n, store.blobs[NAME][1]
    b.budget.wake(None)  # vma's hint: vmb reads at once, in the same second
    b.tick()
    assert not b.out, "not out before a write of its own"
    b.tick()
    assert b.out
    assert store.n == writes + 1 and store.blobs[NAME][1] != tag, "vmb's own write listed it (a new ETag)"
    assert store.ops[-1] == "write"
    assert b.holds(clock) and b.budget.send_blocked("eb", ["vmb"]) is None


def test_a_maintd_restarted_after_another_seated_it_writes_before_it_is_out() -> None:
    """vmb waits and its maintd stops; vma's release seats it while it is down. The maintd that starts again finds
    itself a holder in the record: it is out of rotation (and may approve) only once a write of its own listed it,
    in the same second as the release."""
    clock = FakeClock()
    store = CasStore(clock)
    nb = clock.now() + timedelta(hours=2)
    a, b = Vm(store, clock, "vma", "ea", nb), Vm(store, clock, "vmb", "eb", nb)
    run([a], clock, 2)
    for _ in range(3):  # from here on the clock stands still: vmb's queue write, vma's release, vmb's read
        b.tick()
    assert a.out and not b.out
    b.budget.stop()  # vmb's maintd is down
    a.finish()
    a.tick()
    a.tick()
    assert record(store).holder("vmb") is not None, "seated while down"
    again = Vm(store, clock, "vmb", "eb", nb)
    link = Writes(store)
    again.budget.open_store = lambda: link
    tag = store.blobs[NAME][1]
    for _ in range(4):
        again.tick()
        if again.out or again.holds(clock):
            break
        assert again.budget.send_blocked("eb", ["vmb"]) is not None and again.budget.reason_for("eb") is None
    assert again.out and again.holds(clock)
    assert link.writes == 1 and store.blobs[NAME][1] != tag, "listed by its own write before it is out"


def loop_config(tmp_path: Path, url: str) -> Any:
    return loads(
        f"identity: {{name: vm1}}\nstate: {{dir: {tmp_path}}}\nimds: {{endpoint: '{url}', poll_interval: 60s}}\n"
        "probe: {lb_timeout: 11s, lb_interval: 5s, drain_grace: 0s}\n"
        "coordination:\n  backend: azure_blob\n  azure_blob: {account_url: 'https://a.blob.core.windows.net'}\n"
        f"  budget: {{group: web, release_after: {RELEASE_AFTER:g}s, advertise: none}}\n"
        "handlers:\n  - {name: drain, type: drain, phases: [scheduled, completed]}\n"
        "  - {name: checkpoint, type: exec, phases: [scheduled], "
        f"command: ['{sys.executable}', -c, {HOOK!r}], env: {{GO: '{tmp_path / 'go'}'}}}}\n")


def test_a_loop_polling_every_60s_wakes_at_the_lease_end_and_is_back_before_the_entry_may_be_dropped(
        tmp_path: Path, clock: FakeClock) -> None:
    """imds.poll_interval 60 s, release_after 60 s: the holder's store requests fail (no renewal lands), and the
    loop sleeps as long as nothing is due. It wakes at its lease's end: back in rotation (its drain lifted: /probe
    answers 200) before the store's clock reaches its entry's renewal plus release_after, when another member may
    drop the entry and take the place."""
    imds = FakeImds()
    imds.post(SE, status=200)
    imds.get(SE, json=doc(reboot()))
    d = Daemon(loop_config(tmp_path, imds.url), clock, boot_id="boot-1", notifier=Notifier({}))
    places, markers = CasStore(clock), MemoryStore()
    link = Link(places)
    budget = d.parts.budget
    assert budget is not None
    budget.open_store = lambda: link
    d.coordinator.backend.exchange.open_store = lambda: markers  # type: ignore[attr-defined]
    d.start()

    def passes(n: int) -> None:
        for _ in range(n):
            d.tick()
            assert budget.wait_idle(5)
            d.coordinator.wait_idle(5)
            d.store.wait_saved(5)
            if budget.hold.why is None:  # no place (lost): the hook's cancel and the drain's lift run first
                d.runner.wait_idle(10)
            d._sleep_until_due()  # a fake sleep: the clock moves by what the loop would sleep

    try:
        wait_for(lambda: (passes(1), d.rotation.drains())[1])
        held = record(places).holder("vm1")
        assert held is not None and not d.rotation.verdict().in_rotation
        link.cut = True  # no renewal lands from now on
        while not d.rotation.verdict().in_rotation:
            held = record(places).holder("vm1")  # its last renewal that landed
            assert held is not None
            dropped_from = held.renewed + timedelta(seconds=RELEASE_AFTER)
            assert clock.now() < dropped_from, "still out of rotation once the others may drop its entry"
            passes(1)
        assert clock.now() < dropped_from and d.rotation.drains() == {}, "back in rotation: /probe answers 200"
        assert budget.metrics.budget_lost.labels("lease_ended")._value.get() == 1
    finally:
        (tmp_path / "go").touch()
        d.shutdown()
        imds.close()
