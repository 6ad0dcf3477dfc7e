"""`alertmanager`: silence the alerts this VM's maintenance will fire, on every Alertmanager replica.

One silence per event and replica (`urls`), through the v2 API (`/api/v2/silences`): `createdBy`
`maintd@<vm>`, the comment naming the event, the configured `matchers` with `{vm}`,
`{computer_name}`, `{event_id}`, `{event_type}` filled in (see `silences.py`). In `scheduled` it is
made pending from NotBefore; it starts at once when the VM leaves rotation for the event (its drain,
or a manual one) or the event starts. The type is `before_drain`: the runner runs it right before
the phase's drain, wherever it is listed, telling it the VM leaves rotation next
(`Context.leaving_rotation`), so the silence it makes is active before the probe fails. It ends
`margin` after the expected end (NotBefore plus DurationInSeconds, or the type's default), and is
extended while the event is still there. The `completed` phase expires it (DELETE) at once when the
event was canceled or the VM is back in rotation, else as soon as it is back.

What keeps it while maintenance lasts is `keep` (maintd's keeper thread): every `recheck` it reads
each silence back and extends it, makes it again when someone deleted it, and watches the rotation
each second while a start or an expiry waits for it. The silence ids live in the handler's note on
the event in the state store, so a restart carries on with the same silences; a replica with no id
noted (a crash between the POST and the note, a lost state file) is searched for maintd's own
silence of the event (same createdBy and comment) before one is made, and extras are expired, so
there is never a second silence nor an orphan. Replicas are independent (tried all at once): one
down is retried (within the handler's timeout in a phase, every `recheck` after) while the others
get theirs.
Failures are a Warning health report (`handlers`, `<name>/silences`), `maintd_silence_failures_total`
and a `silence.failed` log line; by default (`on_failure: continue`) they never hold preparation.
"""

from __future__ import annotations

import socket
import threading
from dataclasses import dataclass
from datetime import datetime
from typing import Any, cast

from agent.errors import ConfigValueError, kept_in_memory
from agent.handlers.alertmanager_api import Credentials, Replica, ReplicaWork, instant, times, try_each
from agent.handlers.base import CANCELED, FAILED, OK, Context, Handler, Result, Services
from agent.handlers.drain import drain_key
from agent.handlers.silences import (
    DONE,
    EXPIRING,
    KEEPING,
    Matcher,
    NotedSilence,
    SilenceNote,
    Window,
    check_matchers,
    comment_template,
    expand,
    impact,
    needs_update,
    parse_matcher,
    window,
)
from agent.handlers.webhook import target
from agent.health.health_store import HealthState
from agent.health.rotation import MANUAL
from agent.model.config_schema import duration, list_of, opt, optional, text
from agent.model.events import STARTED, Event
from agent.model.outcomes import PHASE_COMPLETED
from agent.model.timefmt import iso_z, parse_iso
from agent.telemetry import logs

ROTATION_CHECK = 1.0
"""Seconds between looks at the rotation while a silence's start or expiry waits for it."""
MIN_ATTEMPT = 0.5
"""Seconds a request gets at least; no retry starts with less than this left of the budget."""
DEFAULT_COMMENT = "Azure {event_type} {event_id} of {vm} (maintd)"
_LOCKS: dict[tuple[str, str], threading.Lock] = {}
_LOCKS_LOCK = threading.Lock()


def _event_lock(handler: str, event_id: str) -> threading.Lock:
    """One lock per (handler, event), shared by a phase run and the keeper (and a reload's new object)."""
    with _LOCKS_LOCK:
        return _LOCKS.setdefault((handler, event_id), threading.Lock())


