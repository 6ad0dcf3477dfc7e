"""`agent.deferred`: a module deferred is loaded at the first use of one of its names, once, whole, and is then
the module everyone imported (decision 0220: what idle never uses never becomes resident)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from agent import deferred

RAN = "runs"


@pytest.fixture
def package(tmp_path, monkeypatch) -> Path:
    """`heavy` (its __init__ counts its runs, is slow, and names a value) with a light submodule `part`."""
    root = tmp_path / "heavy"
    root.mkdir()
    (root / "__init__.py").write_text(textwrap.dedent("""
        import sys, time
        sys.modules["builtins"].__dict__.setdefault("heavy_runs", []).append("init")
        time.sleep(0.2)
        from . import part
        VALUE = 42
    """))
    (root / "part.py").write_text("from . import helper\nPART = helper.H\n")
    (root / "helper.py").write_text("H = 'part'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import builtins
    monkeypatch.setattr(builtins, "heavy_runs", [], raising=False)
    yield root
    for name in [m for m in sys.modules if m == "heavy" or m.startswith("heavy.")]:
        del sys.modules[name]


def runs() -> list[str]:
    import builtins
    return builtins.heavy_runs  # type: ignore[attr-defined]


def test_an_import_binds_the_module_without_running_it_and_the_first_use_runs_it_once(package):
    deferred.defer("heavy")
    import heavy
    assert runs() == [] and not deferred.loaded("heavy")
    assert heavy.VALUE == 42 and runs() == ["init"] and deferred.loaded("heavy")
    import heavy as again
    assert again is heavy and again.part.PART == "part" and runs() == ["init"]


def test_a_submodule_is_imported_beside_it_without_running_the_package(package):
    deferred.defer("heavy")
    from heavy.part import PART  # its `from . import helper` imports the sibling, not the package's __init__
    assert PART == "part" and runs() == [] and not deferred.loaded("heavy")
    import heavy
    assert heavy.helper.H == "part" and runs() == []  # a submodule by name, still without the __init__
    assert heavy.VALUE == 42 and runs() == ["init"] and heavy.part.PART == "part"


def test_threads_using_it_at_once_all_see_the_whole_module(package):
    deferred.defer("heavy")
    import heavy
    seen: list[object] = []
    threads = [threading.Thread(target=lambda: seen.append(heavy.VALUE)) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert seen == [42] * 8 and runs() == ["init"]


def test_asking_every_module_for_its_file_is_no_use(package):
    """`inspect.getmodule` (tracebacks, warnings) asks every module in sys.modules for its file."""
    import inspect
    deferred.defer("heavy")
    import heavy
    code = test_asking_every_module_for_its_file_is_no_use.__code__  # no __module__: found by file, every module asked
    assert inspect.getmodule(code) is sys.modules[__name__]
    assert heavy.__file__.endswith("__init__.py") and runs() == []


def test_a_module_already_imported_is_left_as_it_is():
    import json
    deferred.defer("json")
    assert sys.modules["json"] is json and deferred.loaded("json")


DEPENDENCIES_STILL_WORK = """
from agent.telemetry import logs, metrics  # defer asyncio (structlog), prometheus_client's package
from agent.imds import imds_connection  # defers ssl (http.client)
from agent import deferred
assert not any(deferred.loaded(m) for m in ("asyncio", "ssl", "prometheus_client")), "deferred"
logs.configure("json", "info")
import asyncio
async def main() -> int:
    await logs.get("t").ainfo("async.logged")  # structlog's async methods load asyncio when used
    return 7
assert asyncio.run(main()) == 7
import requests, ssl  # the HTTP client stack (webhooks, peers, gates) loads ssl whole
assert ssl.create_default_context().verify_mode == ssl.CERT_REQUIRED
requests.Session().close()
from prometheus_client import Gauge, generate_latest  # prometheus_client's own names load its __init__
assert b"maintd_build_info" in generate_latest(metrics.Metrics().registry)
print("ok")
"""


def test_what_maintd_defers_works_whole_when_something_uses_it():
    """asyncio, ssl and prometheus_client's package load when used, and behave as if imported at start."""
    done = subprocess.run([sys.executable, "-c", DEPENDENCIES_STILL_WORK], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]
