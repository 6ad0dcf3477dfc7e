"""The state store: atomic writes, corruption handling, disk failures, pruning, audit journal."""

from __future__ import annotations

import errno
import json
import os
import threading

import pytest

from agent.errors import StateError
from agent.model.events import Document, Event
from agent.model.tracker import diff
from agent.state.journal import read_journal
from agent.state.state_file import check_dir
from agent.state.state_store import Store


def _event(eid="E1", status="Scheduled"):
    return Event(event_id=eid, event_type="Reboot", status=status, resources=("vm1",))


def _apply(store, clock, *events, previous=None):
    tracked, trs = diff(previous or {}, Document(1, tuple(events)), vm_name="vm1", boot_id="b", now=clock.now())
    store.apply(tracked, trs)
    assert store.wait_saved(5), "the background write finished"
    return tracked


def test_events_and_results_survive_a_restart(tmp_path, clock):
    """What one process stored, the next one reads back: tracked events and handler results."""
    store = Store(tmp_path, clock)
    _apply(store, clock, _event())
    store.record("E1", "handler:drain:scheduled", {"outcome": "ok"})
    again = Store(tmp_path, clock)
    assert again.load().events == 1
    assert list(again.tracked()) == ["E1"]
    assert again.result("E1", "handler:drain:scheduled") == {"outcome": "ok"}


def test_write_is_atomic_and_leaves_no_temp_file(tmp_path, clock):
    """The file on disk is always a complete JSON document; the temp file is renamed away."""
    store = Store(tmp_path, clock)
    store.set_flag("drains", {"manual": {"reason": "x"}})
    assert json.loads((tmp_path / "state.json").read_text())["flags"]["drains"]["manual"]["reason"] == "x"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


@pytest.mark.parametrize("content", ["{not json", "[]", '{"events": {"E": {"event": {}}}}', ""])
def test_corrupt_file_is_moved_aside_and_store_starts_fresh(tmp_path, clock, content):
    """A state file that cannot be read is kept aside for inspection; maintd starts with an empty state."""
    (tmp_path / "state.json").write_text(content)
    store = Store(tmp_path, clock)
    report = store.load()
    assert report.problem and "corrupt" in report.problem
    assert report.moved_aside and os.path.exists(report.moved_aside)
    assert not (tmp_path / "state.json").exists()
    assert store.tracked() == {}


def test_disk_full_keeps_changes_in_memory_and_flush_recovers(tmp_path, clock, monkeypatch):
    """ENOSPC: the change raises StateError but stays in memory; once space returns, flush writes it."""
    store = Store(tmp_path, clock)
    real_replace = os.replace

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    with pytest.raises(StateError, match="No space left"):
        store.record("E1", "approval", {"status": "sent"})
    assert store.dirty and store.result("E1", "approval") == {"status": "sent"}
    assert store.write_failures == 1 and "No space left" in (store.write_error or "")
    monkeypatch.setattr(os, "replace", real_replace)
    store.flush()
    assert not store.dirty
    assert Store(tmp_path, clock).load().events == 0
    fresh = Store(tmp_path, clock)
    fresh.load()
    assert fresh.result("E1", "approval") == {"status": "sent"}


def test_vanished_events_are_pruned_after_retention(tmp_path, clock):
    """Finished events stay for `state.retention`, then they and their results are dropped."""
    store = Store(tmp_path, clock, retention=3600)
    tracked = _apply(store, clock, _event())
    store.record("E1", "handler:x:scheduled", {"outcome": "ok"})
    _apply(store, clock, previous=tracked)
    assert store.event_record("E1")["outcome"] == "canceled"
    clock.advance(1800)
    assert store.prune(clock.now()) == []
    clock.advance(1801)
    assert store.prune(clock.now()) == ["E1"]
    assert store.event_record("E1") is None and store.results("E1") == {}


def test_journal_records_each_transition_and_rotates_by_size(tmp_path, clock):
    """The audit journal gets one line per transition; past the size limit it rotates, keeping N files."""
    store = Store(tmp_path, clock, journal_max_bytes=4096, journal_keep=2)
    tracked = {}
    for i in range(60):
        tracked = _apply(store, clock, _event(f"E{i}"), previous=tracked)
    kinds = [e["kind"] for e in read_journal(tmp_path)]
    assert kinds.count("event.appeared") >= 10 and "event.canceled" in kinds
    assert (tmp_path / "journal.jsonl.1").exists() and (tmp_path / "journal.jsonl.2").exists()
    assert not (tmp_path / "journal.jsonl.3").exists()
    assert all(os.path.getsize(p) <= 4096 for p in tmp_path.glob("journal.jsonl*"))


def test_journal_failure_is_remembered_not_raised(tmp_path, clock):
    """An unwritable journal never stops the daemon; the error is kept for health and logs."""
    store = Store(tmp_path / "file-not-dir", clock)
    (tmp_path / "file-not-dir").write_text("")
    store.journal("event.appeared", event_id="E")
    assert store.journal_error


