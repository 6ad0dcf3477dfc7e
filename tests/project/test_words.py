"""The last words have one home. Instants are read only by `agent.model.timefmt` (HTTP's dates by
`agent.net.httpdates`, a format of their own), and the protocol's words — the values of the `Literal` types of
`agent/model/` (decision 0181) — are spelled only there: everywhere else code compares with, defines and counts
by their `Final` names, so a misspelt word fails mypy and a renamed one changes in one place.

An AST scan of `agent/` like the house test's: both counts stay 0.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from functools import cache
from pathlib import Path

AGENT = Path(__file__).resolve().parents[2] / "agent"
PARSERS = {"fromisoformat", "strptime", "isoparse", "parsedate", "parsedate_tz", "parsedate_to_datetime",
           "strptime_l"}
"""Calls that read an instant (or a day) from text: `datetime`/`date`/`time`, `email.utils`, `dateutil`."""
PARSER_HOMES = {"agent/model/timefmt.py": "ISO 8601: the one reader of instants",
                "agent/net/httpdates.py": "HTTP-dates (RFC 9110), a format of their own, read strictly and capped"}
OWN_WORDS = {"model": "the words' home", "emulator": "a stand-in IMDS that imports nothing of `agent`: it "
                                                    "speaks the wire's words itself, as Azure does"}
"""Folders of `agent/` the protocol-word scan leaves out, and why."""
SAME_SPELLING = {
    ("agent/cli/commands.py", "auto", "b.advertise"): "the budget's `advertise: auto` (config)",
    ("agent/coordination/coordination_settings.py", "auto", "value"): "the budget's `advertise: auto` (config)",
    ("agent/fleet/budget_wake.py", "auto", "advertise"): "the budget's `advertise: auto` (config)",
    ("agent/loop/wiring.py", "auto", "config.identity.name"): "`identity.name: auto` (config)",
    ("agent/loop/wiring.py", "auto", "new.identity.name"): "`identity.name: auto` (config)",
    ("agent/loop/wiring.py", "auto", "self.config.identity.name"): "`identity.name: auto` (config)",
    ("agent/telemetry/logs.py", "auto", "fmt"): "`log_format: auto` (config)",
    ("agent/health/rotation.py", "manual", "constant"): "the operator's drain (a rotation key named once, "
                                                        "in its wing), not the approval mode",
    ("agent/loop/wiring.py", "failed", "labels"): "a refused config reload (maintd_config_reloads_total)",
    ("agent/handlers/pacemaker.py", "auto", "value"): "the pacemaker handler's `node: auto` (config)",
    ("agent/handlers/pacemaker.py", "auto", "self.options.node"): "the pacemaker handler's `node: auto` (config)",
    ("agent/handlers/pacemaker.py", "held", "labels"): "a pacemaker hold (maintd_pacemaker_errors_total's kind), not a "
                                                       "preparation plan's word",
}
"""Config values and other words that share a spelling with a protocol word but are not one: (module, word, what it
is compared with, or `constant`, `labels`, `Literal`) -> what the word is there."""


def _modules() -> Iterator[tuple[str, ast.Module]]:
    for path in sorted(AGENT.rglob("*.py")):
        yield path.relative_to(AGENT.parent).as_posix(), ast.parse(path.read_text(encoding="utf-8"))


@cache
def _vocabulary() -> dict[str, str]:
    """Each word of a `Literal` type in `agent/model/`, and its module."""
    words: dict[str, str] = {}
    for name, tree in _modules():
        if name.startswith("agent/model/"):
            for node in ast.walk(tree):
                if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == "Literal":
                    for c in _strings(node.slice):
                        words.setdefault(c.value, name)
    return words


def _strings(node: ast.AST) -> Iterator[ast.Constant]:
    """The string constants `node` spells as values: itself, a tuple's, list's or set's items, both arms of an `if`."""
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        for e in node.elts:
            yield from _strings(e)
    elif isinstance(node, ast.IfExp):
        yield from _strings(node.body)
        yield from _strings(node.orelse)
    elif isinstance(node, ast.Constant) and isinstance(node.value, str):
        yield node


