"""A hostile IMDS against a real `maintd run`: random and adversarial bytes, deep JSON, floods, trickles.

The IMDS here is a raw loopback server (tests/imds_server.py), not the emulator, so it can say
anything at all on the wire. Whatever it says, maintd stays up, `/healthz` answers, the failures
show in `/v1/health` and the metrics, what it knew is kept, and it catches up once IMDS behaves.
"""

from __future__ import annotations

import json
import random
import re
import time

import pytest

from tests.e2e.harness import Agent, wait_until
from tests.imds_server import JSON, FakeImds, Raw

pytestmark = pytest.mark.e2e

SE = "/metadata/scheduledevents"
EVENT = {"EventId": "E1", "EventType": "Reboot", "ResourceType": "VirtualMachine", "Resources": ["vm-1"],
         "EventStatus": "Scheduled", "NotBefore": "Mon, 19 Sep 2050 18:29:47 GMT", "Description": "",
         "EventSource": "Platform", "DurationInSeconds": -1}
GOOD = json.dumps({"DocumentIncarnation": 1, "Events": [EVENT]}).encode()


def http_answer(body: bytes, status: int = 200, headers: bytes = b"Content-Type: application/json\r\n") -> bytes:
    return b"HTTP/1.1 %d X\r\n%sContent-Length: %d\r\n\r\n%s" % (status, headers, len(body), body)


