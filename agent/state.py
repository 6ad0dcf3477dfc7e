"""The on-disk state (`state.json`) and the append-only audit journal (`journal.jsonl`).

The in-memory copy is authoritative; every change is written atomically (temp file, fsync,
rename, fsync of the directory). When the disk refuses (full, read-only) the change stays in
memory, `StateError` tells the caller, and the next `flush()` tries again — nothing is lost
while the daemon runs. A state file that cannot be read is moved aside (`state.json.corrupt-*`)
and maintd starts fresh.

Layout of state.json (version 1):
    {"version": 1,
     "events":  {EventId: {"event": {...IMDS fields}, "names_self", "first_seen", "boot_id",
                           "seen_started", "history": [{"kind", "at", "status", "outcome"}],
                           "vanished_at", "outcome"}},
     "results": {EventId: {key: {...}}},     # handler results, approval records ("handler:drain:scheduled", "approval")
     "flags":   {name: value}}               # e.g. the manual drain
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, Iterator

from agent.clock import Clock
from agent.errors import StateError
from agent.events import parse_event
from agent.tracker import Tracked, Transition

STATE_FILE = "state.json"
JOURNAL_FILE = "journal.jsonl"
_VERSION = 1


def _iso(t: datetime) -> str:
    return t.isoformat().replace("+00:00", "Z")


def _parse_iso(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


@dataclass(frozen=True)
class LoadReport:
    """What `Store.load` found: how many events, and the corrupt file moved aside (if any)."""

    events: int
    moved_aside: str | None = None
    problem: str | None = None


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
        self._lock = threading.RLock()
        self._data: dict[str, Any] = {"version": _VERSION, "events": {}, "results": {}, "flags": {}}
        self._dirty = False
        self.write_error: str | None = None
        self.journal_error: str | None = None
        self.write_failures = 0

    # --- loading and saving -------------------------------------------------------------

    def load(self) -> LoadReport:
        """Read state.json; a corrupt one is moved aside and the store starts empty."""
        with self._lock:
            try:
                raw = self.path.read_text(encoding="utf-8")
            except FileNotFoundError:
                return LoadReport(0)
            except OSError as exc:
                return LoadReport(0, problem=f"cannot read {self.path}: {exc}")
            try:
                data = json.loads(raw)
                if not isinstance(data, dict) or not isinstance(data.get("events"), dict):
                    raise ValueError("not a maintd state object")
                for rec in data["events"].values():
                    parse_event(rec["event"])
                    _parse_iso(rec["first_seen"])
            except (ValueError, KeyError, TypeError) as exc:
                aside = self.path.with_name(f"{STATE_FILE}.corrupt-{int(time.time())}")
                try:
                    os.replace(self.path, aside)
                except OSError:
                    aside = None  # type: ignore[assignment]
                return LoadReport(0, moved_aside=str(aside) if aside else None, problem=f"corrupt state file: {exc}")
            data.setdefault("results", {})
            data.setdefault("flags", {})
            self._data = data
            return LoadReport(len(data["events"]))

    def _write(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{STATE_FILE}.tmp")
        payload = json.dumps(self._data, separators=(",", ":"), sort_keys=True).encode()
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            view = memoryview(payload)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.path)
        dfd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    def flush(self) -> None:
        """Write pending changes; raises StateError (changes kept in memory) when the disk refuses."""
        with self._lock:
            if not self._dirty:
                return
            try:
                self._write()
            except OSError as exc:
                self.write_failures += 1
                self.write_error = f"{type(exc).__name__}: {exc}"
                raise StateError(f"cannot write {self.path}: {exc}") from exc
            self._dirty = False
            self.write_error = None

    def _changed(self) -> None:
        self._dirty = True
        self.flush()

    @property
    def dirty(self) -> bool:
        """Whether some change has not reached the disk yet."""
        return self._dirty

    # --- events -------------------------------------------------------------------------

    def tracked(self) -> dict[str, Tracked]:
        """The events currently present in IMDS, as last seen."""
        with self._lock:
            out = {}
            for eid, rec in self._data["events"].items():
                if rec.get("vanished_at"):
                    continue
                out[eid] = Tracked(parse_event(rec["event"]), rec["names_self"], _parse_iso(rec["first_seen"]),
                                   rec.get("boot_id", ""), rec.get("seen_started", False))
            return out

    def event_record(self, event_id: str) -> dict[str, Any] | None:
        """The stored record of one event (present or vanished), as a copy."""
        with self._lock:
            rec = self._data["events"].get(event_id)
            return json.loads(json.dumps(rec)) if rec is not None else None

    def event_records(self) -> dict[str, dict[str, Any]]:
        """Every stored event record, as copies."""
        with self._lock:
            return json.loads(json.dumps(self._data["events"]))

    def apply(self, tracked: dict[str, Tracked], transitions: list[Transition]) -> None:
        """Store the tracker's new view and each transition in the event's history and the journal."""
        with self._lock:
            events = self._data["events"]
            for eid, t in tracked.items():
                rec = events.setdefault(eid, {"history": []})
                rec.update(event=t.event.to_json(), names_self=t.names_self, first_seen=_iso(t.first_seen),
                           boot_id=t.boot_id, seen_started=t.seen_started, vanished_at=None, outcome=None)
            for tr in transitions:
                rec = events.setdefault(tr.event.event_id, {"history": [], "event": tr.event.to_json(),
                                                            "names_self": tr.names_self, "first_seen": _iso(tr.at)})
                rec["history"].append({"kind": tr.kind, "at": _iso(tr.at), "status": tr.event.status,
                                       **({"outcome": tr.outcome} if tr.outcome else {})})
                if tr.kind == "vanished":
                    rec["vanished_at"] = _iso(tr.at)
                    rec["outcome"] = tr.outcome
                self.journal(f"event.{tr.outcome if tr.outcome else tr.kind}", event_id=tr.event.event_id,
                             event_type=tr.event.event_type, status=tr.event.status, names_self=tr.names_self,
                             previous_status=tr.previous_status)
            if transitions or self._view_changed(tracked):
                self._changed()

    def _view_changed(self, tracked: dict[str, Tracked]) -> bool:
        return any(self._data["events"][eid]["event"] != t.event.to_json() for eid, t in tracked.items())

    def prune(self, now: datetime) -> list[str]:
        """Drop vanished events (and their results) older than the retention period."""
        cutoff = now - timedelta(seconds=self.retention)
        with self._lock:
            gone = [eid for eid, rec in self._data["events"].items()
                    if rec.get("vanished_at") and _parse_iso(rec["vanished_at"]) < cutoff]
            for eid in gone:
                del self._data["events"][eid]
                self._data["results"].pop(eid, None)
            if gone:
                self._changed()
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
            return json.loads(json.dumps(self._data["results"].get(event_id, {})))

    def record(self, event_id: str, key: str, value: dict[str, Any], journal: str | None = None) -> None:
        """Store a result and write it through; raises StateError if the disk refused (kept in memory)."""
        with self._lock:
            self._data["results"].setdefault(event_id, {})[key] = value
            if journal:
                self.journal(journal, event_id=event_id, key=key, **value)
            self._changed()

    def clear_result(self, event_id: str, key: str) -> None:
        """Forget a result (an idempotent handler interrupted by a crash runs again)."""
        with self._lock:
            if self._data["results"].get(event_id, {}).pop(key, None) is not None:
                self._changed()

    def flag(self, name: str) -> Any:
        """A persisted flag (None when unset)."""
        with self._lock:
            return self._data["flags"].get(name)

    def set_flag(self, name: str, value: Any) -> None:
        """Set (or with None, clear) a persisted flag and write it through."""
        with self._lock:
            if value is None:
                self._data["flags"].pop(name, None)
            else:
                self._data["flags"][name] = value
            self._changed()

    # --- audit journal ------------------------------------------------------------------

    def journal(self, kind: str, **fields: Any) -> None:
        """Append one line to the audit journal; a failure is remembered, never raised."""
        line = json.dumps({"t": _iso(self.clock.now()), "kind": kind, **fields}, default=str, separators=(",", ":"))
        with self._lock:
            try:
                self.dir.mkdir(parents=True, exist_ok=True)
                self._rotate_if_needed(len(line) + 1)
                with open(self.journal_path, "a", encoding="utf-8") as fh:
                    fh.write(line + "\n")
                self.journal_error = None
            except OSError as exc:
                self.journal_error = f"{type(exc).__name__}: {exc}"

    def _rotate_if_needed(self, incoming: int) -> None:
        try:
            size = self.journal_path.stat().st_size
        except FileNotFoundError:
            return
        if size + incoming <= self.journal_max_bytes:
            return
        for i in range(self.journal_keep - 1, 0, -1):
            older = self.journal_path.with_name(f"{JOURNAL_FILE}.{i}")
            if older.exists():
                os.replace(older, self.journal_path.with_name(f"{JOURNAL_FILE}.{i + 1}"))
        os.replace(self.journal_path, self.journal_path.with_name(f"{JOURNAL_FILE}.1"))


def read_journal(directory: str | os.PathLike[str], keep: int = 100) -> Iterator[dict[str, Any]]:
    """Audit journal entries, oldest first, across rotated files; unreadable lines are skipped."""
    base = Path(directory) / JOURNAL_FILE
    files = [base.with_name(f"{JOURNAL_FILE}.{i}") for i in range(keep, 0, -1)] + [base]
    for path in files:
        try:
            with open(path, encoding="utf-8") as fh:
                for line in fh:
                    try:
                        entry = json.loads(line)
                    except ValueError:
                        continue
                    if isinstance(entry, dict):
                        yield entry
        except FileNotFoundError:
            continue
