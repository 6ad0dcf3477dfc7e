"""The linters are part of the test run: `ruff check` (pyflakes, pycodestyle, import order, bugbear,
pyupgrade; RUF100: no noqa for a rule not enabled) over the whole tree and `mypy agent/` (strict), both configured
in pyproject.toml."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.lint


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_ruff_finds_nothing():
    """Unused names, shadowed imports, loop-variable closures, long lines: none."""
    result = run("ruff", "check", "--no-cache", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_finds_nothing_in_agent():
    """Every function typed and every call checked against it."""
    result = run("mypy", "--no-incremental")
    assert result.returncode == 0, result.stdout + result.stderr
