"""The HTTP the gates ask with, whatever the backend: Prometheus' API, and a VM's /v1/health (pure I/O edge).

One keep-alive `requests.Session`, made at the first call (requests is several MB of memory a VM that never
asks a gate need not pay), with `trust_env = False` and no adapter-level retries: the gates' cadence is the
retry. Every exchange goes through `boundedhttp` (one deadline for the whole exchange, a byte cap on the
body); answers are parsed with `jsonsafe`. The peers backend's client (`peers/peer_client.py`) is one of
these, with the peers' token and their asks and pushes added.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from agent.trust import jsonsafe

if TYPE_CHECKING:
    import requests

    from agent.net.boundedhttp import Reply

MAX_ANSWER_BYTES = 256 * 1024
MAX_PROMETHEUS_BYTES = 8 * 1024 * 1024


def json_of(reply: Reply, max_bytes: int) -> Any:
    """The JSON of a 2xx answer; ValueError for any other status or a body that is not JSON."""
    if not 200 <= reply.status < 300:
        raise ValueError(f"answered {reply.status}")
    return jsonsafe.loads(reply.body, max_bytes=max_bytes)


class GateClient:
    """HTTP to gates on one session; thread-safe (requests' pool is)."""

    def __init__(self, timeout: float, pool_size: int) -> None:
        self.timeout = timeout
        self.pool_size = pool_size
        self._lock = threading.Lock()
        self._session: requests.Session | None = None

    @property
    def session(self) -> requests.Session:
        """The one session, made at the first call."""
        with self._lock:
            if self._session is None:
                from agent.net import boundedhttp

                self._session = boundedhttp.session(self.pool_size, trust_env=False)
            return self._session

    def _exchange(self, method: str, url: str, *, max_bytes: int, timeout: float | None = None,
                  truncate: bool = False, **kwargs: Any) -> Reply:
        from agent.net import boundedhttp

        return boundedhttp.exchange(self.session, method, url, timeout=self.timeout if timeout is None else timeout,
                                    max_bytes=max_bytes, truncate=truncate, **kwargs)

    def _headers(self) -> dict[str, str]:
        """Headers of a request to a VM (none here; the peers' client adds their token)."""
        return {}

    def health(self, base: str) -> Any:
        """The VM's `/v1/health` JSON; raises OSError (no answer in time) or ValueError when there is none."""
        r = self._exchange("GET", f"{base}/v1/health", max_bytes=MAX_ANSWER_BYTES, headers=self._headers())
        return json_of(r, MAX_ANSWER_BYTES)

    def prometheus(self, base: str, path: str, timeout: float, params: dict[str, str] | None = None) -> Any:
        """A Prometheus API answer's JSON (no peer token); raises OSError (no answer in time) or ValueError."""
        r = self._exchange("GET", f"{base.rstrip('/')}{path}", max_bytes=MAX_PROMETHEUS_BYTES, timeout=timeout,
                           params=params)
        return json_of(r, MAX_PROMETHEUS_BYTES)

    def close(self) -> None:
        """Close the pooled connections (if a call ever opened any)."""
        with self._lock:
            if self._session is not None:
                self._session.close()
