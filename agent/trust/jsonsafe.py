"""JSON from parties maintd does not control (IMDS, peers, gates, HTTP clients, files), bounded.

Size and nesting depth are checked before `json.loads` sees the text: a 20 MB answer or
`[[[[...]]]]` a thousand levels deep is refused as `UnsafeJson` (a `ValueError`), so every caller
that already treats `ValueError` as a bad answer is covered, and none can meet `RecursionError`.
The depth scan runs at C speed (escapes dropped, `translate` keeps only brackets and quotes, and
every second quote-separated part is inside a string), so it costs about one parse again.
"""

from __future__ import annotations

import json
from itertools import accumulate
from typing import Any

from agent.errors import UnsafeJson

MAX_DEPTH = 32
"""Deepest nesting accepted: IMDS documents are 4 deep, peer and gate answers under 10."""

_NOT_SYNTAX = bytes(b for b in range(256) if b not in b'[]{}"')
_STEP = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}


def depth(data: bytes) -> int:
    """How deeply arrays and objects nest in `data` (0 for a scalar), ignoring brackets in strings."""
    unescaped = data.replace(b"\\\\", b"").replace(b'\\"', b"")  # escaped backslashes first, then quotes
    brackets = b"".join(unescaped.translate(None, _NOT_SYNTAX).split(b'"')[::2])
    if not brackets:
        return 0
    return max(accumulate(map(_STEP.__getitem__, brackets)))


def loads(data: bytes | str, *, max_bytes: int, max_depth: int = MAX_DEPTH) -> Any:
    """`json.loads` for untrusted text; raises ValueError (UnsafeJson or JSONDecodeError) on anything bad."""
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data
    if len(raw) > max_bytes:
        raise UnsafeJson(f"{len(raw)} bytes, more than the {max_bytes} accepted")
    nesting = depth(raw)
    if nesting > max_depth:
        raise UnsafeJson(f"nested {nesting} levels deep, more than the {max_depth} accepted")
    try:
        return json.loads(raw)
    except UnicodeDecodeError as exc:
        raise UnsafeJson(f"not UTF-8 text: {exc.reason} at byte {exc.start}") from None
    except RecursionError:  # unreachable after the depth check; kept so no caller ever sees it
        raise UnsafeJson("nested too deeply to parse") from None
