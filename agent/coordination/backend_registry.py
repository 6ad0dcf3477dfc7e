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
from typing import Any

from agent.coordination.backend import Backend, BackendParts
from agent.errors import ConfigValueError
from agent.model.config_schema import did_you_mean


@dataclass(frozen=True)
class BackendKind:
    """One backend: its name (the value of `coordination.backend`), how it is built, and whether it offers the
    fleet wing a shared store (`Backend.carrier`: a disruption budget and the fleet history need one)."""

    name: str
    build: Callable[[BackendParts], Backend]
    shared_store: bool = False
    section: str | None = None
    """Its own section of the config (`coordination.<section>`), if it has one: a reload does not apply it."""
    doc: str = ""
    """What it does, for the config reference (`coordination.backend`)."""
    check: Callable[[Any], None] = lambda settings: None
    """What it needs of the `coordination:` settings when chosen (ConfigValueError, key relative to them)."""


def _peers(parts: BackendParts) -> Backend:
    from agent.coordination.peers.peer_backend import build

    return build(parts)


def _azure_blob(parts: BackendParts) -> Backend:
    from agent.coordination.store.store_backend import build

    return build(parts)


def _azure_blob_check(settings: Any) -> None:
    if settings.azure_blob is None:
        raise ConfigValueError("azure_blob", "backend azure_blob needs the store: azure_blob: {account_url: "
                                             "https://ACCOUNT.blob.core.windows.net, container: maintd}")


_KINDS: dict[str, BackendKind] = {k.name: k for k in (
    BackendKind("peers", _peers, doc="VMs ask each other on port 8088"),
    BackendKind("azure_blob", _azure_blob, shared_store=True, section="azure_blob", check=_azure_blob_check,
                doc="they coordinate through a blob container (no addressing, no inbound port; see Coordinating "
                    "through Azure Storage)"))}


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


def described() -> str:
    """Each backend and what it does, as the config reference shows `coordination.backend`."""
    return "; ".join(f"{kind.name}: {kind.doc}" for kind in _KINDS.values())


def check(settings: Any) -> None:
    """The `coordination:` settings (`CoordinationConfig`) name a known backend, with what it needs; a budget only
    on one with a shared store. ConfigValueError, its key relative to the section."""
    found = _KINDS.get(settings.backend)
    if found is None:
        raise ConfigValueError("backend", f"{settings.backend!r} is not allowed; use one of: {', '.join(_KINDS)}"
                                          f"{did_you_mean(settings.backend, tuple(_KINDS))}")
    found.check(settings)
    if settings.budget is not None and not found.shared_store:
        raise ConfigValueError("budget", "a disruption budget needs the shared store: set backend: "
                                         f"{' or '.join(shared_store_names())} (the {found.name} backend has no "
                                         "place where a whole group can agree)")


def build(parts: BackendParts) -> Backend:
    """The backend the settings in force choose (`coordination.backend`), built from `parts`."""
    return kind(parts.settings().backend).build(parts)
