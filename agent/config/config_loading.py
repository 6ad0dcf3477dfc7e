"""Reading maintd's config file and its YAML, every value with the file:line:col it came from.

The YAML is composed into nodes first so every key keeps its position; duplicate keys are refused
(PyYAML would silently keep the last). Whatever the file holds, the answer is text and values with
their marks, or a `ConfigError` naming the file and the fix: bytes that are not UTF-8, an empty
file (a truncated write, not "all defaults": write `{}` for that), a directory, a dangling symlink,
no permission, nesting deeper than `MAX_YAML_DEPTH` (composing is recursive) and aliases or merge
keys that expand past `MAX_YAML_VALUES` (a "billion laughs" is refused in milliseconds instead of
filling memory). What the values mean is `agent.config.config`'s job.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import yaml

from agent.errors import ConfigError, ConfigValueError
from agent.trust.pathtrust import component_problem, first_problem, trusted_uids

Path_ = tuple[str | int, ...]

MAX_CONFIG_BYTES = 1024 * 1024
"""Largest config file read (a config with a hundred handlers is under 50 kB)."""
MAX_YAML_DEPTH = 32
"""Deepest nesting accepted, aliases followed (the deepest real key, a monthly occurrence, is 6)."""
MAX_YAML_VALUES = 20_000
"""Most values (aliases and merge keys expanded) one config may stand for."""


class Marked:
    """The values of one YAML document and the (line, column) of every path in it."""

    def __init__(self, source: str, data: Any, marks: dict[Path_, tuple[int, int]]) -> None:
        self.source, self.data, self.marks = source, data, marks

    def error(self, exc: ConfigValueError) -> ConfigError:
        """`exc` (a key and a message) as a ConfigError at the position of its key, or its nearest parent's."""
        line, col = _mark_for(self.marks, exc.key)
        return ConfigError(self.source, line, col, exc.key, exc.message)

    def where(self, key: str) -> str:
        """`source:line:column` of `key` (or of its nearest parent in the file), `source` when it has none."""
        line, col = _mark_for(self.marks, key)
        return self.source if line is None else f"{self.source}:{line}:{col}"


