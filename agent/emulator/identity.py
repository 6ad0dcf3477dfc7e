"""IMDS's managed-identity token endpoint, as the emulator serves it (`/metadata/identity/oauth2/token`).

The answer has IMDS's shape (access_token, expires_on as a string of epoch seconds, resource,
token_type, ...) and the token is a JWT whose claims a storage service checks — issuer
(sts.windows.net), audience (the resource), nbf/iat/exp on the real wall clock (it goes to a real
service such as Azurite, not to emulated time) — with a signature nobody can verify: Azurite's
`--oauth basic` checks claims only. Every VM has a system-assigned identity and any user-assigned
one asked for by `client_id`; a VM without one (IMDS's 400) or a failing endpoint is a fault
injected on this path (`add_fault(path=IDENTITY_PATH, status=400)`). A request without `resource`
is IMDS's 400 `invalid_request`.
"""

from __future__ import annotations

import base64
import json
import time
import uuid
from typing import TypedDict

IDENTITY_PATH = "/metadata/identity/oauth2/token"
IDENTITY_VERSIONS = ("2018-02-01", "2019-03-11", "2019-06-01", "2019-08-01", "2019-08-15", "2019-11-01",
                     "2020-06-01", "2020-09-01", "2021-02-01", "2021-05-01", "2021-10-01", "2023-07-01")
TENANT = "72f988bf-86f1-41af-91ab-2d7cd011db47"
LIFETIME = 24 * 3600


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


class Token(TypedDict):
    """IMDS's answer with a token."""

    access_token: str
    client_id: str
    expires_in: str
    expires_on: str
    ext_expires_in: str
    not_before: str
    resource: str
    token_type: str


class TokenError(TypedDict):
    """IMDS's answer to a request it refuses."""

    error: str
    error_description: str


def token_answer(vm_id: str, params: dict[str, str], now: float | None = None) -> tuple[int, Token | TokenError]:
    """(status, JSON body) for one token request."""
    resource = params.get("resource")
    if not resource:
        return 400, {"error": "invalid_request", "error_description": "Required query variable 'resource' is missing"}
    client_id = params.get("client_id")
    issued = int(time.time() if now is None else now)
    oid = str(uuid.uuid5(uuid.NAMESPACE_URL, f"maintd-emulator-identity:{vm_id}:{client_id}"))
    claims = {"aud": resource.rstrip("/"), "iss": f"https://sts.windows.net/{TENANT}/", "iat": issued,
              "nbf": issued - 300, "exp": issued + LIFETIME, "oid": oid, "sub": oid, "tid": TENANT,
              "appid": client_id or oid}
    header = {"typ": "JWT", "alg": "RS256"}
    token = ".".join((_b64(json.dumps(header).encode()), _b64(json.dumps(claims).encode()), _b64(b"emulated")))
    return 200, {"access_token": token, "client_id": client_id or oid, "expires_in": str(LIFETIME),
                 "expires_on": str(issued + LIFETIME), "ext_expires_in": str(LIFETIME),
                 "not_before": str(issued - 300), "resource": resource, "token_type": "Bearer"}
