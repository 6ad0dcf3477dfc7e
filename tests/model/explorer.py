"""A small explicit-state model checker: breadth-first over every interleaving a model allows.

A model gives its initial states, the steps enabled in a state (a readable label and the next
state) and its properties (a function of a state: None when it holds, else what is wrong). The
explorer visits every reachable state once (states are hashable, frozen values), checks every
property in each, and keeps, for each property, the shortest path to a state that breaks it: the
counterexample, printed as the numbered list of steps that leads there. A state that breaks a
property is not explored further (what follows a broken promise is not the question).

Breadth-first search means the first violation found of a property is a shortest one, which makes
the printed trace the easiest to read; the visited set keeps each state once, however many
interleavings reach it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

S = TypeVar("S", bound=Hashable)


class Model(Protocol[S]):
    """What the explorer needs of a model."""

    name: str

    def initial(self) -> Iterable[S]: ...

    def steps(self, state: S) -> Iterable[tuple[str, S]]: ...

    def properties(self) -> Mapping[str, Callable[[S], str | None]]: ...

    def describe(self, state: S) -> str: ...

    def elapsed(self, label: str) -> float:
        """Seconds of model time a step takes (the counterexample shows each step's time)."""
        ...


@dataclass(frozen=True)
class Counterexample:
    """The shortest path found to a state that breaks one property."""

    prop: str
    problem: str
    steps: tuple[str, ...]
    final: str

    def render(self) -> str:
        lines = [f"{self.prop} broken: {self.problem}", f"after {len(self.steps)} steps:"]
        lines += [f"  {i:2d}. {label}" for i, label in enumerate(self.steps, 1)]
        lines.append(f"  state: {self.final}")
        return "\n".join(lines)


@dataclass
class Result:
    """What one exploration found: states and transitions visited, the depth, the time, the violations."""

    model: str
    states: int = 0
    transitions: int = 0
    depth: int = 0
    seconds: float = 0.0
    cpu_seconds: float = 0.0
    """This process's CPU time for the search (the wall time depends on what else the machine runs)."""
    complete: bool = True
    """False when `max_states` stopped the search before every reachable state was seen."""
    violations: dict[str, Counterexample] = field(default_factory=dict)
    reached: dict[str, int] = field(default_factory=dict)
    """How many states show each labelled outcome (e.g. a POST), so a vacuous model is noticed."""

    def figures(self) -> dict[str, Any]:
        return {"states": self.states, "transitions": self.transitions, "depth": self.depth,
                "seconds": round(self.seconds, 2), "cpu_seconds": round(self.cpu_seconds, 2),
                "complete": self.complete, "reached": dict(self.reached),
                "violations": {p: c.render() for p, c in self.violations.items()}}


def explore(model: Model[S], *, max_states: int = 5_000_000,
            outcomes: Mapping[str, Callable[[S], bool]] | None = None, until: str | None = None) -> Result:
    """Visit every state reachable from the model's initial states; check each property in each. `until`: stop as
    soon as that property is found broken (a self-check needs its shortest counterexample, not the rest)."""
    started, cpu = time.monotonic(), time.process_time()
    result = Result(model.name)
    props = model.properties()
    parent: dict[S, tuple[S | None, str, int]] = {}
    queue: deque[S] = deque()
    for s in model.initial():
        if s not in parent:
            parent[s] = (None, "start", 0)
            queue.append(s)
    while queue:
        state = queue.popleft()
        depth = parent[state][2]
        result.depth = max(result.depth, depth)
        for name, seen in (outcomes or {}).items():
            if seen(state):
                result.reached[name] = result.reached.get(name, 0) + 1
        broken = False
        for prop, check in props.items():
            problem = check(state)
            if problem is not None:
                broken = True
                if prop not in result.violations:
                    result.violations[prop] = Counterexample(prop, problem, _timed(model, _path(parent, state)),
                                                             model.describe(state))
        if broken:
            if until is not None and until in result.violations:
                result.complete = False
                break
            continue
        for label, nxt in model.steps(state):
            result.transitions += 1
            if nxt not in parent:
                if len(parent) >= max_states:
                    result.complete = False
                    continue
                parent[nxt] = (state, label, depth + 1)
                queue.append(nxt)
    result.states = len(parent)
    result.seconds = time.monotonic() - started
    result.cpu_seconds = time.process_time() - cpu
    return result


def _timed(model: Model[S], labels: tuple[str, ...]) -> tuple[str, ...]:
    """Each step's label behind the model time it happens at."""
    out, now = [], 0.0
    for label in labels:
        now += model.elapsed(label)
        out.append(f"t={now:.0f}s {label}")
    return tuple(out)


def _path(parent: Mapping[S, tuple[S | None, str, int]], state: S) -> tuple[str, ...]:
    labels: list[str] = []
    at: S | None = state
    while at is not None:
        prev, label, _ = parent[at]
        if prev is not None:
            labels.append(label)
        at = prev
    return tuple(reversed(labels))
