"""The house stays as built. The wings of `agent/` (its sub-packages) import only what their
`__init__` docstring's "May import:" allows, and never each other round a circle; no module imports
round a circle either (TYPE_CHECKING imports included); the pure modules reach no I/O through any
chain of imports; and no module grows past what one reader can hold.

A circle means two rooms that cannot be changed or tested apart; the map in docs/DESIGN.md has
none, and this test keeps it that way.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

AGENT = Path(__file__).resolve().parents[2] / "agent"
BENCH = AGENT.parent / "bench"
BASE_PACKAGES = ("net", "telemetry", "trust")
"""Packages of the base (what every wing stands on, like the top-level modules): "the base" in a wing's rule."""
WINGS = sorted(p.parent.name for p in AGENT.glob("*/__init__.py") if p.parent.name not in BASE_PACKAGES)
PURE = ("agent.model", "agent.policy", "agent.coordination.coordination_rules",
        "agent.coordination.peers.peer_addressing", "agent.coordination.coordination_settings",
        "agent.coordination.member_urls",
        "agent.prepare.prepare_plan", "agent.prepare.run_records", "agent.prepare.run_order",
        "agent.health.health_rules", "agent.http.http_wire", "agent.loop.cadence", "agent.trust.jsonsafe",
        "agent.coordination.store.store_protocol", "agent.fleet.history_protocol", "agent.cli.clitext",
        "agent.fleet.budget_rules", "agent.fleet.budget_lease",
        "agent.cli.cliviews", "agent.handlers.silences", "agent.loop.tick")
"""Modules (or whole wings) that decide and compute only: time is a parameter, nothing is read or sent."""
IO = ("requests", "urllib3", "http.client", "http.server", "socket", "selectors", "subprocess", "os", "pathlib",
      "shutil", "tempfile", "io", "threading", "concurrent", "signal", "azure")
"""Imports that mean a module reads or writes files, talks on the network, runs programs or starts threads."""
SUBS = sorted(".".join(p.parent.relative_to(AGENT.parent).parts) for p in AGENT.glob("*/*/__init__.py"))
"""Sub-packages inside a wing (the coordination wing's backends, `peers` and `store`): each says what it
may import in its own `__init__` docstring, in rooms: the wing's own modules (`agent.coordination`), a
sibling sub-package, another wing, the base."""
SHARED = {"agent.loop.tick": "loop.tick"}
"""A module of a wing that the wings below it take from it, a room of its own (the loop's pass, `Tick`, which
the coordinator and the preparation decide on): a wing imports it when its "May import:" line names it, and it
imports nothing of its own wing."""
MAX_MODULE_LINES = 420
MAX_CLASS_LINES = 270


def module_name(path: Path) -> str:
    parts = path.relative_to(AGENT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, modules: set[str]) -> set[str]:
    """Every module of `modules` that `path` imports, at any level of the file (TYPE_CHECKING and
imports inside functions too)."""
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
    return {m for m in found if m in modules and m != name}


def graph(root: Path = AGENT) -> dict[str, set[str]]:
    files = {module_name(p): p for p in root.rglob("*.py")}
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


def wing(module: str) -> str:
    """The wing a module lives in; a top-level module (the face and the base) stands for itself."""
    if module in SHARED:
        return SHARED[module]
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in WINGS) else module


def wing_graph(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for a, bs in edges.items():
        out.setdefault(wing(a), set()).update(wing(b) for b in bs if wing(b) != wing(a))
    return out


def may_import(package: Path) -> str:
    """The "May import:" rule of a package's `__init__` docstring."""
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text(encoding="utf-8"))) or ""
    rule = doc.partition("May import:")[2]
    assert rule, f"{package.relative_to(AGENT.parent)}/__init__.py says what it may import (a 'May import:' line)"
    return rule


def allowed(wing_name: str) -> set[str]:
    """What a wing's `__init__` docstring says it may import: `agent.<wing>`s named, `the base`, `every wing`."""
    if wing_name in SHARED.values():
        return {"model", "policy", "base"}
    rule = may_import(AGENT / wing_name)
    names = set(WINGS) if "every wing" in rule else set(re.findall(r"`agent\.(\w+)`", rule)) & set(WINGS)
    names |= {room for module, room in SHARED.items() if f"`{module}`" in rule or module.split(".")[1] == wing_name}
    return names | ({"base"} if "the base" in rule or "every wing" in rule else set())


def room(module: str) -> str:
    """Where a module lives for a sub-package's rule: its sub-package (`agent.coordination.store`), else its
wing (`agent.coordination`, the wing's own modules), else `the base` (or the face)."""
    for sub in SUBS:
        if module == sub or module.startswith(sub + "."):
            return sub
    w = wing(module)
    return f"agent.{w}" if w in WINGS else "the base"


def is_base(node: str) -> bool:
    return node not in WINGS and node not in SHARED.values() and node != "agent.__main__"