@dataclass(frozen=True)
class AlertmanagerOptions:
    urls: tuple[str, ...] = opt(list_of(text(r"^https?://[^/@\s]+(/\S*)?$", "an http(s) URL without user:password@ "
                                                                          "(use basic_auth_file)"), 1, unique=True),
                                doc="every Alertmanager replica (each gets its own silence), e.g. http://am-0:9093")
    matchers: tuple[Matcher, ...] = opt(list_of(parse_matcher, 1),
                                        doc="Alertmanager matchers, e.g. instance=~\"{computer_name}(:[0-9]+)?\"; "
                                            "{vm} {computer_name} {event_id} {event_type} expand")
    margin: float = opt(duration(60, 7 * 86400), 600.0, "the silence ends this long after the expected end of the "
                                                        "maintenance (and is extended while the event lasts)")
    comment: str = opt(comment_template, DEFAULT_COMMENT, "the silence's comment (must include {event_id})")
    token_file: str | None = opt(optional(text(r"^/", "an absolute path")), None,
                                 "file with a bearer token for Alertmanager (mode 600)")
    basic_auth_file: str | None = opt(optional(text(r"^/", "an absolute path")), None,
                                      "file with user:password for basic auth (mode 600)")
    recheck: float = opt(duration(1, 600), 30.0, "while maintenance lasts, how often each silence is read back "
                                                 "(extended, made again if someone deleted it)")
    request_timeout: float = opt(duration(0.1, 60), 10.0, "timeout of one whole request to a replica")

    def validate(self) -> None:
        try:
            check_matchers(self.matchers)
        except ConfigValueError as exc:
            raise exc.under("matchers") from None
        if self.token_file and self.basic_auth_file:
            raise ConfigValueError("basic_auth_file", "set one of token_file and basic_auth_file, not both")
        if self.recheck > self.margin / 2:
            raise ConfigValueError("recheck", "must be at most half of margin, so a silence is extended before "
                                   "it ends")


