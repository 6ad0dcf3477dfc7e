"""Modules that load at the first use of one of their names, not where they are imported (decision 0220).

Every module loaded stays resident for the life of the process, and some dependencies import a heavy
standard module only for a feature maintd never uses: structlog imports `asyncio` (with ssl and
subprocess, about 7 MB) for its async log methods, `http.client` imports `ssl` (libssl and libcrypto,
about 5 MB) for HTTPS, and `prometheus_client`'s package imports its HTTP servers and clients for the
exposition maintd does itself. `defer(name)` puts a stand-in for the module in `sys.modules`: an
`import` binds it without running the module's code, and the first name asked of it runs that code
once, in the stand-in itself, which is then the module (the same object everyone holds). What the
import system reads (`__spec__`, `__path__`, `__file__`, ...) does not count as a use, so a package's submodules
can be imported beside it, and a name that is one of its submodules imports that submodule alone.

The load runs under one lock (a second thread asking meanwhile waits for the whole module, as an
import would make it wait); a failed load leaves the stand-in to try again at the next use. A module
already imported is left as it is. `loaded(name)` says whether a module's code has run.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import threading
import types
from typing import Any

_LOCK = threading.RLock()
_IMPORT_SYSTEM = frozenset({"__spec__", "__path__", "__name__", "__loader__", "__package__", "__class__", "__file__",
                            "__cached__"})
"""What the import system reads of a module in `sys.modules` (and `inspect.getmodule`, which asks every module
for its file): never a use."""
_LOADING: dict[int, int] = {}
"""id of a stand-in being loaded -> the thread loading it (whose own reads during the load pass through)."""


class _Deferred(types.ModuleType):
    """A module whose code has not run yet."""

    def __getattribute__(self, attr: str) -> Any:
        get = super().__getattribute__
        if attr in _IMPORT_SYSTEM or _LOADING.get(id(self)) == threading.get_ident():
            return get(attr)
        if type(self) is _Deferred and _is_submodule(get("__spec__"), attr):
            return importlib.import_module(f"{get('__name__')}.{attr}")
        with _LOCK:
            if type(self) is _Deferred:
                _LOADING[id(self)] = threading.get_ident()
                try:
                    get("__spec__").loader.exec_module(self)
                finally:
                    del _LOADING[id(self)]
                self.__class__ = types.ModuleType  # type: ignore[assignment]
        return getattr(self, attr)


def _is_submodule(spec: Any, attr: str) -> bool:
    if spec.submodule_search_locations is None or attr.startswith("__"):
        return False
    return importlib.util.find_spec(f"{spec.name}.{attr}") is not None


def defer(name: str) -> None:
    """Let `import name` bind a stand-in whose code runs at its first use (nothing when already imported)."""
    if name in sys.modules:
        return
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
        return  # not there, or not loadable in place: an ordinary import will say so
    module = importlib.util.module_from_spec(spec)
    module.__class__ = _Deferred
    sys.modules[name] = module


def loaded(name: str) -> bool:
    """Whether the module `name` is imported and its code has run (a stand-in not yet used is not loaded)."""
    module = sys.modules.get(name)
    return module is not None and type(module) is not _Deferred
