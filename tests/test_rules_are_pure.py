"""The coordination rules stay pure: no HTTP, sockets, files or threads in the modules that decide."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

AGENT = Path(__file__).resolve().parent.parent / "agent"
IO = {"requests", "socket", "subprocess", "threading", "concurrent", "urllib.request", "http", "os",
      "agent.gates", "agent.peers", "agent.peersfile", "agent.coordinator", "agent.directory", "agent.imds"}


@pytest.mark.parametrize("module", ["coordination_rules.py", "addressing.py", "policy.py"])
def test_decision_modules_import_no_io(module):
    tree = ast.parse((AGENT / module).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module} | \
        {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not {m for m in imported if m in IO or m.split(".")[0] in IO}, module
