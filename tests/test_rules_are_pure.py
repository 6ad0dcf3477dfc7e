"""The coordination rules stay pure: no HTTP, sockets, files or threads in the modules that decide."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

AGENT = Path(__file__).resolve().parent.parent / "agent"
IO = {"requests", "socket", "subprocess", "threading", "concurrent", "urllib.request", "http", "os",
      "agent.coordination.approval_gates", "agent.coordination.peer_client", "agent.coordination.peers_file", "agent.coordination.coordinator", "agent.coordination.peer_directory", "agent.imds.imds_client"}


@pytest.mark.parametrize("module", ["coordination/coordination_rules.py", "coordination/peer_addressing.py", "windows/approval_policy.py"])
def test_decision_modules_import_no_io(module):
    tree = ast.parse((AGENT / module).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module} | \
        {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not {m for m in imported if m in IO or m.split(".")[0] in IO}, module
