"""The VM's managed-identity token for the store: an azure-core `TokenCredential` over maintd's IMDS client.

Why not `azure-identity`: its `ManagedIdentityCredential` brings msal and its own HTTP stack (about
5 MB more RSS, measured in shared/research/azure-storage.md), and its requests would be one more
path to IMDS to keep off the proxy. maintd already has one: the IMDS client opens its sockets
straight to the endpoint (no proxy variable is ever read), bounds every answer and retries nothing
behind the caller's back. This module only asks it for a token, parses the answer, caches the
token and refreshes it before it expires: `REFRESH_BEFORE` ahead, or at half its lifetime for a
short one. A failed refresh keeps the cached token while it is still valid.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from azure.core.credentials import AccessToken
from azure.core.exceptions import ClientAuthenticationError

from agent.coordination.store.store_protocol import Fetch
from agent.errors import MaintdError
from agent.trust import jsonsafe

STORAGE_RESOURCE = "https://storage.azure.com/"
REFRESH_BEFORE = 300.0
"""Seconds before expiry a token is replaced (azure-core's own policy asks again 300 s ahead)."""
MAX_TOKEN_BYTES = 64 * 1024



@dataclass(frozen=True)
class Token:
    value: str
    expires_on: int
    issued_at: float


def resource_for(scope: str) -> str:
    """The IMDS `resource` for an azure-core scope: https://storage.azure.com/.default -> https://storage.azure.com/."""
    return scope[: -len(".default")] if scope.endswith(".default") else scope


def parse_token(body: bytes, now: float) -> Token:
    """The token in an IMDS identity answer; ValueError when it is not one."""
    data = jsonsafe.loads(body, max_bytes=MAX_TOKEN_BYTES)
    if not isinstance(data, dict):
        raise ValueError("the answer is not a JSON object")
    value, expires = data.get("access_token"), data.get("expires_on")
    if not isinstance(value, str) or not value or any(c in value for c in "\r\n \t"):
        raise ValueError("no usable access_token in the answer")
    if isinstance(expires, str) and expires.isdigit():
        expires = int(expires)
    if not isinstance(expires, int) or isinstance(expires, bool) or expires <= now:
        raise ValueError(f"expires_on {str(expires)[:32]!r} is not a time in the future")
    return Token(value, expires, now)


def refresh_due(token: Token | None, now: float) -> bool:
    """Whether to ask for a new token: none yet, or fewer than REFRESH_BEFORE seconds (or half its life) left."""
    if token is None:
        return True
    margin = min(REFRESH_BEFORE, (token.expires_on - token.issued_at) / 2)
    return token.expires_on - now <= margin


class ManagedIdentityCredential:
    """A token credential for the store: one cached token per resource, refreshed ahead of expiry; thread-safe."""

    def __init__(self, fetch: Fetch, client_id: str | None, wall: Callable[[], float]) -> None:
        self.fetch = fetch
        self.client_id = client_id
        self.wall = wall
        self._tokens: dict[str, Token] = {}
        self._lock = threading.Lock()

    def get_token(self, *scopes: str, **_: Any) -> AccessToken:
        """azure-core's TokenCredential protocol: raises ClientAuthenticationError when no token can be had."""
        if len(scopes) != 1:
            raise ClientAuthenticationError(message=f"one scope expected, got {len(scopes)}")
        resource = resource_for(scopes[0])
        with self._lock:
            token, now = self._tokens.get(resource), self.wall()
            if refresh_due(token, now):
                try:
                    token = self._tokens[resource] = parse_token(self.fetch(resource, self.client_id), now)
                except (MaintdError, ValueError, OSError) as exc:
                    if token is None or token.expires_on <= now:
                        raise ClientAuthenticationError(
                            message=f"managed identity token from IMDS: {str(exc)[:300]}") from None
            assert token is not None
            return AccessToken(token.value, token.expires_on)

    def close(self) -> None:
        """Nothing to release (the IMDS client belongs to the daemon)."""
