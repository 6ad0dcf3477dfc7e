"""Fuzzing the edges that take outside input: the config loader and the HTTP server.

(The event document parser and the tracker are fuzzed in test_events.py and test_tracker.py.)
"""

from __future__ import annotations

import socket

import requests
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.config.config import loads
from agent.errors import ConfigError
from agent.http.routes import ApiServer
from agent.telemetry.metrics import Metrics
from tests.http.test_server import FakeBackend

SECTIONS = ["imds", "identity", "state", "log", "server", "probe", "health", "coordination", "handlers",
            "profiles", "gates", "dry_run", "health_rules"]
KEYS = ["endpoint", "poll_interval", "name", "dir", "listen", "type", "phases", "command", "approval",
        "recurrence", "frequency", "schedule", "hours", "fixed_date", "start", "end", "fleet", "lb_timeout",
        "max_percent_unhealthy", "rules", "event_types", "timeout", "url", "metric"]
scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6), st.floats(allow_nan=True),
                    st.text(max_size=20), st.sampled_from(["1s", "PT1M", "500ms", "auto", "exec", "drain",
                                                           "scheduled", "day", "-1", "0.0.0.0:8088"]))
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.sampled_from(KEYS), inner, max_size=4)), max_leaves=20)
documents = st.dictionaries(st.sampled_from(SECTIONS), values, max_size=5)


@settings(max_examples=300, deadline=None)
@given(documents)
def test_any_structure_is_a_config_or_a_config_error_with_a_message(doc):
    text = yaml.safe_dump(doc, allow_unicode=True)
    try:
        loads(text, "fuzz.yaml")
    except ConfigError as exc:
        assert str(exc).startswith("fuzz.yaml") and exc.message


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=300))
def test_any_text_is_a_config_or_a_config_error(text):
    try:
        loads(text, "fuzz.yaml")
    except ConfigError as exc:
        assert exc.message


def _raw(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        chunks = []
        try:
            while chunk := s.recv(65536):
                chunks.append(chunk)
        except (TimeoutError, ConnectionResetError):
            pass
        return b"".join(chunks)


methods = st.sampled_from([b"GET", b"POST", b"PUT", b"DELETE", b"HEAD", b"BREW", b""])
paths = st.one_of(st.sampled_from([b"/probe", b"/v1/events/E1", b"/v1/health/reports", b"/v1/drain",
                                   b"/v1/events/%00/approve", b"/metrics", b"//", b"*"]),
                  st.binary(max_size=40))
headers = st.lists(st.tuples(st.sampled_from([b"Content-Length", b"Authorization", b"Host", b"X"]),
                             st.binary(max_size=30)), max_size=4)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(methods, paths, headers, st.binary(max_size=200))
def test_any_request_gets_an_http_answer_and_the_server_stays_up(method, path, hdrs, body):
    server = _SERVER
    port = server.socket.getsockname()[1]
    head = method + b" " + path + b" HTTP/1.1\r\n" + b"".join(k + b": " + v + b"\r\n" for k, v in hdrs)
    answer = _raw(port, head + b"\r\n" + body)
    # A two-word request line is HTTP/0.9, whose answers have no status line: then the JSON error alone.
    assert answer == b"" or answer.startswith(b"HTTP/1.") or answer.startswith(b'{"error"'), answer[:80]
    s = requests.Session()
    s.trust_env = False
    assert s.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200


_SERVER = ApiServer("127.0.0.1:0", FakeBackend(), Metrics(), token_reader=lambda: "t", max_body_bytes=2048,
                    read_timeout=0.3)
_SERVER.serve_in_background()
