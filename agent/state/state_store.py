"""The on-disk state (`state.json`) and the append-only audit journal (`journal.jsonl`).

The in-memory copy is authoritative. Changes take `_lock` only for the in-memory update and the
snapshot (`json.dumps`, C speed); the file write, its fsync and the directory's fsync happen outside
it, one writer at a time (`_io`), so a reader never waits on the disk. Each change bumps a
generation number; a write covers the generation of its snapshot, and writers take snapshots in
`_io` order, so an older snapshot never lands over a newer one and a writer whose change a newer
write already covered returns at once (writes coalesce).

Two paths:
- `record`, `set_flag`, `flush` write through before they return (a handler
  result is on disk before the daemon acts on it) and raise `StateError` when the disk refuses.
- `apply` and `prune`, and `record` and `journal` with `wait=False` (the loop's path: the loop never
  opens, writes or fsyncs a file) return at once: a background writer saves them and the journal
  lines they queue. `save_soon` asks it to retry; `write_error` and `write_failures` tell
  the daemon how it went.

When the disk refuses (full, read-only) the change stays in memory and is written when it accepts
again — nothing is lost while the daemon runs. A state file that cannot be used (not UTF-8, not
JSON, too deep, the wrong shape, a directory, a symlink, unreadable) is moved aside
(`state.json.corrupt-*`) and maintd starts fresh. The file itself (reading, checking, moving aside,
atomic replacement) is `statefile`'s job, the journal's files `journal`'s: this module keeps the
in-memory copy, the locks and the generations.

Layout of state.json (format 1, `statefile.STATE_FORMAT`; files from before the field say "version": 1):
    {"format": 1,
     "events":  {EventId: {"event": {...IMDS fields}, "names_self", "first_seen", "boot_id", "not_before" (the last
                           NotBefore seen, kept once IMDS sends "" for a started event),
                           "seen_started", "history": [{"kind", "at", "status", "outcome"}],
                           "vanished_at", "outcome"}},
     "results": {EventId: {key: {...}}},     # handler results, approval records, handler notes, the event's
                                             # drain interval and its fleet-history write ("handler:drain:scheduled",
                                             # "approval", "note:silence", "rotation", "history")
     "flags":   {name: {...}}}               # JSON objects, e.g. the drains
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
from collections.abc import Container, Mapping
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, cast

from agent.clock import Clock
from agent.errors import StateError
from agent.model.events import parse_event
from agent.model.timefmt import iso_z, parse_iso
from agent.model.tracker import VANISHED, Tracked, Transition
from agent.state.journal import JOURNAL_FILE, set_aside_newer
from agent.state.journal import append as append_journal
from agent.state.state_file import (
    STATE_FILE,
    STATE_FORMAT,
    EventRecord,
    HistoryEntry,
    LoadReport,
    StateData,
    read_state,
    replace_file,
)


class Store:
    """Thread-safe state store; worker threads record handler results through it."""

    def __init__(self, directory: str | os.PathLike[str], clock: Clock, *, retention: float = 7 * 86400,
                 journal_max_bytes: int = 10 * 1024 * 1024, journal_keep: int = 5) -> None:
        self.dir = Path(directory)
        self.path = self.dir / STATE_FILE
        self.journal_path = self.dir / JOURNAL_FILE
        self.clock = clock
        self.retention = retention
        self.journal_max_bytes = journal_max_bytes
        self.journal_keep = journal_keep
        self._lock = threading.Lock()  # the in-memory state; never held across file I/O
        self._io = threading.Lock()  # one writer at a time (state file and journal)
        self._writer_done = threading.Condition(self._lock)
        self._data: StateData = {"format": STATE_FORMAT, "events": {}, "results": {}, "flags": {}}
        self._generation = 0  # bumped by every change
        self._saved = 0  # the generation on disk
        self._lines: list[str] = []  # journal lines not yet appended
        self._writing = False  # a background writer runs
        self._again = False  # a change arrived while it ran
        self.write_error: str | None = None
        self.journal_error: str | None = None
        self.write_failures = 0

    # --- loading ------------------------------------------------------------------------

    def load(self) -> LoadReport:
        """Read state.json; an unusable one (or a newer format's) is moved aside and the store starts empty.
        Journal files of a newer format are moved aside too."""
        data, report = read_state(self.path, self.clock)
        if data is not None:
            with self._lock:
                self._data = data
        return dataclasses.replace(report, journal_aside=set_aside_newer(self.dir, self.clock, self.journal_keep))

    # --- saving -------------------------------------------------------------------------

    def _changed(self) -> int:
        """Note a change (caller holds `_lock`); the generation a write must reach to cover it."""
        self._generation += 1
        return self._generation

    def _save(self, generation: int) -> None:
        """Append queued journal lines and, unless a write already covered `generation`, the state."""
        with self._io:
            with self._lock:
                lines, self._lines = self._lines, []
                snapshot = self._generation
                payload = json.dumps(self._data, separators=(",", ":"), sort_keys=True) \
                    if self._saved < generation else None
            self._append(lines)
            if payload is None:
                return
            try:
                replace_file(self.path, payload.encode())
            except OSError as exc:
                with self._lock:
                    self.write_failures += 1
                    self.write_error = f"{type(exc).__name__}: {exc}"
                raise StateError(f"cannot write {self.path}: {exc}") from exc
            with self._lock:
                self._saved = max(self._saved, snapshot)
                self.write_error = None

    def flush(self) -> None:
        """Write pending changes now; raises StateError (changes kept in memory) when the disk refuses."""
        with self._lock:
            generation = self._generation
        self._save(generation)

    def save_soon(self) -> None:
        """Have pending changes written by the background writer; returns at once (the loop's path)."""
        with self._lock:
            if self._writing:
                self._again = True
                return
            self._writing = True
        threading.Thread(target=self._write_behind, name="state-writer", daemon=True).start()

    def _write_behind(self) -> None:
        again = True
        while again:
            with self._lock:
                generation = self._generation
            try:
                self._save(generation)
            except StateError:
                pass  # kept in memory; write_error tells the daemon, whose next save_soon retries
            with self._lock:
                again, self._again = self._again and self.write_error is None, False
                if not again:
                    self._writing = False
                    self._writer_done.notify_all()

    def wait_saved(self, timeout: float) -> bool:
        """Block until the background writer is done; False on timeout. A seam for tests, which check
        the file after the loop's writes land (the daemon itself never waits on the disk)."""
        with self._lock:
            return self._writer_done.wait_for(lambda: not self._writing, timeout)

    @property
    def dirty(self) -> bool:
        """Whether some change has not reached the disk yet."""
        return self._saved < self._generation

    # --- events -------------------------------------------------------------------------

    def tracked(self) -> dict[str, Tracked]:
        """The events currently present in IMDS, as last seen."""
        with self._lock:
            out = {}
            for eid, rec in self._data["events"].items():
                if rec.get("vanished_at"):
                    continue
                out[eid] = Tracked(parse_event(rec["event"]), rec["names_self"], parse_iso(rec["first_seen"]),
                                   rec.get("boot_id", ""), rec.get("seen_started", False))
            return out

    def event_record(self, event_id: str) -> EventRecord | None:
        """The stored record of one event (present or vanished), as a copy."""
        with self._lock:
            rec = self._data["events"].get(event_id)
            return cast(EventRecord, json.loads(json.dumps(rec))) if rec is not None else None

    def event_records(self) -> dict[str, EventRecord]:
        """Every stored event record, as copies."""
        with self._lock:
            return cast(dict[str, EventRecord], json.loads(json.dumps(self._data["events"])))

    def gone_records(self, skip: Container[str] = ()) -> dict[str, EventRecord]:
        """The records of the events naming this VM that have left the document, but those in `skip`, as copies
        (only those are copied)."""
        with self._lock:
            gone = {eid: rec for eid, rec in self._data["events"].items()
                    if rec.get("vanished_at") and rec.get("names_self") and eid not in skip}
            return cast(dict[str, EventRecord], json.loads(json.dumps(gone)))

    def apply(self, tracked: dict[str, Tracked], transitions: list[Transition]) -> None:
        """Store the tracker's new view and each transition (history, journal); written in the background."""
        with self._lock:
            events = self._data["events"]
            changed = bool(transitions) or self._view_changed(tracked)
            for eid, t in tracked.items():
                event, first_seen = t.event.to_json(), iso_z(t.first_seen)
                rec = events.setdefault(eid, {"event": event, "names_self": t.names_self, "first_seen": first_seen,
                                              "history": []})
                rec.update({"event": event, "names_self": t.names_self, "first_seen": first_seen, "boot_id": t.boot_id,
                            "seen_started": t.seen_started, "vanished_at": None, "outcome": None})
                if t.event.not_before is not None:  # kept once the event has started (IMDS then sends "")
                    rec["not_before"] = iso_z(t.event.not_before)
            for tr in transitions:
                rec = events.setdefault(tr.event.event_id, {"history": [], "event": tr.event.to_json(),
                                                            "names_self": tr.names_self, "first_seen": iso_z(tr.at)})
                entry: HistoryEntry = {"kind": tr.kind, "at": iso_z(tr.at), "status": tr.event.status}
                if tr.outcome:
                    entry["outcome"] = tr.outcome
                rec["history"].append(entry)
                if tr.kind == VANISHED:
                    rec["vanished_at"] = iso_z(tr.at)
                    rec["outcome"] = tr.outcome
                self._queue_line(f"event.{tr.outcome if tr.outcome else tr.kind}", event_id=tr.event.event_id,
                                 event_type=tr.event.event_type, status=tr.event.status, names_self=tr.names_self,
                                 previous_status=tr.previous_status)
            if changed:
                self._changed()
        if changed:
            self.save_soon()

    def _view_changed(self, tracked: dict[str, Tracked]) -> bool:
        events = self._data["events"]
        return any(eid not in events or events[eid].get("event") != t.event.to_json() for eid, t in tracked.items())

    def prune(self, now: datetime) -> list[str]:
        """Drop vanished events (and their results) older than the retention period; written in the background."""
        cutoff = now - timedelta(seconds=self.retention)
        with self._lock:
            gone = [eid for eid, rec in self._data["events"].items()
                    if (at := rec.get("vanished_at")) and parse_iso(at) < cutoff]
            for eid in gone:
                del self._data["events"][eid]
                self._data["results"].pop(eid, None)
            if gone:
                self._changed()
        if gone:
            self.save_soon()
        return gone

    # --- results and flags --------------------------------------------------------------

    def result(self, event_id: str, key: str) -> dict[str, Any] | None:
        """A recorded result, e.g. key "handler:drain:scheduled" or "approval"."""
        with self._lock:
            value = self._data["results"].get(event_id, {}).get(key)
            return dict(value) if value is not None else None

    def results(self, event_id: str) -> dict[str, dict[str, Any]]:
        """Every recorded result of one event."""
        with self._lock:
            return cast(dict[str, dict[str, Any]], json.loads(json.dumps(self._data["results"].get(event_id, {}))))

    def records_under(self, key: str) -> dict[str, dict[str, Any]]:
        """Every event's result under `key` (a handler's note, say), by EventId, as copies."""
        with self._lock:
            return {eid: json.loads(json.dumps(results[key])) for eid, results in self._data["results"].items()
                    if key in results}

    def record(self, event_id: str, key: str, value: Mapping[str, Any], journal: str | None = None, *,
               wait: bool = True) -> None:
        """Store a result and write it through; raises StateError if the disk refused (kept in memory).
        With `wait=False` (the loop's path) it returns at once and the background writer saves it."""
        with self._lock:
            self._data["results"].setdefault(event_id, {})[key] = dict(value)
            if journal:
                self._queue_line(journal, event_id=event_id, key=key, **value)
            generation = self._changed()
        self._write(generation, wait)

    def _write(self, generation: int, wait: bool) -> None:
        """Write up to `generation` now (raising StateError), or hand it to the background writer."""
        if wait:
            self._save(generation)
        else:
            self.save_soon()

    def flag(self, name: str) -> Any:
        """A persisted flag (None when unset)."""
        with self._lock:
            return self._data["flags"].get(name)

    def set_flag(self, name: str, value: dict[str, Any] | None) -> None:
        """Set (or with None, clear) a persisted flag and write it through."""
        with self._lock:
            if value is None:
                self._data["flags"].pop(name, None)
            else:
                self._data["flags"][name] = value
            generation = self._changed()
        self._save(generation)

    # --- audit journal ------------------------------------------------------------------

    def journal(self, kind: str, *, wait: bool = True, **fields: Any) -> None:
        """Append one line to the audit journal now (with `wait=False`, by the background writer); a failure
        is remembered, never raised."""
        with self._lock:
            self._queue_line(kind, **fields)
        self._write(0, wait)

    def _queue_line(self, kind: str, **fields: Any) -> None:
        self._lines.append(json.dumps({"t": iso_z(self.clock.now()), "kind": kind, **fields}, default=str,
                                      separators=(",", ":")))

    def _append(self, lines: list[str]) -> None:
        """Append journal lines (caller holds `_io`); a failure is remembered in `journal_error`."""
        try:
            append_journal(self.journal_path, lines, self.journal_max_bytes, self.journal_keep)
        except OSError as exc:
            self.journal_error = f"{type(exc).__name__}: {exc}"
        else:
            if lines:
                self.journal_error = None
