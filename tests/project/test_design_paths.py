"""docs/DESIGN.md names only files and folders that exist: the map never points at a room that is gone."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DESIGN = ROOT / "docs" / "DESIGN.md"
PATHLIKE = re.compile(r"`([A-Za-z0-9_.][A-Za-z0-9_./-]*(?:\.(?:py|md|sh|toml|yaml|json)|/))`")
WING_HEADING = re.compile(r"^### `([a-z_]+)/`")
SKIP_DIRS = {".venv", ".azurite", ".git", "build", "dist", "node_modules"}


def _everything() -> set[str]:
    """Every path in the checkout relative to its root, folders with a trailing slash."""
    found: set[str] = set()
    for path in ROOT.rglob("*"):
        rel = path.relative_to(ROOT)
        if SKIP_DIRS & set(rel.parts):
            continue
        found.add(rel.as_posix() + ("/" if path.is_dir() else ""))
    return found


def missing_paths(text: str, existing: set[str]) -> list[str]:
    """The backticked paths of `text` that name nothing: a name in a wing's table must be in that wing."""
    basenames = {p.rstrip("/").rsplit("/", 1)[-1] + ("/" if p.endswith("/") else "") for p in existing}
    missing = []
    wing = None
    for number, line in enumerate(text.splitlines(), 1):
        heading = WING_HEADING.match(line)
        if heading or line.startswith("## ") or line.startswith("### "):
            wing = heading.group(1) if heading else None
        for name in PATHLIKE.findall(line):
            if "/" not in name.rstrip("/"):
                where = [f"agent/{wing}/{name}"] if wing and line.startswith("| `") else []
                ok = any(w in existing for w in where) if where else name in basenames
            else:
                bases = ("", "agent/", "docs/", "tests/") + ((f"agent/{wing}/",) if wing else ())
                ok = any(base + name in existing for base in bases)
            if not ok:
                missing.append(f"DESIGN.md:{number}: `{name}`")
    return missing


def test_every_path_design_names_exists():
    assert missing_paths(DESIGN.read_text(), _everything()) == []


def test_a_path_that_is_gone_is_caught():
    existing = {"agent/", "agent/loop/", "agent/loop/daemon.py"}
    text = "### `loop/` — the loop\n| `daemon.py` | x |\n| `imdsconn.py` | y |\nsee `loop/gone.py` and `agent/loop/`\n"
    assert missing_paths(text, existing) == ["DESIGN.md:3: `imdsconn.py`", "DESIGN.md:4: `loop/gone.py`"]


def test_every_decision_is_in_the_index():
    decisions = ROOT / "docs" / "decisions"
    index = (decisions / "README.md").read_text()
    files = sorted(p.name for p in decisions.glob("[0-9][0-9][0-9][0-9]-*.md"))
    assert files and [f for f in files if f"]({f})" not in index] == []
