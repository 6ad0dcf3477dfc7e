"""The managed-identity path: the emulator's IMDS token endpoint, and Azurite over HTTPS accepting its tokens."""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

import tests.needs_azure  # noqa: F401 - skips this module without the azure extra
from agent.clock import FakeClock, SystemClock
from agent.coordination.store.blob_store import BlobStore, Settings
from agent.coordination.store.identity_token import ManagedIdentityCredential
from agent.coordination.store.store_protocol import READY, StoreError, event_folder, marker_blob, marker_record
from agent.emulator import Emulator
from agent.imds.imds_client import ImdsClient
from agent.telemetry.metrics import Metrics
from tests.azurite import start

TOKEN_PATH = "/metadata/identity/oauth2/token"
EVENT = "5F1E2B0C-9A4D-4C61-8E2F-1A2B3C4D5E6F"


@pytest.fixture
def imds(clock: FakeClock) -> Iterator[tuple[Emulator, str]]:
    emu = Emulator(["web_3f2a9c1b"], clock=clock, rate_limit=None)
    urls = emu.start()
    yield emu, urls["web_3f2a9c1b"]
    emu.stop()


def ask(base: str, **params: str) -> requests.Response:
    with requests.Session() as s:
        s.trust_env = False
        return s.get(base + TOKEN_PATH, params={"api-version": "2018-02-01", **params},
                     headers={"Metadata": "true"}, timeout=5)


def claims(token: str) -> dict[str, Any]:
    payload = token.split(".")[1]
    return json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))


def test_the_emulator_answers_a_token_request_as_imds_does(imds: tuple[Emulator, str]) -> None:
    """A token for the storage resource: IMDS's fields, a JWT whose issuer, audience and lifetime a storage
    service checks, for the user-assigned identity asked for; no resource: 400 invalid_request."""
    _, base = imds
    answer = ask(base, resource="https://storage.azure.com/")
    assert answer.status_code == 200
    body = answer.json()
    assert body["token_type"] == "Bearer" and body["resource"] == "https://storage.azure.com/"
    c = claims(body["access_token"])
    assert c["iss"].startswith("https://sts.windows.net/") and c["aud"] == "https://storage.azure.com"
    assert c["nbf"] <= time.time() < c["exp"] == int(body["expires_on"])
    assert ask(base).json()["error"] == "invalid_request"
    user_assigned = ask(base, resource="https://storage.azure.com/", client_id="c1").json()
    assert claims(user_assigned["access_token"])["appid"] == "c1"


def test_azurite_in_oauth_mode_takes_the_emulators_token(imds: tuple[Emulator, str], tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole managed-identity path against HTTPS Azurite (self-signed certificate): maintd's IMDS client
    fetches the token, Azurite accepts it; a VM with no identity (IMDS 400) gets `token_failed`, never an
    approval on a guess."""
    emu, base = imds
    server = start(tmp_path, oauth=True)
    try:
        monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(server.cert))
        container = server.new_container()

        imds_client = ImdsClient(base, "2020-07-01", timeout=5, first_timeout=5, compute_api_version="2021-02-01",
                                 clock=SystemClock(), metrics=Metrics())
        fetch = imds_client.identity_token
        credential = ManagedIdentityCredential(fetch, None, time.time)
        store = BlobStore.open(Settings(server.url, container, credential=credential), lambda op, outcome: None)
        store.put(marker_blob(EVENT, "web_3f2a9c1b"), marker_record(EVENT, "web_3f2a9c1b", READY))
        items, _ = store.list_folder(event_folder(EVENT))
        assert [i.metadata["vm"] for i in items] == ["web_3f2a9c1b"]

        emu.add_fault(path=TOKEN_PATH, status=400)
        orphan = BlobStore.open(Settings(server.url, container, credential=ManagedIdentityCredential(
            fetch, None, time.time)), lambda op, outcome: None)
        with pytest.raises(StoreError) as caught:
            orphan.list_folder(event_folder(EVENT))
        assert caught.value.outcome == "token_failed" and "400" in str(caught.value)
    finally:
        server.stop()
