"""The house stays as built: no import circle inside `agent/` (TYPE_CHECKING imports included),
the pure modules import no I/O, and no module grows past what one reader can hold.

A circle means two rooms that cannot be changed or tested apart; the drawing in docs/DESIGN.md
has none, and this test keeps it that way.
"""

from __future__ import annotations

import ast
from pathlib import Path

AGENT = Path(__file__).resolve().parent.parent / "agent"
PURE = ("agent.model.events", "agent.model.tracker", "agent.windows.approval_policy", "agent.windows.schedule", "agent.health.health_store", "agent.health.health_rules",
        "agent.jsonsafe", "agent.loop.cadence", "agent.prepare.prepare_plan", "agent.coordination.coordination_rules", "agent.coordination.peer_addressing",
        "agent.http.http_wire", "agent.model.outcomes", "agent.coordination.store_protocol")
IO_MODULES = ("requests", "urllib3", "http.client", "http.server", "socket", "subprocess", "agent.imds.imds_client", "agent.http.routes",
              "agent.state.state_store", "agent.coordination.coordinator", "agent.coordination.approval_gates", "agent.coordination.peer_client", "agent.loop.daemon", "agent.loop.wiring")
MAX_MODULE_LINES = 420
MAX_CLASS_LINES = 270


def module_name(path: Path) -> str:
    parts = path.relative_to(AGENT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, modules: set[str]) -> set[str]:
    """Every module of `modules` that `path` imports, at any level of the file (TYPE_CHECKING too)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return {m for m in found if m in modules and m != name} | {
        m for m in found for p in IO_MODULES if m == p or m.startswith(p + ".")}


def graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in AGENT.rglob("*.py")}
    names = set(files)
    return {name: imports(path, names) & names for name, path in files.items()}


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_circle_inside_agent():
    assert circles(graph()) == [], "modules that import each other (directly or round a loop)"


def test_the_circle_finder_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_pure_modules_import_no_io():
    files = {module_name(p): p for p in AGENT.rglob("*.py")}
    offenders = {name: sorted(m for m in imports(files[name], set(files))
                              if any(m == io or m.startswith(io + ".") for io in IO_MODULES))
                 for name in PURE}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_no_module_is_too_long_to_read_in_one_sitting():
    lengths = {module_name(p): len(p.read_text(encoding="utf-8").splitlines()) for p in AGENT.rglob("*.py")}
    assert {m: n for m, n in lengths.items() if n > MAX_MODULE_LINES} == {}


def test_no_class_does_more_than_one_job_at_a_time():
    """A class long enough to need a table of contents has a second job that wants its own room."""
    sizes = {}
    for p in AGENT.rglob("*.py"):
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                sizes[f"{module_name(p)}.{node.name}"] = node.end_lineno - node.lineno + 1
    assert {c: n for c, n in sizes.items() if n > MAX_CLASS_LINES} == {}
