"""One authorization rule for every endpoint (issue 35 #5): every cell of `auth.TABLE` (kind x caller x token,
with and without coordination.token_file) asked of a real server, at every route of that kind, from each kind of
caller (the unix socket as root and as user nobody, 127.0.0.1 with and without require_token_on_loopback, and
127.0.0.2 playing another host). The README prints the same table (tests/project/test_docs.py keeps it equal)."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.cli import docgen
from agent.http.auth import TABLE, Kind, Source, Token, Verdict, peer_authorized, token_ok
from agent.http.routes import ApiServer
from agent.telemetry.metrics import Metrics

SERVER_TOKEN, PEER_TOKEN = "server-s3cret", "peer-s3cret"
SENT = {Token.NONE: None, Token.PEER: PEER_TOKEN, Token.SERVER: SERVER_TOKEN, Token.OTHER: "not-a-token"}
REQUESTS: dict[Kind, list[tuple[str, str, Any]]] = {
    Kind.OPEN: [("GET", "/probe", None), ("GET", "/app-health", None), ("GET", "/healthz", None),
                ("GET", "/metrics", None)],
    Kind.READ: [("GET", "/v1/status", None), ("GET", "/v1/events", None), ("GET", "/v1/fleet", None),
                ("GET", "/v1/fleet/history", None)],
    Kind.SHARED: [("GET", "/v1/events/E1", None), ("GET", "/v1/health", None)],
    Kind.CHANGE: [("POST", "/v1/drain", {"reason": "x"}), ("POST", "/v1/undrain", None),
                  ("POST", "/v1/events/E1/approve", None), ("POST", "/v1/health/reports", {"SourceId": "a"})],
    Kind.HINT: [("POST", "/v1/events/E1/peer-ready", {"vm": "vm2"}), ("POST", "/v1/budget/wake", {"vm": "vm1"})],
}
SECRET = "hook printed db_password=hunter2"
"""What only the full view holds (an operator's): in a hook's output and a health report's description."""
AS_NOBODY = textwrap.dedent("""
    import http.client, json, os, socket, sys
    os.setgid(65534)
    os.setuid(65534)
    out = []
    for method, path, headers, body in json.load(sys.stdin):
        conn = http.client.HTTPConnection("localhost", timeout=10)
        conn.sock = socket.socket(socket.AF_UNIX)
        conn.sock.connect(sys.argv[1])
        conn.request(method, path, body=body, headers=headers)
        answer = conn.getresponse()
        out.append([answer.status, answer.read().decode()])
        conn.close()
    json.dump(out, sys.stdout)
""")


class Daemon:
    """Canned answers for every route; changes and hints only say they were made."""

    def __init__(self, peer_token: str | None) -> None:
        self.peer_token = peer_token

    def probe(self) -> tuple[bool, str]: return True, "OK"
    def app_health(self) -> tuple[bool, str]: return True, "OK"
    def alive(self) -> tuple[bool, str]: return True, "ticking"
    def metrics_text(self) -> bytes: return b"maintd_up 1\n"
    def status(self) -> dict[str, Any]: return {"vm_name": "vm1", "note": SECRET}
    def fleet(self) -> dict[str, Any]: return {"events": [], "note": SECRET}
    def fleet_history(self, since: str | None) -> dict[str, Any]: return {"events": [], "note": SECRET}
    def events(self) -> list[dict[str, Any]]: return [{"EventId": "E1", "note": SECRET}]

    def event(self, event_id: str) -> dict[str, Any] | None:
        return {"EventId": event_id, "EventStatus": "Scheduled", "rank": 1, "ready": True,
                "results": [{"handler": "hook", "output": SECRET}]}

    def health(self) -> dict[str, Any]:
        return {"AggregatedHealthState": "Ok", "HealthEvents": [
            {"SourceId": "app", "Property": "db", "HealthState": "Ok", "Description": SECRET, "IsExpired": False}]}

    def drain(self, reason: str, by: str) -> dict[str, Any]: return {"drained": True}
    def undrain(self, by: str) -> dict[str, Any]: return {"undrained": True}
    def approve(self, event_id: str, by: str) -> dict[str, Any]: return {"manual_approval": True}
    def peer_ready(self, event_id: str, body: Any) -> dict[str, Any]: return {"asked_again": True}
    def budget_wake(self, body: Any) -> dict[str, Any]: return {"woken": True}
    def report_health(self, body: Any) -> dict[str, Any]: return {"accepted": True}

    def peer_authorized(self, authorization: str | None) -> bool:
        return peer_authorized(authorization, self.peer_token)


@pytest.fixture(scope="module")
def socket_dir() -> Iterator[Path]:
    """A directory user nobody may enter (not pytest's tmp_path, which is root's alone)."""
    path = Path(tempfile.mkdtemp(prefix="maintd-access-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _serve(socket_dir: Path, name: str, require: bool, peer_token: str | None) -> ApiServer:
    server = ApiServer("127.0.0.1:0", Daemon(peer_token), Metrics(), token_reader=lambda: SERVER_TOKEN,
                       require_token_on_loopback=require, unix_socket=str(socket_dir / name / "maintd.sock"))
    server.serve_in_background()
    os.chmod(socket_dir / name / "maintd.sock", 0o666)  # user nobody may connect: the server must refuse it itself
    return server


def _tcp(server: ApiServer, source: str, method: str, path: str, headers: dict[str, str],
         body: str | None) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", server.socket.getsockname()[1], timeout=10,
                                      source_address=(source, 0))
    try:
        conn.request(method, path, body=body, headers=headers)
        answer = conn.getresponse()
        return answer.status, answer.read().decode()
    finally:
        conn.close()


def _unix(server: ApiServer, method: str, path: str, headers: dict[str, str], body: str | None) -> tuple[int, str]:
    assert server.unix_socket is not None
    conn = http.client.HTTPConnection("localhost", timeout=10)
    conn.sock = socket.socket(socket.AF_UNIX)
    conn.sock.connect(server.unix_socket)
    try:
        conn.request(method, path, body=body, headers=headers)
        answer = conn.getresponse()
        return answer.status, answer.read().decode()
    finally:
        conn.close()


def _expected(kind: Kind, method: str, verdict: Verdict) -> tuple[int, bool | None]:
    """The status, and whether the operator's secret shows (None: not asked)."""
    if verdict == Verdict.UNAUTHORIZED:
        return 401, None
    if verdict == Verdict.FORBIDDEN:
        return 403, None
    status = 202 if kind == Kind.HINT else 200
    return status, (verdict == Verdict.FULL) if kind in (Kind.READ, Kind.SHARED) else None


def _check(answers: list[tuple[int, str]], cases: list[tuple[str, Kind, tuple[str, str, Any], Verdict]]) -> list[str]:
    wrong = []
    for (status, text), (where, kind, (method, path, _), verdict) in zip(answers, cases, strict=True):
        want, secret = _expected(kind, method, verdict)
        shown = SECRET in text
        if status != want or (secret is not None and shown != secret):
            wrong.append(f"{where} {method} {path}: {status}{' with the secret' if shown else ''}, the table says "
                         f"{verdict.value}")
        if status == 401 and "error" not in json.loads(text):
            wrong.append(f"{where} {method} {path}: a 401 without its reason")
    return wrong


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to call the unix socket as another user")
@pytest.mark.parametrize("peer_token", [PEER_TOKEN, None], ids=["coordination-token", "no-coordination-token"])
def test_every_cell_of_the_access_table_is_how_a_real_server_answers(socket_dir: Path, peer_token: str | None) -> None:
    guarded = peer_token is not None
    strict = _serve(socket_dir, f"strict-{guarded}", True, peer_token)
    trusting = _serve(socket_dir, f"trusting-{guarded}", False, peer_token)
    try:
        cases: list[tuple[str, Kind, tuple[str, str, Any], Verdict]] = []
        answers: list[tuple[int, str]] = []
        nobody: list[tuple[str, Kind, tuple[str, str, Any], Verdict]] = []
        nobody_requests = []
        for kind, rows in TABLE.items():
            for source, cells in rows.items():
                for token, cell in cells.items():
                    if token == Token.PEER and not guarded:
                        continue  # no coordination token is configured: "peer-s3cret" is just another token
                    verdict = cell.peers_guarded if guarded else cell.peers_open
                    headers = {"Authorization": f"Bearer {SENT[token]}"} if SENT[token] else {}
                    for request in REQUESTS[kind]:
                        method, path, body = request
                        data = json.dumps(body) if body is not None else None
                        if data:
                            headers = {**headers, "Content-Type": "application/json"}
                        where = f"{source.value} with {token.value}"
                        case = (where, kind, request, verdict)
                        if source == Source.SOCKET_OTHER:
                            nobody.append(case)
                            nobody_requests.append([method, path, headers, data])
                            continue
                        cases.append(case)
                        if source == Source.SOCKET:
                            answers.append(_unix(strict, method, path, headers, data))
                        elif source == Source.ELSEWHERE:
                            answers.append(_tcp(strict, "127.0.0.2", method, path, headers, data))
                        else:
                            server = strict if source == Source.LOOPBACK else trusting
                            answers.append(_tcp(server, "127.0.0.1", method, path, headers, data))
        done = subprocess.run([sys.executable, "-c", AS_NOBODY, str(strict.unix_socket)],
                              input=json.dumps(nobody_requests), capture_output=True, text=True, timeout=60, check=True)
        wrong = _check(answers, cases) + _check([tuple(a) for a in json.loads(done.stdout)], nobody)  # type: ignore[misc]
        assert not wrong, "\n".join(wrong)
        assert len(cases) + len(nobody) >= 200
    finally:
        strict.close()
        trusting.close()


def test_every_route_has_its_row_and_the_readme_prints_the_code_s_table() -> None:
    """No route is answered outside the table; the README's copy is the generated one (test_docs checks it too)."""
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert docgen.replace_in(text, "access-table", docgen.access_table()) == text
    table = docgen.access_table()
    for requests in REQUESTS.values():
        for method, path, _ in requests:
            shown = path.replace("E1", "{id}").removesuffix("")
            assert f"`{method} {shown}`" in table, path
    assert token_ok(f"Bearer {SERVER_TOKEN}", SERVER_TOKEN)
