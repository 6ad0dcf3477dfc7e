"""`coordination.peers_file`: a name → base URL map that a deploy tool or cloud-init writes, reread when it changes.

The file is YAML (so JSON too): `{"web_3": "http://10.0.0.7:8088", ...}`. `PeersWatch` looks at it
first when it is built at start, before the loop's first coordination pass (so no peer is ever asked at the
`peer_url` template's address for want of a first read), then on a thread of its own every `CHECK_EVERY`
seconds, never on the loop: each look is one stat, and
the file is read again only when its size, mtime or inode changed; the loop takes the last look
as one immutable `PeersMap`. It is opened without following a link and without blocking (`O_NOFOLLOW |
O_NONBLOCK`), and read only when the open file is a regular one of at most `MAX_BYTES`: a FIFO
there would otherwise hang the watcher in `open`. A missing, unreadable or invalid file never
empties the fleet: the last good map stays in use and `problem` says what is wrong (the
coordinator logs it and reports it in health and `maintd status`).
"""

from __future__ import annotations

import errno
import os
import re
import stat
import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import yaml

from agent.trust import jsonsafe
from agent.trust.pathtrust import first_problem

MAX_BYTES = 4 * 1024 * 1024
MAX_ENTRIES = 100_000
CHECK_EVERY = 1.0
"""Seconds between two looks at the peers file (on the watcher's thread)."""
URL = re.compile(r"^https?://[^\s/?#@]+(/[^\s?#]*)?$")


LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
"""libyaml when present: a 1000-peer file then parses in a few ms, not 100."""


def _load(text: str) -> Any:
    """JSON (bounded, fast) or YAML without aliases (no alias bombs)."""
    if text.lstrip().startswith("{"):
        try:
            return jsonsafe.loads(text, max_bytes=MAX_BYTES)
        except ValueError:
            pass  # YAML flow style also starts with {
    try:
        if any(isinstance(e, yaml.AliasEvent) for e in yaml.parse(text, Loader=LOADER)):
            raise ValueError("YAML aliases are not accepted")
        return yaml.load(text, Loader=LOADER)
    except yaml.YAMLError as exc:
        raise ValueError(f"not YAML: {str(exc).splitlines()[0]}") from None
    except RecursionError:
        raise ValueError("nested too deeply") from None


def parse(text: str) -> dict[str, str]:
    """The map in a peers file's text; ValueError saying what is wrong."""
    data = _load(text)
    if not isinstance(data, dict):
        raise ValueError(f"expected a mapping of VM name to base URL, got {type(data).__name__}")
    if len(data) > MAX_ENTRIES:
        raise ValueError(f"{len(data)} entries, more than the {MAX_ENTRIES} accepted")
    out: dict[str, str] = {}
    for name, url in data.items():
        if not isinstance(name, str) or not name or not isinstance(url, str) or not URL.match(url):
            shown = repr(url[:80]) if isinstance(url, str) else type(url).__name__
            raise ValueError(f"entry {name[:60] if isinstance(name, str) else type(name).__name__!r}: "
                             f"expected name: http(s)://host[:port][/path], got {shown}")
        out[name] = url.rstrip("/")
    return out


def read_regular(path: str, max_bytes: int) -> str:
    """The text of the regular file at `path`, never blocking on a FIFO nor following a link; ValueError
    saying why not (OSError when it cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ValueError("is a symbolic link, which is not followed") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError("is not a regular file (a FIFO, socket, device or directory is never read)")
        if st.st_size > max_bytes:
            raise ValueError(f"{st.st_size} bytes, more than the {max_bytes} accepted")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(max_bytes + 1)
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise ValueError(f"more than the {max_bytes} bytes accepted")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError("is not UTF-8 text") from None


class PeersFile:
    """The last good map from one file; `current()` rereads it when it changed."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self.peers: dict[str, str] = {}
        self.problem: str | None = None
        self.loads = 0
        self._signature: tuple[int, int, int] | None = None

    def current(self) -> tuple[dict[str, str], bool]:
        """The map in force, and whether this call changed it or its problem (to log and report)."""
        if self.path is None:
            return self.peers, False
        before = (self.peers, self.problem)
        try:
            st = os.stat(self.path)
            signature = (st.st_size, st.st_mtime_ns, st.st_ino)
            if signature == self._signature:
                return self.peers, False
            self._signature = signature  # an invalid file is read again only once it changes
            untrusted = first_problem(self.path)  # whoever can change it steers where the peer token goes
            if untrusted is not None:
                raise ValueError(f"not used: {untrusted}")
            self.peers = parse(read_regular(self.path, MAX_BYTES))
            self.problem = None
            self.loads += 1
        except OSError as exc:
            self._signature = None
            self.problem = f"{self.path}: {exc.strerror or exc}"
        except ValueError as exc:
            self.problem = f"{self.path}: {exc}"
        return self.peers, (self.peers, self.problem) != before


@dataclass(frozen=True)
class PeersMap:
    """One look at the peers file, handed over whole: the map in force (the last good one), what is wrong
    with the file now (None: nothing), and a version bumped by the first look and whenever either changed
    (0: the file was not looked at yet)."""

    peers: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    problem: str | None = None
    version: int = 0


class PeersWatch:
    """Follows one peers file from a thread of its own; `latest` is the last look (no I/O to read it).

    The first look is made by the caller (`look_now`, at start: the map is in force before anything asks a
    peer) or, built on the loop by a reload, by the thread at once."""

    def __init__(self, path: str | None, every: float = CHECK_EVERY, *, look_now: bool = True) -> None:
        self.path = path
        self.latest = PeersMap()
        self._file = PeersFile(path)
        self._stop = threading.Event()
        if path is not None:
            if look_now:
                self.look()
            threading.Thread(target=_watch, args=(weakref.ref(self), self._stop, every), name="peers-file",
                             daemon=True).start()

    def look(self) -> None:
        """Stat the file (read it when it changed) and publish a new `PeersMap` at the first look and when the
        map or its problem changed."""
        peers, changed = self._file.current()
        if changed or self.latest.version == 0:
            self.latest = PeersMap(MappingProxyType(dict(peers)), self._file.problem, self.latest.version + 1)

    def stop(self) -> None:
        """End the watcher's thread (also ended when the watch is dropped)."""
        self._stop.set()


def _watch(ref: weakref.ref[PeersWatch], stop: threading.Event, every: float) -> None:
    """The watcher's thread: a look at once, then one every `every` seconds until stopped or the watch is gone."""
    while True:
        watch = ref()
        if watch is None:
            return
        watch.look()
        del watch  # holds no reference while it sleeps: a dropped watch ends its thread
        if stop.wait(every):
            return