def parse_yaml(text_: str, source: str = "<string>") -> Marked:
    """The values of the YAML `text_` with their positions; raise ConfigError naming source, line, column and key."""
    try:
        loader = _BoundedLoader(text_)
    except yaml.YAMLError as exc:  # the reader refuses control characters before parsing starts
        raise ConfigError(source, None, None, "", f"not valid YAML: {exc}") from None
    values = _MarkedValues(loader)
    try:
        node = loader.get_single_node()
        data = values.build(node, ()) if node is not None else {}
    except _PositionedError as exc:
        raise ConfigError(source, exc.line, exc.column, exc.key, exc.message) from None
    except ConfigValueError as exc:
        raise Marked(source, None, values.marks).error(exc) from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line, col = (mark.line + 1, mark.column + 1) if mark else (None, None)
        raise ConfigError(source, line, col, "", f"not valid YAML: {exc.problem or exc.context}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(source, None, None, "", f"not valid YAML: {exc}") from None
    except RecursionError:  # unreachable with the depth bounds above; kept so no caller ever sees it
        raise ConfigError(source, None, None, "", f"nested too deeply (more than {MAX_YAML_DEPTH} levels)") from None
    finally:
        loader.dispose()
    return Marked(source, {} if data is None else data, values.marks)


def read_text(path: str | os.PathLike[str], check_perms: bool = True) -> str:
    """The text of the config file at `path`, its permissions checked."""
    p = Path(path)
    raw = _read(p, check_perms)
    try:
        text_ = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(str(p), None, None, "", f"is not UTF-8 text (byte {exc.start}: {exc.reason}); "
                          "a damaged file or another encoding: restore it or save it as UTF-8") from None
    if not text_.strip():
        raise ConfigError(str(p), None, None, "", "is empty (a truncated write?); restore it, or write {} "
                          "to run with every default")
    return text_


class _BoundedLoader(yaml.SafeLoader):
    """SafeLoader that refuses deep nesting while composing and merge keys that expand too far."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.depth = 0

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node | None:
        self.depth += 1
        try:
            if self.depth > MAX_YAML_DEPTH:
                raise _too_deep(self.peek_event().start_mark)  # type: ignore[no-untyped-call]  # PyYAML's stubs leave it untyped
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1

    def flatten_mapping(self, node: yaml.MappingNode) -> None:
        """Count what `<<` merges would copy (merged maps flattened first, depth-bounded) before copying it."""
        self.depth += 1
        try:
            if self.depth > MAX_YAML_DEPTH:
                raise _too_deep(node.start_mark)
            total = len(node.value)
            for key_node, value_node in node.value:
                if key_node.tag != "tag:yaml.org,2002:merge":
                    continue
                for sub in value_node.value if isinstance(value_node, yaml.SequenceNode) else [value_node]:
                    if isinstance(sub, yaml.MappingNode):
                        self.flatten_mapping(sub)
                        total += len(sub.value)
            if total > MAX_YAML_VALUES:
                raise _too_many(node.start_mark)
            super().flatten_mapping(node)
        finally:
            self.depth -= 1


def _too_deep(mark: yaml.Mark) -> _PositionedError:
    return _PositionedError(mark.line + 1, mark.column + 1, "", f"nested more than {MAX_YAML_DEPTH} levels deep "
                            "(aliases followed); flatten the structure")


def _too_many(mark: yaml.Mark) -> _PositionedError:
    return _PositionedError(mark.line + 1, mark.column + 1, "", f"stands for more than {MAX_YAML_VALUES} values "
                            "once aliases and merge keys are expanded; write the values out or use fewer aliases")


class _MarkedValues:
    """Plain Python values from a YAML node tree, plus the (line, column) of every path in it."""

    def __init__(self, loader: _BoundedLoader) -> None:
        self.loader = loader
        self.marks: dict[Path_, tuple[int, int]] = {}
        self.values = 0

    def build(self, node: yaml.Node, path: Path_) -> Any:
        self.values += 1
        if self.values > MAX_YAML_VALUES:
            raise _too_many(node.start_mark)
        if len(path) > MAX_YAML_DEPTH:  # an alias to an enclosing node makes a cycle
            raise _too_deep(node.start_mark)
        self.marks.setdefault(path, (node.start_mark.line + 1, node.start_mark.column + 1))
        if isinstance(node, yaml.MappingNode):
            self.loader.flatten_mapping(node)
            out: dict[Any, Any] = {}
            for key_node, value_node in node.value:
                key = self._construct(key_node, path) if isinstance(key_node, yaml.ScalarNode) else None
                if not isinstance(key, (str, int, float, bool)) or key is None:
                    raise ConfigValueError(_fmt_path(path), "keys must be plain text")
                if key in out:
                    line = key_node.start_mark.line + 1
                    first = self.marks.get(path + (str(key),), (None, None))[0]
                    raise _PositionedError(line, key_node.start_mark.column + 1, _fmt_path(path + (str(key),)),
                                           f"duplicate key (first given on line {first}); keep only one")
                self.marks[path + (str(key),)] = (key_node.start_mark.line + 1, key_node.start_mark.column + 1)
                out[str(key) if isinstance(key, str) else key] = self.build(value_node, path + (str(key),))
            return out
        if isinstance(node, yaml.SequenceNode):
            return [self.build(item, path + (i,)) for i, item in enumerate(node.value)]
        return self._construct(node, path)

    def _construct(self, node: yaml.Node, path: Path_) -> Any:
        try:
            return self.loader.construct_object(node, deep=True)
        except (ValueError, OverflowError) as exc:  # e.g. a date that does not exist: 2026-13-01
            raise _PositionedError(node.start_mark.line + 1, node.start_mark.column + 1, _fmt_path(path),
                                   f"cannot be read as a value: {exc}") from None


class _PositionedError(Exception):
    def __init__(self, line: int, column: int, key: str, message: str) -> None:
        super().__init__(message)
        self.line, self.column, self.key, self.message = line, column, key, message


def _fmt_path(path: Path_) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _parse_key(key: str) -> Path_:
    parts: list[str | int] = []
    for dotted in key.split("."):
        while dotted:
            if dotted.startswith("["):
                end = dotted.index("]")
                parts.append(int(dotted[1:end]))
                dotted = dotted[end + 1:]
            else:
                name, _, rest = dotted.partition("[")
                parts.append(name)
                dotted = "[" + rest if rest else ""
    return tuple(parts)


def _mark_for(marks: dict[Path_, tuple[int, int]], key: str) -> tuple[int | None, int | None]:
    try:
        path = _parse_key(key) if key else ()
    except ValueError:  # a key whose own name holds "[" (found by fuzzing): the document's position
        path = ()
    while True:
        if path in marks:
            return marks[path]
        if not path:
            return None, None
        path = path[:-1]


def check_permissions(path: Path, st: os.stat_result | None = None) -> None:
    """Refuse a config file that anyone but root or maintd's user could change, or replace through a directory
    above it (the rules of `agent.trust.pathtrust`): hooks in it run as maintd's user. `st`: the opened file's."""
    uids = trusted_uids()
    problem = component_problem(str(path), st or path.stat(), uids) or first_problem(path, uids)
    if problem:
        raise ConfigError(str(path), None, None, "", f"refused: {problem} (whoever can change the config chooses "
                          "the hooks maintd runs)")


def _read(p: Path, check_perms: bool) -> bytes:
    """The bytes of the config file; every way of not being a readable file is a ConfigError with the fix."""
    def refuse(message: str) -> ConfigError:
        return ConfigError(str(p), None, None, "", message)

    try:
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        if p.is_symlink():
            raise refuse(f"is a symbolic link to {os.readlink(p)}, which does not exist; fix the link or pass "
                         "--config") from None
        raise refuse("no such file; create it (see config/maintd.yaml) or pass --config") from None
    except PermissionError:
        raise refuse(f"cannot be read by maintd's user (uid {os.geteuid()}): permission denied; fix: "
                     f"chown root {p} and run maintd as root, or make it readable (not writable) by "
                     "maintd's user") from None
    except OSError as exc:
        raise refuse(f"cannot be read: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise refuse("is a directory; pass the config file itself (such as /etc/maintd/maintd.yaml)")
        if not stat.S_ISREG(st.st_mode):
            raise refuse("is not a regular file; pass the config file itself")
        if check_perms:
            check_permissions(p, st)
        data = os.read(fd, MAX_CONFIG_BYTES + 1)
        while len(data) <= MAX_CONFIG_BYTES and (chunk := os.read(fd, MAX_CONFIG_BYTES + 1 - len(data))):
            data += chunk
    except OSError as exc:
        raise refuse(f"cannot be read: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if len(data) > MAX_CONFIG_BYTES:
        raise refuse(f"is larger than {MAX_CONFIG_BYTES} bytes; a config is a few kilobytes: is this the right file?")
    return data