class AlertmanagerHandler(Handler):
    type_name = "alertmanager"
    Options = AlertmanagerOptions
    defaults = {"on_failure": "continue"}
    before_drain = True

    def __init__(self, spec: Any, services: Services) -> None:
        super().__init__(spec, services)
        self.log = logs.get("alertmanager")
        services.metrics.silence_failures.labels(spec.name)
        services.metrics.silences.labels(spec.name).set(0)
        self._checked: dict[str, float] = {}
        """Per event: monotonic time of the last read-back (the keeper's `recheck`)."""

    # --- the phases ---------------------------------------------------------------------------

    def scheduled(self, ctx: Context) -> Result:
        return self._silence(ctx)

    def started(self, ctx: Context) -> Result:
        return self._silence(ctx)

    def completed(self, ctx: Context) -> Result:
        eid = ctx.event.event_id
        with _event_lock(self.spec.name, eid):
            note = self._note(eid) or self._new_note(ctx.event)
            verdict = self.services.rotation.verdict()
            if ctx.outcome != CANCELED and not verdict.in_rotation:
                note["state"] = EXPIRING
                self._save(eid, note)
                return Result(OK, f"the silence expires once the VM is back in rotation ({verdict.reason})")
            failed = self._expire(eid, note, self._deadline(ctx.timeout), ctx.cancel)
        if failed:
            return Result(FAILED, "could not expire the silence on " + "; ".join(failed))
        return Result(OK, "silence expired" + (" (the event was canceled)" if ctx.outcome == CANCELED else ""))

    def _silence(self, ctx: Context) -> Result:
        eid = ctx.event.event_id
        with _event_lock(self.spec.name, eid):
            note = self._note(eid) or self._new_note(ctx.event)
            note["state"] = KEEPING
            failed = self._sync(eid, ctx.event, note, self._deadline(ctx.timeout), ctx.cancel, ctx.leaving_rotation)
        if failed:
            return Result(FAILED, "no silence on " + "; ".join(failed) + f" ({note['summary']}); retried every "
                          f"{self.options.recheck:g}s while the maintenance lasts")
        return Result(OK, note["summary"])

    def _deadline(self, timeout: float) -> float:
        return self.services.clock.monotonic() + max(0.0, timeout - 1.0)

    # --- the keeper ----------------------------------------------------------------------------

    def keep(self) -> float | None:
        """Extend, remake and expire the silences of every event this handler keeps one for."""
        waits: list[float] = []
        tracked = self.services.store.tracked()
        for eid, note in self._notes().items():
            if note.get("state") not in (KEEPING, EXPIRING):
                continue
            lock = _event_lock(self.spec.name, eid)
            if not lock.acquire(blocking=False):  # a phase's run works on it (retrying, maybe in the background)
                waits.append(ROTATION_CHECK)
                continue
            try:
                wait = self._keep_one(eid, self._note(eid) or note, tracked[eid].event if eid in tracked else None)
            finally:
                lock.release()
            if wait is not None:
                waits.append(wait)
        return min(waits, default=None)

    def _keep_one(self, eid: str, note: SilenceNote, event: Event | None) -> float | None:
        clock, never = self.services.clock, threading.Event()
        if note.get("state") == EXPIRING or (event is None and PHASE_COMPLETED not in self.spec.phases):
            return self._keep_expiring(eid, note)
        if event is None:
            return None  # the event is gone: its completed run decides
        now, mono = clock.now(), clock.monotonic()
        want = self._window(event, note, now)
        due = self._checked.get(eid, float("-inf")) + self.options.recheck
        starting = want.starts <= now and any(parse_iso(s["starts_at"]) > now
                                              for s in note["silences"].values() if s.get("id"))
        if mono >= due or starting:  # read back every recheck; at once when the VM left rotation
            self._sync(eid, event, note, mono, never)
        return min(ROTATION_CHECK, max(0.0, self._checked[eid] + float(self.options.recheck) - clock.monotonic()))

    def _keep_expiring(self, eid: str, note: SilenceNote) -> float | None:
        """After the event: expire once the VM is back in rotation; a silence that ran out needs nothing."""
        now = self.services.clock.now()
        ends = [parse_iso(s["ends_at"]) for s in note.get("silences", {}).values() if s.get("id")]
        if not ends or max(ends) <= now:
            note["state"] = DONE
            self._save(eid, note)
            return None
        if not self.services.rotation.verdict().in_rotation:
            return ROTATION_CHECK
        self._expire(eid, note, self.services.clock.monotonic(), threading.Event())
        return None if note["state"] == DONE else self.options.recheck

    # --- what a silence is ----------------------------------------------------------------------

    def _fields(self, event: Event) -> dict[str, str]:
        s = self.services.settings
        return {"vm": s.vm_name, "computer_name": s.computer_name or socket.gethostname().split(".")[0],
                "event_id": event.event_id, "event_type": event.event_type}

    def _new_note(self, event: Event) -> SilenceNote:
        fields = self._fields(event)
        return {"state": KEEPING, "created_by": f"maintd@{fields['vm']}",
                "comment": expand(self.options.comment, fields),
                "matchers": [m.expanded(fields) for m in self.options.matchers],
                "not_before": iso_z(event.not_before) if event.not_before else None, "silences": {}}

    def _window(self, event: Event, note: SilenceNote, now: datetime, leaving: bool = False) -> Window:
        if event.not_before is not None:
            note["not_before"] = iso_z(event.not_before)
        elif not note.get("not_before"):
            note.setdefault("started_at", iso_z(now))
        begins = parse_iso(note.get("not_before") or note["started_at"])
        drains = self.services.rotation.drains()
        start_now = leaving or event.status == STARTED or drain_key(event.event_id) in drains or MANUAL in drains
        return window(now=now, begins=begins, impact_seconds=impact(event.event_type, event.duration_seconds),
                      margin=self.options.margin, start_now=start_now)

    # --- talking to the replicas ------------------------------------------------------------------

    def _sync(self, eid: str, event: Event, note: SilenceNote, deadline: float, cancel: threading.Event,
              leaving: bool = False) -> list[str]:
        """Make each replica's silence match the event now (retrying until `deadline`; `leaving`: the VM leaves
        rotation for the event as this run goes on, so the silence starts now); the failures."""
        def one(replica: Replica) -> None:
            now = self.services.clock.now()
            note["silences"][replica.url] = self._sync_one(replica, note, self._window(event, note, now, leaving),
                                                           now)

        failed = self._each_replica(eid, note, list(self.options.urls), one, deadline, cancel)
        self._checked[eid] = self.services.clock.monotonic()
        self._save(eid, note)
        self._count()
        return failed

    def _sync_one(self, replica: Replica, note: SilenceNote, want: Window, now: datetime) -> NotedSilence:
        url = replica.url
        known = _noted_id(note, url)
        current = replica.get(known) if known else None
        if current is None:
            found = replica.ours(note)
            current = found[0] if found else None
            for extra in found[1:]:
                replica.delete(extra["id"])
            if current is not None:
                self.log.info("silence.adopted", handler=self.spec.name, url=target(url), silence_id=current["id"],
                              reason="maintd's own silence of this event, found on the replica")
            elif known:
                self.log.warning("silence.recreated", handler=self.spec.name, url=target(url), previous=known,
                                 reason="the silence was deleted or has expired while the maintenance lasts")
        if current is not None:
            have = times(current)
            if not needs_update(have, want, now, self.options.recheck):
                return {"id": current["id"], "starts_at": instant(have.starts), "ends_at": instant(have.ends)}
            starts = have.starts if have.starts <= now else want.starts  # an active silence keeps its start
            want = Window(starts, max(want.ends, have.ends))
        sid = replica.post(note, want, current["id"] if current else None)
        event = "silence.created" if current is None else "silence.extended" if sid == current["id"] else \
            "silence.replaced"
        self.log.info(event, handler=self.spec.name, url=target(url), silence_id=sid,
                      starts_at=instant(want.starts), ends_at=instant(want.ends))
        return {"id": sid, "starts_at": instant(want.starts), "ends_at": instant(want.ends)}

    def _expire(self, eid: str, note: SilenceNote, deadline: float, cancel: threading.Event) -> list[str]:
        """Expire maintd's silences of the event on every replica noted or configured; the failures."""
        def one(replica: Replica) -> None:
            url = replica.url
            ids = {s["id"] for s in replica.ours(note)}
            known = _noted_id(note, url)
            for sid in sorted(ids | ({known} if known else set())):
                replica.delete(sid)
                self.log.info("silence.expired", handler=self.spec.name, url=target(url), silence_id=sid)
            note["silences"].pop(url, None)

        urls = list(dict.fromkeys([*note["silences"], *self.options.urls]))
        failed = self._each_replica(eid, note, urls, one, deadline, cancel)
        note["state"] = EXPIRING if failed else DONE
        if not failed:
            note["summary"] = "silence expired"
        self._save(eid, note)
        self._count()
        return failed

    def _each_replica(self, eid: str, note: SilenceNote, urls: list[str],
                      one: ReplicaWork, deadline: float,
                      cancel: threading.Event) -> list[str]:
        """Run `one` for each replica, retrying the failed ones with backoff until `deadline` (one round when
        it has passed); every failure counted, told once per streak, and shown as a health report."""
        clock, delay, pending = self.services.clock, MIN_ATTEMPT, urls
        credentials = Credentials(self.options.token_file, self.options.basic_auth_file)
        while True:
            timeout = min(self.options.request_timeout, max(MIN_ATTEMPT, deadline - clock.monotonic()))
            errors = try_each(pending, one, timeout, credentials)
            left = deadline - clock.monotonic()
            if not errors or cancel.is_set() or left < delay + MIN_ATTEMPT:
                break
            self._save(eid, note)  # what the others made is noted while the failed ones are tried again
            if clock.wait(cancel, delay):
                break
            pending, delay = list(errors), min(delay * 2, 5.0)
        self._tell(eid, note, urls, errors)
        return [f"{target(u)}: {e}" for u, e in errors.items()]

    def _tell(self, eid: str, note: SilenceNote, urls: list[str], errors: dict[str, str]) -> None:
        for url in urls:
            entry = note["silences"].get(url)
            error = errors.get(url)
            if error is not None:
                self.services.metrics.silence_failures.labels(self.spec.name).inc()
                if entry is None:
                    entry = note["silences"][url] = {"id": None}
                if entry.get("error") != error:
                    self.log.warning("silence.failed", handler=self.spec.name, event_id=eid, url=target(url),
                                     error=error, action=f"retried every {self.options.recheck:g}s")
                entry["error"] = error
            elif entry is not None:
                entry.pop("error", None)
        ok = [s for s in note["silences"].values() if s.get("id") and not s.get("error")]
        ends = max((s["ends_at"] for s in ok), default=None)
        ids = ", ".join(s["id"] or "" for s in ok)
        note["summary"] = (f"silence {ids} until {ends} on {len(ok)} of {len(urls)} Alertmanagers" if ok else
                           f"no silence on any of {len(urls)} Alertmanagers")
        prop = f"{self.spec.name}/silences"
        if errors:
            self.services.health.set("handlers", prop, HealthState.WARNING,
                                     f"event {eid}: " + "; ".join(f"{target(u)}: {e}" for u, e in errors.items()))
        else:
            self.services.health.remove("handlers", prop)

    def _note(self, eid: str) -> SilenceNote | None:
        """The note on the event, as this handler wrote it."""
        return cast(SilenceNote | None, self.note(eid))

    def _notes(self) -> dict[str, SilenceNote]:
        """The notes on every stored event, as this handler wrote them."""
        return cast(dict[str, SilenceNote], self.notes())

    def _save(self, eid: str, note: SilenceNote) -> None:
        with kept_in_memory():
            self.set_note(eid, note)

    def _count(self) -> None:
        held = sum(1 for note in self._notes().values() if note.get("state") in (KEEPING, EXPIRING)
                   for s in note.get("silences", {}).values() if s.get("id"))
        self.services.metrics.silences.labels(self.spec.name).set(held)


def _noted_id(note: SilenceNote, url: str) -> str | None:
    """The id of the replica's silence the note keeps (None: none)."""
    entry = note["silences"].get(url)
    return entry.get("id") if entry is not None else None
