"""Every HTTP call maintd makes to a peer or a gate: readiness asks, readiness pushes, health reads, Prometheus.

One keep-alive `requests.Session`, made at the first call (requests is several MB of memory a VM that
never has a multi-VM event need not pay), with `trust_env = False` (a proxy never sits between peers) and
no adapter-level retries: the coordinator's cadence is the retry. The shared bearer token goes
only with requests to peer URLs (which `addressing` built from the configured map, file or
template), never to Prometheus. Answers are parsed with `jsonsafe` (size and depth capped), and
anything unexpected is an answer of the wrong shape, never an exception for the caller.
"""

from __future__ import annotations

from dataclasses import dataclass
import threading
from typing import TYPE_CHECKING, Any, Callable

from agent import jsonsafe
from agent.coordination.peer_addressing import event_url

if TYPE_CHECKING:
    import requests

MAX_ANSWER_BYTES = 256 * 1024
MAX_PROMETHEUS_BYTES = 8 * 1024 * 1024
READY, NOT_READY, UNREACHABLE, INVALID = "ready", "not_ready", "unreachable", "invalid"
"""Outcomes of a readiness ask (the `outcome` label of maintd_peer_requests_total)."""


@dataclass(frozen=True)
class Answer:
    """A peer's answer to `GET /v1/events/{id}`: the outcome and a short readable detail."""

    outcome: str
    detail: str

    @property
    def ready(self) -> bool:
        return self.outcome == READY

    @property
    def reachable(self) -> bool:
        return self.outcome != UNREACHABLE


def readiness(status: int, body: bytes, name: str) -> Answer:
    """What peer `name`'s answer means: ready only for a 200 whose JSON object says `"ready": true`.

    An answer that names another VM (`vm_name`) is invalid, never ready: two peers given one URL
    (a copy-paste in a peers file, a port another agent holds) would otherwise let one VM's
    readiness stand for another's. An answer without the field (a stand-in, an older agent) is read
    as before.
    """
    if status == 404:
        return Answer(NOT_READY, "has not seen the event yet")
    if status != 200:
        return Answer(UNREACHABLE, f"answered {status}")
    try:
        parsed = jsonsafe.loads(body, max_bytes=MAX_ANSWER_BYTES)
    except ValueError as exc:
        return Answer(INVALID, f"answer is not JSON: {str(exc)[:80]}")
    if not isinstance(parsed, dict) or not isinstance(parsed.get("ready"), bool):
        return Answer(INVALID, 'answer has no "ready": true/false')
    answered_as = parsed.get("vm_name")
    if isinstance(answered_as, str) and answered_as.casefold() != name.casefold():
        return Answer(INVALID, f"answered as {answered_as[:64]!r}: another VM has this peer's address")
    return Answer(READY, "ready") if parsed["ready"] else Answer(NOT_READY, "preparing")


class PeerClient:
    """HTTP to peers and gates on one session; thread-safe (requests' pool is)."""

    def __init__(self, token_reader: Callable[[], str | None], timeout: float, pool_size: int) -> None:
        self.token_reader = token_reader
        self.timeout = timeout
        self.pool_size = pool_size
        self._lock = threading.Lock()
        self._session: requests.Session | None = None

    @property
    def session(self) -> requests.Session:
        """The one session, made at the first call."""
        with self._lock:
            if self._session is None:
                import requests
                from requests.adapters import HTTPAdapter

                session = requests.Session()
                session.trust_env = False
                adapter = HTTPAdapter(pool_connections=self.pool_size, pool_maxsize=self.pool_size, max_retries=0)
                session.mount("http://", adapter)
                session.mount("https://", adapter)
                self._session = session
            return self._session

    def _headers(self) -> dict[str, str]:
        token = self.token_reader()
        return {"Authorization": f"Bearer {token}"} if token else {}

    def ask(self, base: str, event_id: str, name: str) -> Answer:
        """Whether peer `name`, at `base`, is ready for the event."""
        try:
            r = self.session.get(event_url(base, event_id), headers=self._headers(), timeout=self.timeout)
            return readiness(r.status_code, r.content, name)
        except (OSError, ValueError) as exc:  # requests' errors are OSErrors
            return Answer(UNREACHABLE, type(exc).__name__)
        except Exception as exc:  # whatever else the exchange raised, it is not a ready peer; asked again later
            return Answer(INVALID, f"{type(exc).__name__}: {str(exc)[:80]}")

    def push_ready(self, base: str, event_id: str, vm_name: str) -> bool:
        """Tell the peer at `base` (the acting leader) that this VM is ready; True when it took the message."""
        try:
            r = self.session.post(event_url(base, event_id, "/peer-ready"), json={"vm": vm_name},
                                  headers=self._headers(), timeout=self.timeout)
            return 200 <= r.status_code < 300
        except Exception:  # a push is retried until taken; nothing it met may stop the lane
            return False

    def health(self, base: str) -> Any:
        """The peer's `/v1/health` JSON; raises OSError (requests' errors) or ValueError when there is none."""
        r = self.session.get(f"{base}/v1/health", headers=self._headers(), timeout=self.timeout)
        r.raise_for_status()
        return jsonsafe.loads(r.content, max_bytes=MAX_ANSWER_BYTES)

    def prometheus(self, base: str, path: str, timeout: float, params: dict[str, str] | None = None) -> Any:
        """A Prometheus API answer's JSON (no peer token); raises OSError (requests' errors) or ValueError."""
        r = self.session.get(f"{base.rstrip('/')}{path}", params=params, timeout=timeout)
        r.raise_for_status()
        return jsonsafe.loads(r.content, max_bytes=MAX_PROMETHEUS_BYTES)

    def close(self) -> None:
        """Close the pooled connections (if a call ever opened any)."""
        with self._lock:
            if self._session is not None:
                self._session.close()
