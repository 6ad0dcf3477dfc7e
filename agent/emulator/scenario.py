"""Scenario files: events and faults on a timeline, for rehearsals, demos and tests.

    vms: [web-1, web-2]
    time_scale: 60            # one emulated minute per real second
    started_duration: 600     # emulated seconds an event stays Started when its duration is -1
    events:
      - {at: 0, type: Freeze, resources: [web-1, web-2], notice: 900, duration: 5,
         description: "Virtual machine is being paused because of a memory-preserving Live Migration operation."}
      - {at: 60, type: Reboot, resources: [web-2], notice: 900, cancel_at: 300}
      - {at: 120, type: Reboot, resources: [web-1], status: Started}     # a hardware failure
    faults:
      - {at: 30, kind: status, status: 503, duration: 20}

`at`, `notice`, `start_at`, `complete_at`, `cancel_at` and a fault's `duration` and `delay` are
emulated seconds (from the start for the `*_at` keys); an event's `duration` is its
DurationInSeconds. Every error names the key: `events[1].notice: expected seconds >= 0`.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from agent.emulator.faults import make_fault
from agent.emulator.model import STATUSES

TOP_KEYS = ("vms", "time_scale", "started_duration", "events", "faults")
EVENT_KEYS = ("at", "type", "resources", "notice", "description", "source", "duration", "status", "id",
              "start_at", "complete_at", "cancel_at")
FAULT_KEYS = ("at", "kind", "vm", "path", "method", "count", "duration", "status", "delay", "retry_after")
ACTIONS = ("start", "complete", "cancel")


class ScenarioError(ValueError):
    """A scenario that cannot be played; the message names the key."""


@dataclass(frozen=True)
class Step:
    """At `at` emulated seconds: `action` (add, start, complete, cancel, fault) with the Emulator method's kwargs."""

    at: float
    action: str
    args: dict[str, Any]


@dataclass(frozen=True)
class Scenario:
    vms: list[str]
    time_scale: float
    started_duration: float | None
    steps: list[Step]
    """Ordered by `at` (steps at the same time keep the file's order)."""


class _Loader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys (PyYAML would silently keep the last one)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise ScenarioError(f"line {key_node.start_mark.line + 1}: {key}: duplicate key")
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _seconds(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ScenarioError(f"{key}: expected seconds >= 0, got {value!r}")
    return float(value)


def _text(value: Any, key: str) -> str:
    if not isinstance(value, str):
        raise ScenarioError(f"{key}: expected a string, got {value!r}")
    return value


def _mapping(item: Any, allowed: tuple[str, ...], where: str) -> dict[str, Any]:
    if not isinstance(item, dict):
        raise ScenarioError(f"{where}: expected a mapping, got {item!r}")
    for key in item:
        if key not in allowed:
            raise ScenarioError(f"{where}.{key}: unknown key; allowed: {', '.join(allowed)}")
    return item


def _list(value: Any, key: str) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise ScenarioError(f"{key}: expected a list, got {value!r}")
    return value


def _event_steps(ev: dict[str, Any], where: str, vms: list[str]) -> list[Step]:
    if "type" not in ev:
        raise ScenarioError(f"{where}.type: required (Freeze, Reboot, Redeploy, Preempt, Terminate or any other)")
    at = _seconds(ev.get("at", 0), f"{where}.at")
    resources = ev.get("resources", vms[:1])
    if not isinstance(resources, list) or not resources or not all(isinstance(r, str) and r for r in resources):
        raise ScenarioError(f"{where}.resources: expected a non-empty list of VM names, got {resources!r}")
    status = ev.get("status", "Scheduled")
    if status not in STATUSES:
        raise ScenarioError(f"{where}.status: expected Scheduled or Started (a hardware failure), got {status!r}")
    duration = ev.get("duration", -1)
    if isinstance(duration, bool) or not isinstance(duration, int):
        raise ScenarioError(f"{where}.duration: expected whole seconds (-1: unknown), got {duration!r}")
    event_id = _text(ev["id"], f"{where}.id") if "id" in ev else str(uuid.uuid4()).upper()
    args = {"event_type": _text(ev["type"], f"{where}.type"), "resources": resources, "status": status,
            "description": _text(ev.get("description", ""), f"{where}.description"),
            "event_source": _text(ev.get("source", "Platform"), f"{where}.source"),
            "duration_seconds": duration, "event_id": event_id}
    if "notice" in ev:
        args["notice"] = _seconds(ev["notice"], f"{where}.notice")
    steps = [Step(at, "add", args)]
    for action in ACTIONS:
        key = f"{action}_at"
        if key in ev:
            when = _seconds(ev[key], f"{where}.{key}")
            if when < at:
                raise ScenarioError(f"{where}.{key}: {when:g} is before the event's at ({at:g})")
            steps.append(Step(when, action, {"event_id": event_id}))
    return steps


def _fault_step(fault: dict[str, Any], where: str, vms: list[str]) -> Step:
    if "kind" not in fault:
        raise ScenarioError(f"{where}.kind: required")
    if fault.get("vm") is not None and fault["vm"] not in vms:
        raise ScenarioError(f"{where}.vm: {fault['vm']!r} is not one of vms ({', '.join(vms)})")
    if "duration" in fault:
        _seconds(fault["duration"], f"{where}.duration")
    args = {k: v for k, v in fault.items() if k != "at"}
    try:
        make_fault(args["kind"], args.get("vm"), args.get("path"), args.get("method"), args.get("count"), None,
                   args.get("status", 503), args.get("delay", 1.0), args.get("retry_after"))
    except ValueError as exc:
        raise ScenarioError(f"{where}.{exc}") from None
    return Step(_seconds(fault.get("at", 0), f"{where}.at"), "fault", args)


def parse(text: str) -> Scenario:
    """A scenario from YAML text; ScenarioError names the bad key."""
    try:
        data = yaml.load(text, Loader=_Loader)  # a SafeLoader subclass
    except yaml.YAMLError as exc:
        raise ScenarioError(f"not valid YAML: {exc}") from None
    data = _mapping({} if data is None else data, TOP_KEYS, "scenario")
    vms = data.get("vms", ["vm-1"])
    if not isinstance(vms, list) or not vms or not all(isinstance(v, str) and v for v in vms) \
            or len(set(vms)) != len(vms):
        raise ScenarioError(f"vms: expected a non-empty list of distinct VM names, got {vms!r}")
    scale = _seconds(data.get("time_scale", 1), "time_scale")
    if scale <= 0:
        raise ScenarioError("time_scale: must be above 0")
    started = data.get("started_duration")
    steps: list[Step] = []
    for i, item in enumerate(_list(data.get("events"), "events")):
        steps += _event_steps(_mapping(item, EVENT_KEYS, f"events[{i}]"), f"events[{i}]", vms)
    for i, item in enumerate(_list(data.get("faults"), "faults")):
        steps.append(_fault_step(_mapping(item, FAULT_KEYS, f"faults[{i}]"), f"faults[{i}]", vms))
    ids = [s.args["event_id"] for s in steps if s.action == "add"]
    if len(set(ids)) != len(ids):
        raise ScenarioError("events: two events have the same id")
    steps.sort(key=lambda s: s.at)
    return Scenario(vms, scale, None if started is None else _seconds(started, "started_duration"), steps)


def load(path: str | Path) -> Scenario:
    """A scenario file; ScenarioError starts with the file name."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ScenarioError(f"{path}: cannot read: {exc.strerror}") from None
    try:
        return parse(text)
    except ScenarioError as exc:
        raise ScenarioError(f"{path}: {exc}") from None
