"""Shared fixtures: a fake clock, structlog reset and capture, a config writer; `--random-order=SEED`."""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import structlog

from agent.clock import FakeClock
from tests.stopping import stop_all


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--random-order", metavar="SEED", type=int, default=None,
                     help="run the test files in an order shuffled by SEED (an integer), and the tests of each file "
                          "too: to find tests that depend on the order (rerun with the same SEED to reproduce; "
                          "e.g. --random-order=$RANDOM)")


def pytest_report_header(config: pytest.Config) -> str | None:
    seed = config.getoption("random_order")
    return None if seed is None else f"random order: --random-order={seed}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """With --random-order: files shuffled, then the tests within each (a file's module fixtures stay shared)."""
    seed = config.getoption("random_order")
    if seed is None:
        return
    rng = random.Random(seed)
    files: dict[str, list[pytest.Item]] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::")[0], []).append(item)
    groups = list(files.values())
    rng.shuffle(groups)
    for group in groups:
        rng.shuffle(group)
    items[:] = [item for group in groups for item in group]


GUARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGALRM)


@pytest.fixture(autouse=True)
def _signals_as_found() -> Iterator[None]:
    """A test leaves the signal handlers and the wakeup fd as it found them: one left behind (an in-process daemon's
    SIGTERM handler) made the run itself ignore SIGTERM, and a test's signal must never outlive its handler.
    Put back, and the test fails naming it."""
    before = {s: signal.getsignal(s) for s in GUARDED}
    wakeup = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(wakeup)
    yield
    changed = [signal.Signals(s).name for s in GUARDED if signal.getsignal(s) is not before[s]]
    for s in GUARDED:
        signal.signal(s, before[s])
    left = signal.set_wakeup_fd(wakeup)
    if left != wakeup:
        changed.append(f"the wakeup fd ({left})")
    if changed:
        pytest.fail(f"the test left {', '.join(changed)} as it set them (put back now)")


THREAD_GRACE = 2.0
"""Seconds a thread the test started may take to end after it (a server's last poll, a worker's last job)."""


@pytest.fixture(autouse=True)
def _threads_as_found(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test leaves no thread of its own running (daemon threads aside): one left alive (a server never shut
    down, a lane never stopped) kept a random-order run from exiting at the end. Each thread it started is
    given THREAD_GRACE seconds to end (a join: no wait when none is left), then the test fails naming them.
    What the test registered with `tests.stopping.stopped_at_end` is stopped first."""
    before = set(threading.enumerate())
    yield
    problems = stop_all()
    left = [t for t in threading.enumerate() if t not in before and not t.daemon]
    deadline = time.monotonic() + THREAD_GRACE
    for thread in left:
        thread.join(max(0.0, deadline - time.monotonic()))
    alive = [t.name for t in left if t.is_alive()]
    if problems:
        pytest.fail(f"{request.node.nodeid}: stopping its parts raised: {'; '.join(problems)}")
    if alive:
        pytest.fail(f"{request.node.nodeid} left {len(alive)} thread(s) running: {', '.join(sorted(alive))}")


@pytest.fixture(autouse=True)
def _reset_structlog() -> Iterator[None]:
    structlog.reset_defaults()
    yield
    structlog.reset_defaults()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def logs() -> Iterator[list[dict]]:
    """Every structured log entry emitted during the test."""
    with structlog.testing.capture_logs() as captured:
        yield captured


@pytest.fixture
def write_config(tmp_path: Path) -> Callable[[str], Path]:
    """Write a config file with safe permissions and return its path."""

    def write(text: str, name: str = "maintd.yaml") -> Path:
        path = tmp_path / name
        path.write_text(text)
        os.chmod(path, 0o640)
        return path

    return write
