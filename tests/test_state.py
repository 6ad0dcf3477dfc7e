"""The state store: atomic writes, corruption handling, disk failures, pruning, audit journal."""

from __future__ import annotations

import errno
import json
import os
import pytest

from agent.errors import StateError
from agent.events import Document, Event
from agent.state import Store, read_journal
from agent.tracker import diff


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
