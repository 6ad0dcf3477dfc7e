"""The `Emulator`: the event model, one HTTP server per VM, faults, a scenario timeline and the
request record, as tests, benchmarks and `maintd demo` drive it (see the package's docstring)."""

from __future__ import annotations

import threading
import time
from collections import deque
from datetime import UTC, datetime
from typing import Any

from agent.emulator.faults import ANSWER_KINDS, Fault, make_fault
from agent.emulator.model import Approval, ImdsDocument, Listener, Model, ModelClock, RecordedRequest
from agent.emulator.scenario import Scenario, Step
from agent.emulator.server import VmServer

MAX_RECORDED = 200_000
TICK_INTERVAL = 0.05


class _RealClock:
    def monotonic(self) -> float:
        return time.monotonic()

    def now(self) -> datetime:
        return datetime.now(UTC)


class Emulator:
    """The event model, one HTTP server per VM, faults, a scenario timeline and the request record."""

    def __init__(self, vms: list[str] | None = None, clock: ModelClock | None = None, time_scale: float = 1.0,
                 rate_limit: float | None = 5.0, etag: bool = True, started_duration: float | None = None,
                 approvals_required: int | None = None, *, broadcast: bool = True, unknown_event: str = "ok",
                 listener: Listener | None = None, zones: int = 0) -> None:
        """`rate_limit`: requests/s per VM before 429 (None or 0: none); `etag`: ETag and 304 (unverified
        on real IMDS); `started_duration`: emulated seconds a Started event with DurationInSeconds <= 0
        stays (default 10); `unknown_event`: "ok" (200, no-op) or "400" for approving an unknown EventId;
        `listener(name, fields)` hears every state change and must not block; `zones`: the VMs spread over this
        many availability zones in turn (compute `zone` 1, 2, ...; 0: none, `zone` empty)."""
        self.zones = zones
        self.vms = list(vms or ["vm-1"])
        self.clock: ModelClock = clock or _RealClock()
        self.listener = listener
        self.model = Model(self.vms, self.clock, time_scale=time_scale, started_duration=started_duration,
                           approvals_required=approvals_required, broadcast=broadcast, unknown_event=unknown_event,
                           listener=listener)
        if rate_limit is not None and rate_limit < 0:
            raise ValueError(f"rate_limit must be >= 0, got {rate_limit!r}")
        self.rate_limit = rate_limit
        self.etag = etag
        self.stopping = threading.Event()
        """Set by stop(): delayed and hanging requests give up."""
        self._servers: dict[str, VmServer] = {}
        self._faults: list[Fault] = []
        self._records: deque[RecordedRequest] = deque(maxlen=MAX_RECORDED)
        self._timeline: list[tuple[float, Step]] = []
        self._lock = threading.Lock()
        self._timeline_lock = threading.Lock()

    def _notify(self, name: str, **fields: Any) -> None:
        if self.listener is not None:
            self.listener(name, fields)

    # --- servers -----------------------------------------------------------------------------

    def start(self, host: str = "127.0.0.1", port: int = 0) -> dict[str, str]:
        """Serve every VM (ports `port`, `port + 1`, ...; 0: free ports); returns {vm: base URL}."""
        if self._servers:
            raise RuntimeError("the emulator is already started")
        self.stopping.clear()
        try:
            for i, vm in enumerate(self.vms):
                self._servers[vm] = VmServer(host, port + i if port else 0, vm, i, self)
        except OSError:
            self.stop()
            raise
        for server in self._servers.values():
            server.serve_in_thread()
        threading.Thread(target=self._tick_loop, name="emulator-tick", daemon=True).start()
        return self.urls

    @property
    def urls(self) -> dict[str, str]:
        """{vm: base URL} of the running servers."""
        return {vm: s.url for vm, s in self._servers.items()}

    def _tick_loop(self) -> None:
        while not self.stopping.wait(TICK_INTERVAL):
            self.tick()

    def stop(self) -> None:
        """Close every server and connection; hanging and delayed requests are dropped."""
        self.stopping.set()
        for server in self._servers.values():
            server.close()
        self._servers.clear()

    def tick(self) -> None:
        """Advance to the clock's now: due scenario steps, auto-start at NotBefore, removal after the duration."""
        with self._timeline_lock:
            now = self.clock.monotonic()
            due = [step for when, step in self._timeline if when <= now]
            self._timeline = [(when, step) for when, step in self._timeline if when > now]
            for step in due:
                self._play_step(step)
        self.model.tick()

    # --- events ------------------------------------------------------------------------------

    def add_event(self, event_type: str = "Reboot", resources: list[str] | None = None, notice: float | None = None,
                  description: str = "", event_source: str = "Platform", duration_seconds: int = -1,
                  status: str = "Scheduled", resource_type: str = "VirtualMachine",
                  event_id: str | None = None) -> str:
        """Create an event (see `Model.add_event`; `notice` defaults to the type's minimum); returns its EventId."""
        return self.model.add_event(event_type, resources, notice, description, event_source, duration_seconds,
                                    status, resource_type, event_id)

    def start_event(self, event_id: str) -> None:
        """Scheduled → Started, as if NotBefore had come or the approvals were in."""
        self.model.start_event(event_id)

    def complete_event(self, event_id: str) -> None:
        """The maintenance is over: the event leaves the document."""
        self.model.complete_event(event_id)

    def cancel_event(self, event_id: str) -> None:
        """Azure cancels: a Scheduled event leaves the document without starting."""
        self.model.cancel_event(event_id)

    def reset_incarnation(self) -> None:
        """The 24 h disable: events dropped, DocumentIncarnation back to 1, first-call delays armed again."""
        with self._lock:
            for fault in self._faults:
                fault.fired_vms.clear()
        self.model.reset_incarnation()

    def document(self, vm: str, api_version: str = "2020-07-01") -> ImdsDocument:
        """The Scheduled Events document `vm` would get now."""
        return self.model.document(vm, api_version)

    # --- faults ------------------------------------------------------------------------------

    def add_fault(self, vm: str | None = None, kind: str = "status", status: int = 503, count: int | None = None,
                  duration: float | None = None, path: str | None = None, method: str | None = None,
                  delay: float = 1.0, retry_after: float | str | None = None) -> None:
        """Inject a fault for `vm` (None: every VM), optionally only on requests whose path starts with
        `path` or whose method is `method`, for the next `count` requests and/or `duration` emulated
        seconds (neither: until cleared). Kinds: see `agent.emulator.faults`."""
        if vm is not None and vm not in self.vms:
            raise ValueError(f"vm: no emulated VM {vm!r} (VMs: {', '.join(self.vms)})")
        if duration is not None and (isinstance(duration, bool) or not isinstance(duration, (int, float))
                                     or duration <= 0):
            raise ValueError(f"duration: expected seconds > 0, got {duration!r}")
        until = None if duration is None else self.clock.monotonic() + self.model.real(duration)
        fault = make_fault(kind, vm, path, method, count, until, status, delay, retry_after)
        with self._lock:
            self._faults.append(fault)
        self._notify("emulator.fault_added", kind=kind, vm=vm, path=path, method=fault.method, count=count,
                     duration=duration)

    def clear_faults(self) -> None:
        """Remove every fault; hanging requests go on and are answered."""
        with self._lock:
            faults, self._faults = self._faults, []
        for fault in faults:
            fault.cleared.set()
        self._notify("emulator.faults_cleared", count=len(faults))

    def fault_count(self) -> int:
        """Faults that can still fire."""
        now = self.clock.monotonic()
        with self._lock:
            return sum(1 for f in self._faults if not f.expired(now)
                       and (f.kind == "first_call_delay" or f.count is None or f.fired < f.count))

    def take_faults(self, vm: str, path: str, method: str) -> list[Fault]:
        """The faults this request meets, counted as fired: every delaying one, then at most one that answers."""
        now = self.clock.monotonic()
        taken: list[Fault] = []
        with self._lock:
            for fault in self._faults:
                answers = fault.kind in ANSWER_KINDS
                if (not answers or not any(f.kind in ANSWER_KINDS for f in taken)) \
                        and fault.applies(vm, path, method, now):
                    fault.fire(vm)
                    taken.append(fault)
        return sorted(taken, key=lambda f: f.kind in ANSWER_KINDS)

    # --- scenarios ---------------------------------------------------------------------------

    def play(self, scenario: Scenario) -> None:
        """Schedule a scenario's steps from now on (`at` in emulated seconds); they run on `tick()`."""
        start = self.clock.monotonic()
        with self._timeline_lock:
            self._timeline += [(start + self.model.real(step.at), step) for step in scenario.steps]
        self.tick()

    def _play_step(self, step: Step) -> None:
        try:
            if step.action == "add":
                self.add_event(**step.args)
            elif step.action == "fault":
                self.add_fault(**step.args)
            else:
                getattr(self, f"{step.action}_event")(step.args["event_id"])
        except (KeyError, ValueError) as exc:  # e.g. canceling an event the agent's approval already started
            self._notify("scenario.skipped", at=step.at, action=step.action, reason=str(exc).strip("'\""))
            return
        self._notify("scenario.step", at=step.at, action=step.action, **step.args)

    # --- records -----------------------------------------------------------------------------

    def record(self, vm: str, method: str, path: str, query: str, headers: dict[str, str],
               body: bytes) -> RecordedRequest:
        """Record an IMDS request as it arrives; the server fills in the status once answered."""
        entry = RecordedRequest(vm, method, path, query, headers, body.decode("utf-8", "replace"), None,
                                self.clock.now().timestamp(), self.clock.monotonic())
        with self._lock:
            self._records.append(entry)
        return entry

    def requests(self, vm: str | None = None) -> list[RecordedRequest]:
        """Every IMDS request received (admin calls excluded), oldest first."""
        with self._lock:
            return [r for r in self._records if vm is None or r.vm == vm]

    def approvals(self, vm: str | None = None) -> list[Approval]:
        """Every accepted StartRequests POST (vm, event_ids, unknown, time, monotonic), oldest first."""
        return self.model.approvals(vm)