@cache
def direct_io(path: Path) -> frozenset[str]:
    """The I/O this file does itself: I/O modules it imports, and calls of the built-in `open`."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
        found.update(n for n in names if any(n == io or n.startswith(io + ".") for io in IO))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "open":
            found.add("open()")
    return frozenset(found)


def io_reached(module: str, files: dict[str, Path], edges: dict[str, set[str]]) -> dict[str, list[str]]:
    """Every module `module` reaches through imports that does I/O itself, with what it does."""
    seen, todo, out = {module}, [module], {}
    while todo:
        m = todo.pop()
        if direct_io(files[m]):
            out[m] = sorted(direct_io(files[m]))
        for nxt in edges[m] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return out


def test_no_import_circle_inside_agent():
    assert circles(graph()) == [], "modules that import each other (directly or round a loop)"


def test_no_import_circle_inside_bench():
    """The benchmarks stand on shared helpers (`bench.common`, `bench.fleet_agents`), never on each other
round a circle (imports inside functions count): one benchmark can be run, read and changed alone."""
    edges = graph(BENCH)
    assert "bench.fleet_agents" in edges["bench.fleet_store"]
    assert circles(edges) == []


def test_no_import_circle_between_wings():
    """Two wings that import each other (even through a third) cannot be understood or tested apart."""
    assert circles(wing_graph(graph())) == []


def test_each_wing_imports_only_what_its_init_says():
    offenders = {}
    for w, targets in wing_graph(graph()).items():
        if w not in WINGS and w not in SHARED.values():
            continue
        ok = allowed(w)
        bad = sorted(t for t in targets if t not in ok and not ("base" in ok and is_base(t)))
        if bad:
            offenders[w] = bad
    assert offenders == {}


def test_each_sub_package_imports_only_what_its_init_says():
    """The coordination wing's backends stand on its shared rooms and never on each other: the peers
backend can be read, changed and tested without the store's, and the other way round."""
    assert {"agent.coordination.peers", "agent.coordination.store"} <= set(SUBS)
    offenders = {}
    for sub in SUBS:
        rule = may_import(AGENT.parent / sub.replace(".", "/"))
        ok = set(re.findall(r"`(agent(?:\.\w+)+)`", rule)) | ({"the base"} if "the base" in rule else set())
        for module, targets in graph().items():
            if room(module) == sub and (bad := sorted(t for t in targets if room(t) not in ok | {sub})):
                offenders[module] = bad
    assert offenders == {}


GENERIC = ("agent.coordination.coordinator", "agent.coordination.approver", "agent.coordination.approval_gates",
           "agent.coordination.backend", "agent.coordination.coordination_settings", "agent.loop.wiring",
           "agent.loop.api", "agent.cli.cliviews", "agent.cli.cliwatch")
"""The modules that work with any coordination backend: each is registered in one place (`backend_registry`),
builds its own `Backend`, and owns its views and its keys' meaning (decision 0180)."""


def test_the_generic_coordination_modules_import_no_backend_and_name_none():
    """A backend plugs in without a change here: none of these imports `agent.coordination.peers` or
    `agent.coordination.store` (at any level of the file), nor spells the store backend's name as a string ("peers"
    is also a field of the views, and the settings' default: `coordination.backend` is peers unless set)."""
    edges, files = graph(), {module_name(p): p for p in AGENT.rglob("*.py")}
    backends = ("agent.coordination.peers", "agent.coordination.store")
    assert set(GENERIC) <= set(files)
    assert {m: sorted(t for t in edges[m] if t.startswith(backends)) for m in GENERIC} == {m: [] for m in GENERIC}
    named = {m: sorted({node.value for node in ast.walk(ast.parse(files[m].read_text(encoding="utf-8")))
                        if isinstance(node, ast.Constant) and node.value == "azure_blob"})
             for m in GENERIC}
    assert named == {m: [] for m in GENERIC}


def test_the_room_of_a_module():
    assert [room(m) for m in ("agent.coordination.store.blob_store", "agent.coordination.coordinator",
                              "agent.health.health_store", "agent.clock")] == [
        "agent.coordination.store", "agent.coordination", "agent.health", "the base"]


def test_the_base_imports_no_wing_but_the_model():
    """The base (clock, errors, logs, metrics, ...) is what every wing stands on; it stands on nothing."""
    edges = wing_graph(graph())
    assert {n: sorted(t for t in ts if t in WINGS and t != "model") for n, ts in edges.items()
            if is_base(n) and any(t in WINGS and t != "model" for t in ts)} == {}


def test_the_circle_finder_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_pure_modules_reach_no_io_through_any_import():
    """A pure module that imports a module that reads files is not pure: purity is checked transitively."""
    files = {module_name(p): p for p in AGENT.rglob("*.py")}
    edges = graph()
    pure = [m for m in files if any(m == p or m.startswith(p + ".") for p in PURE)]
    assert len(pure) > 20
    assert {m: found for m in pure if (found := io_reached(m, files, edges))} == {}


def test_the_io_finder_sees_io_through_a_chain(tmp_path):
    (tmp_path / "a.py").write_text("import b\n")
    (tmp_path / "b.py").write_text("def f():\n    return open('x')\n")
    files = {"a": tmp_path / "a.py", "b": tmp_path / "b.py"}
    assert io_reached("a", files, {"a": {"b"}, "b": set()}) == {"b": ["open()"]}


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


def test_a_shared_room_imports_nothing_of_its_own_wing():
    """`agent.loop.tick` is the loop's value the wings below it take: were it to import the loop, they would too."""
    edges = graph()
    assert {m: sorted(t for t in edges[m] if wing(t) == m.split(".")[1]) for m in SHARED} == {m: [] for m in SHARED}
