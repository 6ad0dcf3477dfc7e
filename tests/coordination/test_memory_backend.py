"""A third backend plugs in from this file alone: an in-memory board the VMs of one test share (who is ready, who
claimed), registered under the name `memory` from the test, chosen by `coordination.backend`, and built by the
coordinator through the registry. It runs an approval end to end through the coordinator: the VMs wait for each
other, exactly one claims and sends one POST, and the recheck before the send holds on the backend's word."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

from agent.cli.cliviews import status_text
from agent.config.config import ConfigError, loads
from agent.coordination import backend_registry
from agent.coordination.backend import (
    BackendParts,
    BackendStatus,
    Carrier,
    EventView,
    FleetEvent,
    GateInput,
    Inputs,
    Right,
    Step,
)
from agent.coordination.backend_registry import BackendKind
from agent.coordination.coordination_settings import CoordinationConfig
from agent.coordination.coordinator import Coordinator
from agent.coordination.gate_http import GateClient
from agent.model.events import SCHEDULED, Event
from agent.model.tracker import Tracked
from agent.state.state_store import Store
from agent.telemetry.metrics import Metrics
from tests.coordination.test_coordinator import step, tracked
from tests.stopping import stopped_at_end


@dataclass(frozen=True)
class BoardStep:
    action: str
    reason: str


@dataclass
class Board:
    """What the VMs of one test share: per event, who is ready and who claimed it."""

    ready: dict[str, set[str]] = field(default_factory=dict)
    claimed: dict[str, str] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def claim(self, event_id: str, vm: str) -> bool:
        with self.lock:
            return self.claimed.setdefault(event_id, vm) == vm


class MemoryBackend:
    """Readiness on the board; the first VM to claim an event where every VM is ready sends its approval."""

    def __init__(self, board: Board) -> None:
        self.board = board

    def begin(self) -> None:
        pass

    def inputs(self, event_id: str, event: Event, vm_name: str, pending: Sequence[str], mode: str, manual: bool,
               sent: bool, now: float) -> Inputs:
        with self.board.lock:
            ready = self.board.ready.setdefault(event_id, set())
            if not pending and event.status == SCHEDULED:
                ready.add(vm_name)
            claimed = self.board.claimed.get(event_id)
        waiting = [n for n in event.resources if n not in ready and n != vm_name]
        if claimed is not None and claimed != vm_name:
            return Inputs(waiting, [], BoardStep("wait", f"claimed by {claimed}"))
        return Inputs(waiting, [], BoardStep("claim", "nobody claimed it"), leading=True)

    def end(self, events: set[str]) -> None:
        pass

    def right_to_post(self, event_id: str, resources: tuple[str, ...], vm_name: str, mode: str,
                      step: Step | None) -> str | None:
        claimed = self.board.claimed.get(event_id)
        return None if claimed in (None, vm_name) else f"claimed by {claimed}"

    def take_right(self, event_id: str, vm_name: str, step: Step | None, retry_for: float) -> Right | None:
        return Right(retry_for) if self.board.claim(event_id, vm_name) else None

    def settle(self, event_id: str, vm_name: str, right: Right, sent: bool | None) -> None:
        pass

    def gate_input(self) -> GateInput:
        return GateInput(GateClient(1.0, 1), lambda name: None,
                         lambda eid, resources, vm, warning: dict.fromkeys(resources, "ok"))

    def carrier(self) -> Carrier | None:
        return None

    def hint(self, event_id: str, name: str) -> bool:
        return False

    def view(self, event_id: str) -> EventView:
        return {"acting_leader": self.board.claimed.get(event_id), "readiness_pushed_to": None,
                "peers_ready": len(self.board.ready.get(event_id, ())), "peers_known": 0, "peers": {}}

    def status(self, tracked: Mapping[str, Tracked], vm_name: str | None) -> BackendStatus:
        return {"coordination": {"backend": "memory", "board_events": len(self.board.ready)}}

    def fleet(self, tracked: Mapping[str, Tracked], vm_name: str | None, is_ready: Callable[[Tracked], bool],
              approval: Callable[[str], dict[str, Any] | None]) -> list[FleetEvent]:
        return [{"event_id": eid, "source": "memory", "vms": [{"name": n, "state": "ready"} for n in sorted(vms)],
                 "approval": approval(eid)} for eid, vms in self.board.ready.items()]

    def wait_idle(self, timeout: float) -> bool:
        return True

    def stop(self) -> None:
        pass


@pytest.fixture
def board():
    shared = Board()

    def build(parts: BackendParts) -> MemoryBackend:  # what the coordinator hands any backend; this one needs none
        return MemoryBackend(shared)

    backend_registry.register(BackendKind("memory", build))
    yield shared
    backend_registry.unregister("memory")


def vm(tmp_path, clock, name: str) -> tuple[Coordinator, list[list[str]]]:
    """One VM's coordinator on `coordination.backend: memory`, and the approvals it sent to IMDS."""
    sent: list[list[str]] = []
    coord = Coordinator(CoordinationConfig(backend="memory"), approve=sent.append,
                        store=Store(tmp_path / name, clock), clock=clock, metrics=Metrics())
    stopped_at_end(coord)
    return coord, sent