def test_history_of_an_event_lists_its_transitions(tmp_path, clock):
    """Each event record keeps its transitions with times and the final outcome."""
    store = Store(tmp_path, clock)
    tracked = _apply(store, clock, _event())
    clock.advance(60)
    tracked = _apply(store, clock, _event(status="Started"), previous=tracked)
    clock.advance(60)
    _apply(store, clock, previous=tracked)
    rec = store.event_record("E1")
    assert [h["kind"] for h in rec["history"]] == ["appeared", "status_changed", "vanished"]
    assert rec["outcome"] == "completed" and rec["vanished_at"]


# --- hostile files: whatever state.json holds, maintd starts ------------------------------------

GOOD_EVENT = {"EventId": "E1", "EventType": "Reboot", "EventStatus": "Scheduled", "Resources": ["vm1"]}
GOOD_RECORD = {"event": GOOD_EVENT, "names_self": True, "first_seen": "2026-01-01T00:00:00Z", "history": []}


def _state(**parts):
    return json.dumps({"version": 1, "events": {"E1": GOOD_RECORD}, "results": {}, "flags": {}, **parts})


BAD_STATES = {
    "not UTF-8": b"\xff\xfe\x80 torn \xc3\x28",
    "random bytes": bytes(range(256)) * 4,
    "truncated": _state().encode()[:40],
    "empty": b"",
    "NUL bytes": b"\0" * 512,
    "missing names_self": _state(events={"E1": {k: v for k, v in GOOD_RECORD.items() if k != "names_self"}}).encode(),
    "results is a list": _state(results=[]).encode(),
    "a result is not an object": _state(results={"E1": {"approval": "sent"}}).encode(),
    "flags hold a string": _state(flags={"drains": "manual"}).encode(),
    "history is not a list": _state(events={"E1": {**GOOD_RECORD, "history": 5}}).encode(),
    "first_seen is not a time": _state(events={"E1": {**GOOD_RECORD, "first_seen": "soon"}}).encode(),
    "event is a list": _state(events={"E1": {**GOOD_RECORD, "event": []}}).encode(),
    "deep nesting": b'{"events": {}, "flags": {"x": ' + b'[' * 100_000 + b']' * 100_000 + b'}}',
}


@pytest.mark.parametrize("content", BAD_STATES.values(), ids=BAD_STATES.keys())
def test_any_unusable_state_file_is_moved_aside_and_the_store_works(tmp_path, clock, content):
    """Bytes that are not a maintd state (a torn write, a bit flip, a hand edit): moved aside, start fresh,
    and the next change is saved."""
    (tmp_path / "state.json").write_bytes(content)
    store = Store(tmp_path, clock)
    report = store.load()
    assert report.problem and "corrupt" in report.problem
    assert report.moved_aside and open(report.moved_aside, "rb").read() == content, "kept for inspection"
    assert store.tracked() == {} and store.flag("drains") is None
    store.record("E9", "approval", {"status": "sent"})
    fresh = Store(tmp_path, clock)
    assert fresh.load().problem is None and fresh.result("E9", "approval") == {"status": "sent"}


def _symlink_to_valid(tmp_path):
    target = tmp_path / "elsewhere.json"
    target.write_text(_state())
    (tmp_path / "state.json").symlink_to(target)


def _fifo(tmp_path):
    os.mkfifo(tmp_path / "state.json")


NOT_FILES = {
    "a directory": lambda p: (p / "state.json").mkdir(),
    "a dangling symlink": lambda p: (p / "state.json").symlink_to(p / "nowhere"),
    "a symlink to a valid state": _symlink_to_valid,
    "a FIFO": _fifo,
}


@pytest.mark.parametrize("make", NOT_FILES.values(), ids=NOT_FILES.keys())
def test_a_state_path_that_is_not_a_regular_file_is_moved_aside(tmp_path, clock, make):
    """A directory, a symlink (never followed: it could point anywhere) or a FIFO (never blocks the start)."""
    make(tmp_path)
    store = Store(tmp_path, clock)
    report = store.load()
    assert report.problem and "cannot read" in report.problem
    assert report.moved_aside and os.path.lexists(report.moved_aside)
    store.set_flag("drains", {"manual": {"reason": "x"}})
    assert (tmp_path / "state.json").is_file() and not (tmp_path / "state.json").is_symlink()
    assert not (tmp_path / "elsewhere.json").exists() or "drains" not in (tmp_path / "elsewhere.json").read_text()


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_an_unreadable_state_file_is_moved_aside(tmp_path, clock):
    """No read permission: the start goes on, fresh, and the old file is kept aside."""
    (tmp_path / "state.json").write_text(_state())
    os.chmod(tmp_path / "state.json", 0)
    report = Store(tmp_path, clock).load()
    assert "Permission denied" in (report.problem or "") and report.moved_aside


def test_moved_aside_files_are_named_by_the_clock_and_never_overwrite_each_other(tmp_path, clock):
    """Two bad files in the same second are both kept; the name carries the (injected) time."""
    asides = []
    for _ in range(2):
        (tmp_path / "state.json").write_bytes(b"\xff")
        asides.append(Store(tmp_path, clock).load().moved_aside)
    assert asides[0] != asides[1] and all(clock.now().strftime("%Y%m%dT%H%M%S") in a for a in asides)


