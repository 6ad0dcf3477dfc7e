"""Shared fixtures: a fake clock, structlog reset and capture, a config writer."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import structlog

from agent.clock import FakeClock


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
