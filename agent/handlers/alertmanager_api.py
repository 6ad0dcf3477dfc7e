"""The few calls of Alertmanager's v2 API the `alertmanager` handler makes, on one replica each.

Every answer is a `boundedhttp` exchange (the whole answer within the request's timeout, at most
64 KiB read for one silence). A silence is found again by its id (`GET /api/v2/silence/{id}`), or
among maintd's own (`GET /api/v2/silences`, narrowed by the first equality matcher when there is one, then the same
createdBy, comment and matchers; a list over 8 MiB is not searched, so only noted ids are known
there); made or changed by `POST /api/v2/silences` (Alertmanager keeps the id when only the end
of an active silence moves, and answers a new one when it had to replace it); expired by
`DELETE /api/v2/silence/{id}`, which answers 500 for one that had expired already, so a failed
DELETE is checked by reading the silence back. A 5xx, 401, 403, 429 or 3xx is a failure (redirects
are never followed); anything that is not the JSON expected is one too. The replicas are tried all
at once (`try_each`), each on a session of its own.
"""

from __future__ import annotations

import base64
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, NotRequired, TypedDict
from urllib.parse import quote

import requests

from agent import __version__
from agent.errors import AnswerTooLarge, MaintdError
from agent.handlers.silences import MatcherJson, SilenceNote, Window
from agent.model.timefmt import iso_z, parse_iso
from agent.net import boundedhttp
from agent.net.boundedhttp import Reply
from agent.trust import jsonsafe
from agent.trust.secretfile import read_token

MAX_REPLY_BYTES = 64 * 1024
"""The most of an answer about one silence read."""
MAX_LIST_BYTES = 8 * 1024 * 1024
"""The most of the list of silences read (expired ones stay listed for days: `--data.retention`)."""


class PostableSilence(TypedDict):
    """The body of `POST /api/v2/silences` (`id`: the silence to change)."""

    matchers: list[MatcherJson]
    startsAt: str
    endsAt: str
    createdBy: str
    comment: str
    id: NotRequired[str]


class Failed(Exception):
    """A replica did not do what was asked (its answer, or why none came)."""


def times(silence: dict[str, Any]) -> Window:
    """When a silence Alertmanager answered starts and ends."""
    return Window(parse_iso(str(silence["startsAt"])), parse_iso(str(silence["endsAt"])))


def instant(t: datetime) -> str:
    """An instant as sent to Alertmanager: ISO 8601 UTC to the millisecond."""
    if t.microsecond < 1000:
        return iso_z(t.replace(microsecond=0))
    return t.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def same_matchers(a: Sequence[Any], b: Sequence[MatcherJson]) -> bool:
    """Whether a replica's list of v2 matcher objects (`a`, as answered) says the same as `b` (in any order;
    isEqual defaults to true)."""
    def key(ms: Sequence[Any]) -> list[tuple[Any, ...]]:
        return sorted((m.get("name"), m.get("value"), bool(m.get("isRegex")), m.get("isEqual", True) is not False)
                      for m in ms if isinstance(m, dict))
    return key(a) == key(b)


def silence_filter(matchers: list[MatcherJson]) -> dict[str, str]:
    """The query narrowing the list to silences with the first equality matcher (Alertmanager compares its
    value as a label value, and ignores a silence's regex matchers there); none without one."""
    for m in matchers:
        if m.get("isEqual", True) and not m.get("isRegex"):
            value = str(m["value"]).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
            return {"filter": f'{m["name"]}="{value}"'}
    return {}


@dataclass(frozen=True)
class Credentials:
    """Where the handler's secret comes from (read at every request, so a rotated token is picked up)."""

    token_file: str | None = None
    basic_auth_file: str | None = None

    def headers(self) -> dict[str, str]:
        headers = {"User-Agent": f"maintd/{__version__}", "Accept": "application/json"}
        path = self.token_file or self.basic_auth_file
        if path:
            secret, problem = read_token(path)
            if problem or secret is None:
                raise Failed(f"{path} {problem}")
            headers["Authorization"] = f"Bearer {secret}" if self.token_file else \
                "Basic " + base64.b64encode(secret.encode()).decode()
        return headers


