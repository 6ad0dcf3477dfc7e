"""A faithful IMDS Scheduled Events emulator for tests, benchmarks, `maintd demo` and rehearsals.

    emu = Emulator(vms=["vm-1", "vm-2"])
    urls = emu.start()                      # {"vm-1": "http://127.0.0.1:PORT", ...}: one server per VM
    eid = emu.add_event(event_type="Reboot", resources=["vm-1"], notice=900)
    emu.add_fault(kind="status", status=503, count=3)
    emu.requests("vm-1"); emu.approvals(); emu.stop()

Each VM has its own port, as each Azure VM has its own IMDS. Every VM sees every event (one
availability set), and filters on Resources as a real client must. It shares no code with the
client side (`agent.events`, `agent.imds`).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import deque
from datetime import datetime, timezone
from typing import Any

from agent.emulator.model import Model, ModelClock
from agent.emulator.server import FAULT_KINDS, Fault, TokenBucket, VmServer, recorded

MAX_RECORDED = 200_000
TICK_INTERVAL = 0.05


class _RealClock:
    def monotonic(self) -> float:
        return time.monotonic()

    def now(self) -> datetime:
        return datetime.now(timezone.utc)


class Emulator:
    """The model, one HTTP server per VM, faults and the request record."""

    def __init__(self, vms: list[str] | None = None, clock: ModelClock | None = None, time_scale: float = 1.0,
                 rate_limit: float = 5.0, etag: bool = False, unknown_event: str = "ok",
                 started_duration: float | None = None, approvals_required: int | None = None,
                 broadcast: bool = True) -> None:
        self.vms = list(vms or ["vm-1"])
        if len(set(v.casefold() for v in self.vms)) != len(self.vms):
            raise ValueError("VM names must be unique")
        self.clock = clock or _RealClock()
        self.model = Model(self.vms, self.clock, time_scale=time_scale, started_duration=started_duration,
                           approvals_required=approvals_required, broadcast=broadcast, unknown_event=unknown_event)
        self.rate_limit = rate_limit
        self.etag = etag
        self.servers: dict[str, VmServer] = {}
        self.faults: list[Fault] = []
        self.hang_released = threading.Event()
        self._buckets: dict[str, TokenBucket] = {}
        self._log: deque[dict[str, Any]] = deque(maxlen=MAX_RECORDED)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None

    # --- servers -----------------------------------------------------------------------------

    def start(self, host: str = "127.0.0.1", port: int = 0) -> dict[str, str]:
        """Serve every VM (ports from `port` upwards, or free ports when 0); returns {vm: base URL}."""
        for i, vm in enumerate(self.vms):
            server = VmServer(host, port + i if port else 0, vm, str(uuid.uuid4()), self)
            threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, name=f"emu-{vm}",
                             daemon=True).start()
            self.servers[vm] = server
        if isinstance(self.clock, _RealClock):
            self._ticker = threading.Thread(target=self._tick_loop, name="emu-tick", daemon=True)
            self._ticker.start()
        return self.urls

    @property
    def urls(self) -> dict[str, str]:
        return {vm: s.url for vm, s in self.servers.items()}

    def _tick_loop(self) -> None:
        while not self._stop.wait(TICK_INTERVAL):
            self.model.tick()

    def stop(self) -> None:
        self._stop.set()
        self.hang_released.set()
        for server in self.servers.values():
            server.shutdown()
            server.server_close()
        self.servers.clear()

    def tick(self) -> None:
        """Advance the model to the clock's now (auto-start at NotBefore, removal after the started time)."""
        self.model.tick()

    # --- events ------------------------------------------------------------------------------

    def add_event(self, **kwargs: Any) -> str:
        """Create an event (see `Model.add_event`); returns its EventId."""
        return self.model.add_event(**kwargs)

    def start_event(self, event_id: str) -> None:
        self.model.start_event(event_id)

    def complete_event(self, event_id: str) -> None:
        self.model.complete_event(event_id)

    def cancel_event(self, event_id: str) -> None:
        self.model.cancel_event(event_id)

    def reset_incarnation(self) -> None:
        self.model.reset_incarnation()

    def document(self, vm: str, api_version: str = "2020-07-01") -> dict[str, Any]:
        return self.model.document(vm, api_version)

    # --- faults ------------------------------------------------------------------------------

    def add_fault(self, kind: str, vm: str | None = None, path: str | None = None, count: int | None = None,
                  duration: float | None = None, **params: Any) -> None:
        """Inject a fault for `count` requests or `duration` emulated seconds (both None: until cleared)."""
        if kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault kind {kind!r}; kinds: {', '.join(FAULT_KINDS)}")
        if vm is not None and vm not in self.vms:
            raise ValueError(f"no emulated VM {vm!r}")
        if kind == "first_call_delay" and count is None:
            count = 1
        until = self.clock.monotonic() + self.model.real(duration) if duration is not None else None
        allowed = {"status", "delay", "retry_after"}
        unknown = set(params) - allowed
        if unknown:
            raise ValueError(f"unknown fault parameters {sorted(unknown)}; allowed: {sorted(allowed)}")
        if "retry_after" in params and params["retry_after"] is not None:
            params["retry_after"] = str(params["retry_after"])
        with self._lock:
            if kind == "hang":
                self.hang_released.clear()
            self.faults.append(Fault(kind, vm, path, count, until, **params))

    def clear_faults(self) -> None:
        with self._lock:
            self.faults.clear()
        self.hang_released.set()

    def take_fault(self, vm: str, path: str) -> Fault | None:
        """The first fault that applies to this request, counted as fired."""
        now = self.clock.monotonic()
        with self._lock:
            for fault in self.faults:
                if fault.applies(vm, path, now):
                    fault.fired += 1
                    return fault
        return None

    def bucket(self, vm: str) -> TokenBucket:
        with self._lock:
            if vm not in self._buckets:
                self._buckets[vm] = TokenBucket(self.rate_limit, self.clock.monotonic())
            return self._buckets[vm]

    # --- records -----------------------------------------------------------------------------

    def record(self, vm: str, method: str, path: str, query: str, headers: dict[str, str], body: bytes,
               status: int) -> None:
        if path.startswith("/admin/"):
            return
        entry = recorded(vm, method, path, query, headers, body, status, self.clock.now().timestamp(),
                         self.clock.monotonic())
        with self._lock:
            self._log.append(entry)

    def requests(self, vm: str | None = None) -> list[dict[str, Any]]:
        """Every IMDS request received (admin calls excluded), oldest first."""
        with self._lock:
            return [r for r in self._log if vm is None or r["vm"] == vm]

    def approvals(self, vm: str | None = None) -> list[dict[str, Any]]:
        """Every accepted StartRequests POST: vm, event_ids, time."""
        with self.model.lock:
            return [a for a in self.model.approval_log if vm is None or a["vm"] == vm]

    # --- admin API ---------------------------------------------------------------------------

    def admin(self, method: str, route: str, data: dict[str, Any], vm: str) -> tuple[int, Any]:
        """The /admin/ API: (status, JSON body)."""
        parts = route.split("/")
        if route == "events" and method == "POST":
            if "type" in data and "event_type" not in data:
                data["event_type"] = data.pop("type")
            return 201, {"EventId": self.add_event(**data)}
        if route == "events" and method == "GET":
            return 200, self.document(data.get("vm", vm))
        if len(parts) == 3 and parts[0] == "events" and method == "POST" and parts[2] in ("start", "complete",
                                                                                          "cancel"):
            getattr(self, f"{parts[2]}_event")(parts[1])
            return 200, {"EventId": parts[1], "done": parts[2]}
        if route == "faults" and method == "POST":
            self.add_fault(**data)
            return 201, {"faults": len(self.faults)}
        if route == "faults" and method == "DELETE":
            self.clear_faults()
            return 200, {"faults": 0}
        if route == "requests" and method == "GET":
            return 200, self.requests(vm)
        if route == "approvals" and method == "GET":
            return 200, self.approvals(vm)
        if route == "changes" and method == "GET":
            with self.model.lock:
                return 200, list(self.model.changes)
        if route == "reset" and method == "POST":
            self.reset_incarnation()
            return 200, {"DocumentIncarnation": 1}
        return 404, {"error": f"no admin route {method} /admin/{route}"}