def _spelled(tree: ast.Module) -> Iterator[tuple[ast.Constant, str]]:
    """Each string a module compares with (and what with), puts in a `Literal`, defines as a module constant or
    gives a metric as a label."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            for side in sides:
                other = next(ast.unparse(o) for o in sides if o is not side)
                yield from ((c, other) for c in _strings(side))
        elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == "Literal":
            yield from ((c, "Literal") for c in _strings(node.slice))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "labels":
            yield from ((c, "labels") for a in node.args for c in _strings(a))
    for stmt in tree.body:
        if isinstance(stmt, (ast.Assign, ast.AnnAssign)) and stmt.value is not None:
            yield from ((c, "constant") for c in _strings(stmt.value))


def protocol_words_outside_model() -> list[str]:
    words = _vocabulary()
    found = []
    for name, tree in _modules():
        if name.split("/")[1] in OWN_WORDS:
            continue
        for c, other in _spelled(tree):
            if c.value in words and (name, c.value, other) not in SAME_SPELLING:
                found.append(f"{name}:{c.lineno}: {c.value!r} (a word of {words[c.value]}) against {other}")
    return found


def _parses(tree: ast.Module) -> Iterator[tuple[int, str]]:
    """Each place a module reads an instant from text itself: (line, what)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, (ast.Attribute, ast.Name)):
            called = node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id
            if called in PARSERS:
                yield node.lineno, f"{ast.unparse(node.func)}()"
        elif isinstance(node, ast.ImportFrom) and node.module in ("dateutil.parser", "dateutil") \
                and any(a.name in ("parser", "isoparse", "parse") for a in node.names):
            yield node.lineno, f"from {node.module} import a date parser"
        elif isinstance(node, ast.Import) and any(a.name == "dateutil.parser" for a in node.names):
            yield node.lineno, "import dateutil.parser"


def timestamp_parsing_outside_timefmt() -> list[str]:
    return [f"{name}:{line}: {what}" for name, tree in _modules() if name not in PARSER_HOMES
            for line, what in _parses(tree)]


def test_only_timefmt_reads_an_instant() -> None:
    assert timestamp_parsing_outside_timefmt() == []


def test_the_protocol_words_are_spelled_only_in_model() -> None:
    assert protocol_words_outside_model() == []


def test_the_scans_see_what_they_look_for() -> None:
    """Each scan finds a planted case, so a 0 above is a count and not a blind spot."""
    vocabulary = _vocabulary()
    assert {"Started", "sending", "sent", "failed", "skipped", "recorded", "held", "started"} <= set(vocabulary)
    planted = ast.parse('if e.get("EventStatus") == "Started" or s in ("sending", "x"):\n'
                        '    metrics.hints.labels("failed" if error else "sent").inc()\n'
                        'Status = Literal["recorded"]\nWORDS = ("skipped",)\n'
                        'when = datetime.fromisoformat(text)\n')
    spelled = {(c.value, other) for c, other in _spelled(planted) if c.value in vocabulary}
    assert spelled == {("Started", 'e.get("EventStatus")'.replace('"', "'")), ("sending", "s"), ("failed", "labels"),
                       ("sent", "labels"), ("recorded", "Literal"), ("skipped", "constant")}
    parses = ast.parse("from dateutil import parser\nday = date.fromisoformat(t)\nt = time.strptime(t, f)\n")
    assert [what for _, what in _parses(parses)] == ["from dateutil import a date parser", "date.fromisoformat()",
                                                      "time.strptime()"]
    assert all(reason for reason in (*SAME_SPELLING.values(), *PARSER_HOMES.values(), *OWN_WORDS.values()))
    assert all((AGENT.parent / name).is_file() for name in PARSER_HOMES)
    assert all((AGENT.parent / name).is_file() for name, _, _ in SAME_SPELLING)


def test_each_word_that_only_shares_a_spelling_is_still_there() -> None:
    """An exception that matches nothing any more goes, so the list only shrinks."""
    trees = dict(_modules())
    seen = {(name, c.value, other) for name in {n for n, _, _ in SAME_SPELLING} for c, other in _spelled(trees[name])}
    assert set(SAME_SPELLING) <= seen
