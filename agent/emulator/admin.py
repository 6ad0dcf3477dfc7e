"""The emulator's admin API (`/admin/...` on every VM's port), and what a VM's server needs of the emulator.

`Host` is the emulator as its per-VM servers see it; `Emulator` (in `__init__.py`) is the one
implementation. Keeping it a protocol here lets the package's modules import downwards only.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable
from dataclasses import asdict
from typing import Any, Protocol

from agent.emulator.faults import Fault
from agent.emulator.model import Approval, ImdsDocument, Model, ModelClock, RecordedRequest

EVENT_ACTIONS = ("start", "complete", "cancel")


class Host(Protocol):
    """What one VM's server uses of the emulator."""

    model: Model
    clock: ModelClock
    etag: bool
    rate_limit: float | None
    stopping: threading.Event
    zones: int

    def tick(self) -> None: ...
    def record(self, vm: str, method: str, path: str, query: str, headers: dict[str, str],
               body: bytes) -> RecordedRequest: ...
    def take_faults(self, vm: str, path: str, method: str) -> list[Fault]: ...
    def add_event(self, *args: Any, **kwargs: Any) -> str: ...
    def document(self, vm: str, api_version: str = ...) -> ImdsDocument: ...
    def add_fault(self, *args: Any, **kwargs: Any) -> None: ...
    def clear_faults(self) -> None: ...
    def fault_count(self) -> int: ...
    def requests(self, vm: str | None = None) -> list[RecordedRequest]: ...
    def approvals(self, vm: str | None = None) -> list[Approval]: ...
    def reset_incarnation(self) -> None: ...


def _kwargs(fn: Callable[..., Any], data: dict[str, Any]) -> dict[str, Any]:
    allowed = [p for p in inspect.signature(fn).parameters if p != "self"]
    unknown = sorted(set(data) - set(allowed))
    if unknown:
        raise ValueError(f"{unknown[0]}: unknown parameter; allowed: {', '.join(allowed)}")
    return data


def admin(emu: Host, vm: str, method: str, route: str, data: dict[str, Any]) -> tuple[int, Any]:
    """The admin API, as (status, JSON answer); KeyError → 404, ValueError → 400."""
    parts = route.strip("/").split("/")
    if parts == ["events"] and method == "POST":
        return 201, {"EventId": emu.add_event(**_kwargs(emu.add_event, data))}
    if parts == ["events"] and method == "GET":
        return 200, emu.document(vm)
    if len(parts) == 3 and parts[0] == "events" and parts[2] in EVENT_ACTIONS and method == "POST":
        getattr(emu, f"{parts[2]}_event")(parts[1])
        return 200, emu.document(vm)
    if parts == ["faults"] and method == "POST":
        emu.add_fault(**_kwargs(emu.add_fault, data))
        return 201, {"faults": emu.fault_count()}
    if parts == ["faults"] and method == "DELETE":
        emu.clear_faults()
        return 200, {"faults": 0}
    if parts == ["requests"] and method == "GET":
        return 200, [asdict(r) for r in emu.requests(vm)]
    if parts == ["approvals"] and method == "GET":
        return 200, [asdict(a) for a in emu.approvals(vm)]
    if parts == ["reset"] and method == "POST":
        emu.reset_incarnation()
        return 200, emu.document(vm)
    return 404, {"error": f"no admin route {method} /admin/{route}"}
