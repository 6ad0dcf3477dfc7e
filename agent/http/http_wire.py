"""HTTP/1.x on the wire, as pure functions: a request head parsed from bytes, an answer as bytes.

Strict where leniency lets one request be read two ways (request smuggling): two Content-Length
headers, a Content-Length that is not plain digits, Transfer-Encoding (not supported: 411), folded
header lines, a line ending other than CRLF (a bare LF or CR inside the head), and a target that is
neither a path nor an absolute http(s) URL (`http://[` is a 400 here, never an exception later). Limits: the
request line (414 beyond `MAX_LINE`), the whole head (431 beyond `MAX_HEAD`) and the number of
header lines (431 beyond `MAX_HEADERS`).
"""

from __future__ import annotations

import http
import json
import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from agent.errors import HttpError

MAX_LINE = 8 * 1024
MAX_HEAD = 64 * 1024
MAX_HEADERS = 100
_TOKEN = re.compile(rb"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")
_VERSION = re.compile(rb"^HTTP/(\d)\.(\d)$")
_TARGET = re.compile(rb"^[\x21-\x7e\x80-\xff]+$")
_ABSOLUTE = re.compile(r"^https?://", re.IGNORECASE)


@dataclass
class Request:
    """One parsed request head; `body` is filled in once Content-Length bytes have arrived."""

    method: str
    target: str
    version: tuple[int, int]
    headers: dict[str, str]
    path: str = "/"
    """The target's path (an absolute-form target's too), without the query."""
    content_length: int = 0
    body: bytes = b""
    client: str = ""
    """The caller's IP address; "" on the unix socket."""
    uid: int | None = None
    """The caller's uid from SO_PEERCRED on the unix socket; None over TCP."""
    gid: int | None = None
    """The caller's primary gid from SO_PEERCRED on the unix socket; None over TCP."""

    def header(self, name: str) -> str | None:
        """A header's value by case-insensitive name."""
        return self.headers.get(name.lower())

    @property
    def keep_alive(self) -> bool:
        """HTTP/1.1 keeps the connection unless told to close; HTTP/1.0 only when asked."""
        tokens = {t.strip().lower() for t in (self.header("connection") or "").split(",")}
        return "keep-alive" in tokens if self.version < (1, 1) else "close" not in tokens

    @property
    def expects_continue(self) -> bool:
        """The client waits for `100 Continue` before it sends the body."""
        return (self.header("expect") or "").lower() == "100-continue" and self.version >= (1, 1)


def head_end(buf: bytes | bytearray) -> int:
    """Index just past the blank line ending the head, -1 while incomplete; raises HttpError over the limits."""
    end = buf.find(b"\r\n\r\n", 0, MAX_HEAD + 4)
    if end >= 0:
        return end + 4
    first = buf.find(b"\n")
    if (first < 0 and len(buf) > MAX_LINE) or first > MAX_LINE:
        raise HttpError(414, f"request line longer than {MAX_LINE} bytes", close=True)
    if len(buf) > MAX_HEAD:
        raise HttpError(431, f"request head larger than {MAX_HEAD} bytes", close=True)
    return -1


def parse_head(head: bytes, max_body: int) -> Request:
    """The request in `head` (ending with the blank line); raises HttpError for anything malformed."""
    lines = head[:-4].split(b"\r\n")
    if any(b"\n" in line or b"\r" in line for line in lines):
        raise HttpError(400, "a bare LF or CR in the request head; every line ends in CRLF", close=True)
    if len(lines[0]) > MAX_LINE:
        raise HttpError(414, f"request line longer than {MAX_LINE} bytes", close=True)
    if len(lines) - 1 > MAX_HEADERS:
        raise HttpError(431, f"more than {MAX_HEADERS} header lines", close=True)
    parts = lines[0].split(b" ")
    if len(parts) != 3 or not _TOKEN.match(parts[0]) or not parts[1]:
        raise HttpError(400, "malformed request line", close=True)
    method, target, version_text = parts
    if not _TARGET.match(target):
        raise HttpError(400, "a control character in the request target", close=True)
    version = _VERSION.match(version_text)
    if not version:
        raise HttpError(400, "malformed HTTP version", close=True)
    if version.group(1) != b"1":
        raise HttpError(505, "only HTTP/1.0 and HTTP/1.1 are served", close=True)
    headers: dict[str, str] = {}
    lengths: list[bytes] = []
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep or not _TOKEN.match(name):
            raise HttpError(400, "malformed header line", close=True)
        key = name.decode("ascii").lower()
        text = value.strip(b" \t").decode("latin-1")
        if key == "content-length":
            lengths.append(value.strip(b" \t"))
        headers[key] = f"{headers[key]}, {text}" if key in headers else text
    text_target = target.decode("latin-1")
    request = Request(method.decode("ascii"), text_target, (1, int(version.group(2))), headers,
                      target_path(text_target))
    if "transfer-encoding" in headers:
        raise HttpError(411, "send the body with a Content-Length, not chunked", close=True)
    if len(lengths) > 1:
        raise HttpError(400, "more than one Content-Length header", close=True)
    if lengths:
        if not lengths[0].isdigit() or len(lengths[0]) > 12:
            raise HttpError(400, "Content-Length is not a number", close=True)
        request.content_length = int(lengths[0])
        if request.content_length > max_body:
            raise HttpError(413, f"body of {request.content_length} bytes exceeds the limit of {max_body}", close=True)
    return request


def target_path(target: str) -> str:
    """The path a request target names: origin-form ("/x?q") or absolute-form ("http://h/x?q"); "*" stays "*".
    Raises HttpError 400 for anything else, such as `http://[` (which `urlsplit` refuses with ValueError)."""
    if target.startswith("/") or target == "*":
        return target.partition("?")[0].partition("#")[0]
    if _ABSOLUTE.match(target):
        try:
            return urlsplit(target).path or "/"
        except ValueError:
            pass
    raise HttpError(400, "malformed request target: a path (/probe) or an absolute http URL", close=True)


def response(status: int, body: bytes, content_type: str, *, head_only: bool = False, close: bool = False,
             headers: dict[str, str] | None = None) -> bytes:
    """The bytes of one answer (always with Content-Length, never cached)."""
    lines = [f"HTTP/1.1 {status} {_phrase(status)}", "Server: maintd", f"Content-Type: {content_type}",
             f"Content-Length: {len(body)}", "Cache-Control: no-store"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    if close:
        lines.append("Connection: close")
    data = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    return data if head_only else data + body


def json_body(obj: Any) -> bytes:
    """A JSON answer body (one line)."""
    return (json.dumps(obj, default=str) + "\n").encode()


def error_body(status: int, message: str) -> bytes:
    """The JSON every error answer carries: {"error": ..., "status": ...}."""
    return json_body({"error": message, "status": status})


def _phrase(status: int) -> str:
    try:
        return http.HTTPStatus(status).phrase
    except ValueError:
        return "Unknown"
