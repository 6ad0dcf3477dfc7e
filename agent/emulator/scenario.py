"""Scenario files: events and faults scripted on a timeline, for rehearsals and tests.

    vms: [web-1, web-2]
    time_scale: 60            # one emulated minute per real second
    started_duration: 600     # emulated seconds an event stays Started
    events:
      - {at: 0, type: Freeze, resources: [web-1, web-2], notice: 900, duration: 5,
         description: "Virtual machine is being paused because of a memory-preserving Live Migration operation."}
      - {at: 60, type: Reboot, resources: [web-2], notice: 900, cancel_at: 300}
      - {at: 120, type: Reboot, resources: [web-1], status: Started}     # hardware failure
    faults:
      - {at: 30, kind: status, status: 503, duration: 20}

`at`, `notice`, `duration` (the event's DurationInSeconds), `start_at`, `complete_at`, `cancel_at`
and a fault's `duration` are emulated seconds from the start.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable

import yaml

TOP_KEYS = {"vms", "time_scale", "started_duration", "events", "faults"}
EVENT_KEYS = {"at", "type", "resources", "notice", "description", "source", "duration", "status", "id",
              "start_at", "complete_at", "cancel_at"}
FAULT_KEYS = {"at", "kind", "vm", "path", "count", "duration", "status", "delay", "retry_after"}


class ScenarioError(ValueError):
    """A scenario file that cannot be run; the message names the key."""


@dataclass(frozen=True)
class Step:
    at: float
    what: str
    args: dict[str, Any]


@dataclass(frozen=True)
class Scenario:
    vms: list[str]
    time_scale: float
    started_duration: float | None
    steps: list[Step]


def _number(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ScenarioError(f"{key}: expected a number of seconds >= 0, got {value!r}")
    return float(value)


def _check_keys(item: Any, allowed: set[str], where: str) -> dict[str, Any]:
    if not isinstance(item, dict):
        raise ScenarioError(f"{where}: expected a mapping")
    unknown = sorted(set(item) - allowed)
    if unknown:
        raise ScenarioError(f"{where}.{unknown[0]}: unknown key; allowed: {', '.join(sorted(allowed))}")
    return item


def parse(text: str) -> Scenario:
    """A scenario from YAML text; ScenarioError names the bad key."""
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise ScenarioError(f"not valid YAML: {exc}") from None
    data = _check_keys(data, TOP_KEYS, "scenario")
    vms = data.get("vms", ["vm-1"])
    if not isinstance(vms, list) or not vms or not all(isinstance(v, str) and v for v in vms):
        raise ScenarioError("vms: expected a non-empty list of VM names")
    scale = _number(data.get("time_scale", 1), "time_scale")
    if scale <= 0:
        raise ScenarioError("time_scale: must be above 0")
    started = data.get("started_duration")
    steps: list[Step] = []
    for i, item in enumerate(data.get("events") or []):
        where = f"events[{i}]"
        ev = _check_keys(item, EVENT_KEYS, where)
        if "type" not in ev:
            raise ScenarioError(f"{where}.type: required (Freeze, Reboot, Redeploy, Preempt, Terminate)")
        at = _number(ev.get("at", 0), f"{where}.at")
        resources = ev.get("resources", vms[:1])
        if not isinstance(resources, list) or any(r not in vms for r in resources):
            raise ScenarioError(f"{where}.resources: every name must be one of vms ({', '.join(vms)})")
        status = ev.get("status", "Scheduled")
        if status not in ("Scheduled", "Started"):
            raise ScenarioError(f"{where}.status: Scheduled or Started (a hardware failure), got {status!r}")
        event_id = str(ev.get("id") or f"{i + 1:08X}-0000-4000-8000-{i + 1:012X}")
        steps.append(Step(at, "add", {"event_id": event_id, "event_type": str(ev["type"]), "resources": resources,
                                      "notice": _number(ev.get("notice", 900), f"{where}.notice"),
                                      "description": str(ev.get("description", "")),
                                      "event_source": str(ev.get("source", "Platform")),
                                      "duration_seconds": int(ev.get("duration", -1)), "status": status}))
        for action in ("start", "complete", "cancel"):
            if f"{action}_at" in ev:
                when = _number(ev[f"{action}_at"], f"{where}.{action}_at")
                if when < at:
                    raise ScenarioError(f"{where}.{action}_at: must not be before at ({at:g})")
                steps.append(Step(when, action, {"event_id": event_id}))
    for i, item in enumerate(data.get("faults") or []):
        where = f"faults[{i}]"
        fault = _check_keys(item, FAULT_KEYS, where)
        if "kind" not in fault:
            raise ScenarioError(f"{where}.kind: required")
        at = _number(fault.get("at", 0), f"{where}.at")
        steps.append(Step(at, "fault", {k: v for k, v in fault.items() if k != "at"}))
    steps.sort(key=lambda s: s.at)
    return Scenario(vms, scale, None if started is None else _number(started, "started_duration"), steps)


def run(scenario: Scenario, emulator: Any, stop: threading.Event, on_step: Callable[[Step], None]) -> None:
    """Play the steps on real time (at / time_scale after the call), until done or `stop` is set."""
    clock = emulator.clock
    start = clock.monotonic()
    for step in scenario.steps:
        wait = start + step.at / scenario.time_scale - clock.monotonic()
        if wait > 0 and stop.wait(wait):
            return
        try:
            if step.what == "add":
                emulator.add_event(**step.args)
            elif step.what == "fault":
                emulator.add_fault(**step.args)
            else:
                getattr(emulator, f"{step.what}_event")(step.args["event_id"])
        except (KeyError, ValueError) as exc:  # e.g. completing an event the agent already approved away
            on_step(Step(step.at, "skipped", {**step.args, "reason": str(exc)}))
            continue
        on_step(step)