def test_a_backend_registered_from_a_test_runs_an_approval_end_to_end(tmp_path, clock, board):
    """vm1 and vm2 wait while vm2 prepares; once it is ready exactly one POST goes out for the event, from the
    VM that claimed it, recorded as sent; the other never posts; status and fleet show what the backend says."""
    (vm1, sent1), (vm2, sent2) = vm(tmp_path, clock, "vm1"), vm(tmp_path, clock, "vm2")
    assert "memory" in backend_registry.names()
    t = tracked(clock, ["vm1", "vm2"])
    for _ in range(3):
        step(vm1, t, "vm1")
        step(vm2, t, "vm2", pending=lambda t: ["drain"])
        clock.advance(1)
    assert sent1 == sent2 == []
    assert "vm2" in (vm1.view("E1")["approval_decision"] or "")
    for _ in range(3):
        step(vm2, t, "vm2")
        step(vm1, t, "vm1")
        clock.advance(1)
    assert sent1 + sent2 == [["E1"]], "one POST for the event, from one VM"
    poster = vm2 if sent2 else vm1
    assert (poster.view("E1")["approval"] or {}).get("status") == "sent"
    assert board.claimed["E1"] == ("vm2" if sent2 else "vm1")
    assert vm1.status(t, "vm1")["coordination"] == {"backend": "memory", "board_events": 1}
    assert [e["source"] for e in vm1.fleet(t, "vm1", lambda t: True)] == ["memory"]
    shown = status_text({"coordination": vm1.status(t, "vm1")["coordination"]})
    assert "Coordination (backend memory)" in shown and "board" in shown, "maintd status shows what it publishes"
    vm1.stop()
    vm2.stop()


def test_the_config_chooses_a_registered_backend_and_refuses_an_unknown_one(board):
    """`coordination.backend: memory` is a valid config while the backend is registered, refused once it is not."""
    assert loads("coordination: {backend: memory}\n").coordination.backend == "memory"
    backend_registry.unregister("memory")
    with pytest.raises(ConfigError, match="use one of: peers, azure_blob"):
        loads("coordination: {backend: memory}\n")


def test_the_recheck_before_the_send_asks_the_plugged_in_backend(tmp_path, clock, board):
    """Another VM claimed the event on the board after this VM decided: the approver's recheck asks the backend
    right before the send, and nothing goes to IMDS."""
    coord, sent = vm(tmp_path, clock, "vm1")
    real = coord.approver.right

    def claimed_meanwhile(order):
        board.claimed[order.event_id] = "vm9"  # another VM took it over after this one claimed
        return real(order)

    coord.approver.right = claimed_meanwhile
    t = tracked(clock, ["vm1"])
    for _ in range(3):
        step(coord, t, "vm1")
        clock.advance(1)
    assert sent == [] and board.claimed["E1"] == "vm9"
    coord.stop()
