"""The coordination backends by name: the one place that names them (`coordination.backend` chooses one).

Each backend is a package of its own that builds its `Backend` from `BackendParts` (the `coordination:`
settings in force and the agent's parts it needs) and owns its views; it is registered here as a
`BackendKind`. The built-ins load only when chosen (decision 0220: the peers backend never loads the
store's code). A new backend registers itself with `register` (tests/coordination/test_memory_backend.py
plugs one in from the test) and touches no other file; the coordinator, the approver, the wiring and the
views ask this registry, and what a backend publishes, never a name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from agent.coordination.backend import Backend, BackendParts


@dataclass(frozen=True)
class BackendKind:
    """One backend: its name (the value of `coordination.backend`), how it is built, and whether it offers the
    fleet wing a shared store (`Backend.carrier`: a disruption budget and the fleet history need one)."""

    name: str
    build: Callable[[BackendParts], Backend]
    shared_store: bool = False
    section: str | None = None
    """Its own section of the config (`coordination.<section>`), if it has one: a reload does not apply it."""


def _peers(parts: BackendParts) -> Backend:
    from agent.coordination.peers.peer_backend import build

    return build(parts)


def _azure_blob(parts: BackendParts) -> Backend:
    from agent.coordination.store.store_backend import build

    return build(parts)


_KINDS: dict[str, BackendKind] = {k.name: k for k in (BackendKind("peers", _peers),
                                                       BackendKind("azure_blob", _azure_blob, shared_store=True,
                                                                   section="azure_blob"))}


def register(kind: BackendKind) -> None:
    """Add (or replace) a backend under its name."""
    _KINDS[kind.name] = kind


def unregister(name: str) -> None:
    """Remove a backend (tests that plugged one in)."""
    _KINDS.pop(name, None)


def names() -> tuple[str, ...]:
    """Every backend's name, the built-ins first."""
    return tuple(_KINDS)


def shared_store_names() -> tuple[str, ...]:
    """The backends that carry a disruption budget and the fleet history."""
    return tuple(name for name, kind in _KINDS.items() if kind.shared_store)


def sections() -> tuple[str, ...]:
    """The config keys of the backends' own sections (`coordination.azure_blob`)."""
    return tuple(f"coordination.{kind.section}" for kind in _KINDS.values() if kind.section is not None)


def kind(name: str) -> BackendKind:
    """The backend of that name; ValueError naming the known ones."""
    found = _KINDS.get(name)
    if found is None:
        raise ValueError(f"no coordination backend {name!r}; known: {', '.join(_KINDS)}")
    return found


def build(parts: BackendParts) -> Backend:
    """The backend the settings in force choose (`coordination.backend`), built from `parts`."""
    return kind(parts.settings().backend).build(parts)