@dataclass(frozen=True)
class Replica:
    """One Alertmanager (base URL) over a session, each request within `timeout` seconds."""

    session: requests.Session
    url: str
    timeout: float
    credentials: Credentials

    def _call(self, method: str, path: str, max_bytes: int = MAX_REPLY_BYTES, **kwargs: Any) -> Reply:
        reply = boundedhttp.exchange(self.session, method, self.url.rstrip("/") + "/api/v2" + path,
                                     timeout=self.timeout, max_bytes=max_bytes, headers=self.credentials.headers(),
                                     **kwargs)
        if reply.status >= 500 or reply.status in (401, 403, 429) or 300 <= reply.status < 400:
            raise Failed(f"{method} answered {reply.status}: {reply.text[:200]}")
        return reply

    def get(self, sid: str) -> dict[str, Any] | None:
        """The silence, or None when it is gone or expired (someone deleted it)."""
        reply = self._call("GET", f"/silence/{quote(sid, safe='')}")
        if reply.status == 404:
            return None
        silence = _json(reply, "GET", dict)
        return None if silence.get("status", {}).get("state") == "expired" else silence

    def ours(self, note: SilenceNote) -> list[dict[str, Any]]:
        """maintd's unexpired silences of the noted event (same createdBy, comment and matchers)."""
        try:
            reply = self._call("GET", "/silences", MAX_LIST_BYTES, params=silence_filter(note["matchers"]))
        except AnswerTooLarge:  # not searchable: only the noted id is known (see the module's docstring)
            return []
        return [s for s in _json(reply, "GET", list) if isinstance(s, dict)
                and s.get("createdBy") == note["created_by"] and s.get("comment") == note["comment"]
                and s.get("status", {}).get("state") != "expired"
                and same_matchers(s.get("matchers", []), note["matchers"])]

    def post(self, note: SilenceNote, want: Window, sid: str | None) -> str:
        """Make (or, with `sid`, change) the silence; the id Alertmanager answers (new when it replaced it)."""
        body: PostableSilence = {"matchers": note["matchers"], "startsAt": instant(want.starts),
                                 "endsAt": instant(want.ends), "createdBy": note["created_by"],
                                 "comment": note["comment"]}
        if sid:
            body["id"] = sid
        reply = self._call("POST", "/silences", json=body)
        if reply.status == 404 and sid:  # gone since it was read: make a new one
            return self.post(note, want, None)
        new = _json(reply, "POST", dict).get("silenceID")
        if not isinstance(new, str) or not new:
            raise Failed("POST answered without a silenceID")
        return new

    def delete(self, sid: str) -> None:
        """Expire the silence; done too when it is gone or had expired."""
        try:
            reply: Reply | None = self._call("DELETE", f"/silence/{quote(sid, safe='')}")
        except Failed:
            reply = None  # Alertmanager answers 500 for a silence that already expired: look
        if reply is not None and reply.status == 200:
            return
        if self.get(sid) is not None:
            raise Failed(f"DELETE of silence {sid} did not expire it")


ReplicaWork = Callable[[Replica], None]
FAILURES = (Failed, requests.RequestException, OSError, MaintdError, ValueError, KeyError, TypeError)
"""What a replica's try may end in that is the replica's failure (anything else is a bug, raised)."""


def try_each(urls: list[str], one: ReplicaWork, timeout: float, credentials: Credentials) -> dict[str, str]:
    """One try of `one` at each replica, all at once, each on a session of its own (a replica that hangs never keeps
    another from its silence); the failures by URL."""
    errors: dict[str, str] = {}
    bugs: list[Exception] = []

    def attempt(url: str) -> None:
        with boundedhttp.session(trust_env=False) as session:
            try:
                one(Replica(session, url, timeout, credentials))
            except FAILURES as exc:
                errors[url] = str(exc) if isinstance(exc, Failed) else type(exc).__name__
            except Exception as exc:  # handed to the caller's thread, as if tried there
                bugs.append(exc)

    threads = [threading.Thread(target=attempt, args=(url,), name="alertmanager-replica", daemon=True)
               for url in urls[1:]]
    for thread in threads:
        thread.start()
    if urls:
        attempt(urls[0])
    for thread in threads:
        thread.join()
    if bugs:
        raise bugs[0]
    return errors


def _json(reply: Reply, method: str, kind: type) -> Any:
    if reply.status != 200:
        raise Failed(f"{method} answered {reply.status}: {reply.text[:200]}")
    body = jsonsafe.loads(reply.body, max_bytes=MAX_LIST_BYTES)
    if not isinstance(body, kind):
        raise Failed(f"{method} answered 200 with an unexpected body")
    return body
