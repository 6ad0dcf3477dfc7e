"""`coordination.peers_file`: a name → base URL map that a deploy tool or cloud-init writes, reread when it changes.

The file is YAML (so JSON too): `{"web_3": "http://10.0.0.7:8088", ...}`. It is stat'ed at most
once per `current()` call (once per coordination tick) and read again only when its size, mtime
or inode changed. A missing, unreadable or invalid file never empties the fleet: the last good map
stays in use and `problem` says what is wrong (the coordinator logs it and reports it in health
and `maintd status`).
"""

from __future__ import annotations

import os
import re
from typing import Any

import yaml

from agent import jsonsafe

MAX_BYTES = 4 * 1024 * 1024
MAX_ENTRIES = 100_000
URL = re.compile(r"^https?://[^\s/?#@]+(/[^\s?#]*)?$")


LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
"""libyaml when present: a 1000-peer file then parses in a few ms on the loop thread, not 100."""


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
            if st.st_size > MAX_BYTES:
                raise ValueError(f"{st.st_size} bytes, more than the {MAX_BYTES} accepted")
            with open(self.path, encoding="utf-8") as f:
                self.peers = parse(f.read(MAX_BYTES + 1))
            self.problem = None
            self.loads += 1
        except OSError as exc:
            self._signature = None
            self.problem = f"{self.path}: {exc.strerror or exc}"
        except ValueError as exc:
            self.problem = f"{self.path}: {exc}"
        return self.peers, (self.peers, self.problem) != before