def test_temp_files_left_by_a_crash_mid_write_are_removed_at_start(tmp_path, clock):
    """A kill -9 during a write leaves a temp file; the next start removes it and keeps the state."""
    Store(tmp_path, clock).set_flag("drains", {"manual": {"reason": "x"}})
    (tmp_path / ".state.json.k3j2_a").write_bytes(b'{"half')
    store = Store(tmp_path, clock)
    assert store.load().problem is None and store.flag("drains")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


def test_a_planted_journal_symlink_is_not_followed(tmp_path, clock):
    """Someone who could plant journal.jsonl -> /etc/something gets nothing written there."""
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    (tmp_path / "journal.jsonl").symlink_to(victim)
    store = Store(tmp_path, clock)
    store.journal("approval.manual", event_id="E1")
    assert victim.read_text() == "precious\n" and store.journal_error


def test_a_state_dir_others_can_write_is_refused_with_the_fix(tmp_path):
    """A group- or world-writable state dir could be used to forge approvals: refused, with the chmod."""
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o777)
    with pytest.raises(StateError, match="chmod go-w"):
        check_dir(open_dir)
    os.chmod(open_dir, 0o755)
    check_dir(open_dir)
    check_dir(tmp_path / "not-yet")  # created by the first write


def test_read_journal_skips_damaged_lines_and_files(tmp_path):
    """`maintd events --history` on a damaged journal: good lines are shown, bad bytes and files skipped."""
    good = [json.dumps({"t": f"2026-01-01T00:00:0{i}Z", "kind": "event.appeared", "event_id": f"E{i}"})
            for i in range(3)]
    (tmp_path / "journal.jsonl.1").mkdir()
    (tmp_path / "journal.jsonl.2").write_bytes(good[0].encode() + b"\n\xff\xfe garbage\n" + b"[" * 50_000 + b"\n")
    (tmp_path / "journal.jsonl").write_bytes(b"\x00\x00\n" + good[1].encode() + b"\n" + b'"text"\n5\n'
                                             + good[2].encode()[:20] + b"\n" + good[2].encode())
    assert [e["event_id"] for e in read_journal(tmp_path)] == ["E0", "E1", "E2"]


# --- the loop never waits on the disk -------------------------------------------------------------

def test_the_loop_path_neither_waits_for_a_slow_disk_nor_loses_a_change(tmp_path, clock, monkeypatch):
    """A worker's write is stuck in fsync; meanwhile the loop records transitions and reads results without
    waiting, and once the disk answers, state.json holds both the worker's result and the loop's event."""
    store = Store(tmp_path, clock)
    stuck, entered = threading.Event(), threading.Event()
    real_fsync = os.fsync

    def slow_fsync(fd):
        entered.set()
        stuck.wait(10)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", slow_fsync)
    worker = threading.Thread(target=store.record, args=("E0", "handler:drain:scheduled", {"outcome": "ok"}))
    worker.start()
    assert entered.wait(5)
    tracked, trs = diff({}, Document(1, (_event(),)), vm_name="vm1", boot_id="b", now=clock.now())
    store.apply(tracked, trs)  # would block here if it waited on the worker's fsync
    assert store.result("E0", "handler:drain:scheduled") == {"outcome": "ok"} and list(store.tracked()) == ["E1"]
    assert worker.is_alive() and store.dirty, "the worker is still in fsync: the loop did not wait for it"
    stuck.set()
    worker.join(5)
    assert store.wait_saved(5) and not store.dirty
    saved = json.loads((tmp_path / "state.json").read_text())
    assert "E1" in saved["events"] and saved["results"]["E0"]["handler:drain:scheduled"]["outcome"] == "ok"


def test_concurrent_writers_leave_the_newest_state_on_disk(tmp_path, clock):
    """Many threads record at once: every result is on disk when its call returns, and the file ends complete."""
    store = Store(tmp_path, clock)
    seen_on_disk = []

    def work(i):
        store.record(f"E{i}", "approval", {"status": "sent"})
        seen_on_disk.append(f"E{i}" in json.loads((tmp_path / "state.json").read_text())["results"])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert all(seen_on_disk) and len(seen_on_disk) == 20
    assert len(json.loads((tmp_path / "state.json").read_text())["results"]) == 20


def test_a_loop_change_on_a_full_disk_stays_in_memory_and_is_written_on_retry(tmp_path, clock, monkeypatch):
    """ENOSPC under the background writer: counted in write_failures/write_error, nothing raised to the loop;
    the retry the loop asks for (`save_soon`) writes it once space returns."""
    store = Store(tmp_path, clock)
    real_replace = os.replace
    monkeypatch.setattr(os, "replace", lambda *a, **k: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left")))
    _apply(store, clock, _event())
    assert store.dirty and store.write_failures == 1 and "No space left" in store.write_error
    assert list(store.tracked()) == ["E1"]
    monkeypatch.setattr(os, "replace", real_replace)
    store.save_soon()
    assert store.wait_saved(5) and not store.dirty and store.write_error is None
    assert "E1" in (tmp_path / "state.json").read_text()