def hostile(rng: random.Random) -> list[Raw]:
    """One of each kind of bad answer, their contents drawn from `rng`."""
    noise = rng.randbytes(rng.randrange(1, 4096))
    deep = rng.randrange(1_000, 200_000)
    return [
        Raw(noise),                                                          # not HTTP at all
        Raw(http_answer(noise)),                                             # HTTP, body random bytes
        Raw(http_answer(b'{"Events": ' + b"[" * deep + b"]" * deep + b"}")),  # nesting a parser dies of
        Raw(http_answer(b'{"Events": [' + b"{" * deep)),                      # deep and cut
        Raw(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 99999999999\r\n\r\n{"),
        Raw(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n" + b" " * (6 << 20)),  # flood until close
        Raw(b"HTTP/1.1 200 OK\r\n" + b"X-" + noise.hex().encode() + b": y\r\n" * 300 + b"\r\n"),
        Raw(http_answer(GOOD), trickle=0.05),                                # good bytes, far too slowly
        Raw(http_answer(GOOD)[:rng.randrange(1, len(GOOD))], then="reset"),  # cut by a reset
        Raw(http_answer(json.dumps({"Events": [rng.choice([None, 1, "x", [], {}, True])] * 20_000}).encode())),
        Raw(http_answer(json.dumps({"DocumentIncarnation": {"a": [1]}, "Events": {"E1": EVENT}}).encode())),
        Raw(http_answer(b"\xef\xbb\xbf" + GOOD[:-2] + b"\xff\xfe]}")),     # a BOM and bytes that are not UTF-8
    ]


def counter(agent: Agent, name: str, labels: str = "") -> float:
    m = re.search(rf"^{name}{re.escape(labels)} (\S+)$", agent.get("/metrics").text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


def imds_health(agent: Agent) -> dict[str, str]:
    return {e["Property"]: e["HealthState"] for e in agent.get("/v1/health").json()["HealthEvents"]
            if e["SourceId"] == "imds"}


@pytest.fixture
def imds():
    server = FakeImds()
    yield server
    server.close()


@pytest.mark.parametrize("seed", [1, 2])
def test_maintd_outlives_a_hostile_imds_reports_it_and_catches_up(imds, tmp_path, seed):
    """Every kind of bad answer, twice over, in a random order: maintd never exits, /healthz stays 200,
    /v1/health and the metrics show IMDS failing, the tracked event is kept (no bad answer reads as
    "every event vanished"), and the first good answer after it all is read."""
    rng = random.Random(seed)
    answers = hostile(rng) + hostile(rng)
    rng.shuffle(answers)
    imds.add_callback("GET", SE, lambda call: (200, {"Content-Type": JSON}, GOOD))
    for raw in answers:
        imds.add_callback("GET", SE, lambda call, raw=raw: raw)
    imds.add_callback("GET", SE, lambda call: (200, {"Content-Type": JSON}, GOOD))
    agent = Agent(tmp_path / "vm-1", imds.url, "vm-1", {"imds": {"timeout": "1s", "warn_after_failures": 2}})
    try:
        bad_seen = wait_until(lambda: imds_health(agent).get("poll") in ("Warning", "Error"), 30,
                              f"imds/poll health to show the failures (seed {seed})")
        assert bad_seen and agent.get("/healthz").status_code == 200
        wait_until(lambda: len(imds.calls) > len(answers) + 1, 60, f"every hostile answer served (seed {seed})")
        assert agent.proc.poll() is None, f"maintd exited (seed {seed}): " + "".join(agent.raw[-5:])
        assert agent.get("/healthz").status_code == 200
        assert counter(agent, "maintd_imds_requests_total", '{code="error",endpoint="scheduledevents"}') >= 5
        assert counter(agent, "maintd_documents_malformed_total") >= 5
        agent.wait_log("poll.recovered", timeout=15)
        wait_until(lambda: imds_health(agent).get("poll") == "Ok", 10, "imds/poll Ok again")
        assert not agent.events("event.canceled") and not agent.events("event.completed")
        assert "E1" in agent.state()["events"], "the event known before the storm is still tracked"
    finally:
        assert agent.stop() == 0, "".join(agent.raw[-5:])


def test_a_huge_description_never_becomes_huge_logs_or_state(imds, tmp_path):
    """A 3 MB Description (under the 4 MiB body cap) is cut at parse time: logs and state stay small."""
    doc = {"DocumentIncarnation": 1, "Events": [{**EVENT, "Description": "d" * 3_000_000 + "\x00"}]}
    imds.get(SE, json=doc)
    agent = Agent(tmp_path / "vm-1", imds.url, "vm-1")
    try:
        agent.wait_log("event.appeared", event_id="E1")
        time.sleep(0.5)  # a few more polls and a state write
        assert max(len(line) for line in agent.raw) < 64 * 1024
        assert (agent.workdir / "state" / "state.json").stat().st_size < 64 * 1024
        assert agent.get("/v1/events/E1").status_code in (200, 401, 403)
        assert len(agent.get("/v1/events").content) < 64 * 1024
    finally:
        agent.stop()


@pytest.mark.parametrize("body", [b"[" * 100_000 + b"]" * 100_000, b'{"name": ' + b"[" * 50_000, b"\xff" * 10])
def test_compute_metadata_that_cannot_be_read_is_an_identity_error_not_an_exit(imds, tmp_path, body):
    """With identity.name auto, a compute answer that kills a parser leaves maintd up, saying why."""
    imds.add_callback("GET", "/metadata/instance/compute", lambda call: (200, {"Content-Type": JSON}, body))
    imds.get(SE, json={"DocumentIncarnation": 1, "Events": []})
    agent = Agent(tmp_path / "vm-1", imds.url, "auto")
    try:
        wait_until(lambda: imds_health(agent).get("identity") == "Error", 20, "imds/identity Error")
        assert agent.proc.poll() is None and agent.get("/healthz").status_code == 200
    finally:
        assert agent.stop() == 0


def test_sigterm_during_a_stalled_poll_stops_maintd_at_once(imds, tmp_path):
    """A poll stuck on an IMDS that answers nothing (60 s timeout) does not hold up a SIGTERM."""
    imds.get(SE, json={"DocumentIncarnation": 1, "Events": []})
    imds.add_callback("GET", SE, lambda call: Raw(b"HTTP/1.1 200 OK\r\n", trickle=60))
    agent = Agent(tmp_path / "vm-1", imds.url, "vm-1", {"imds": {"timeout": "60s", "first_timeout": "60s"}})
    try:
        wait_until(lambda: len(imds.calls) >= 2, 10, "a poll under way on the stalled answer")
        time.sleep(0.2)
        started = time.monotonic()
        assert agent.stop() == 0
        assert time.monotonic() - started < 5, "stopped without waiting for the poll's timeout"
        agent.wait_log("daemon.stopped", timeout=5)  # it has exited: its last lines are being read
    finally:
        agent.stop()  # a no-op once it has stopped
