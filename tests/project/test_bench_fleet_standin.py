"""The fleet benchmark's stand-in answers as the simulated peers would (the bench's figures rest on it).

The benchmark itself is not run here: its quick mode takes over a minute of real processes.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from bench.fleet import Standin
from tests.e2e.harness import free_port, http, wait_until


class _Leader(BaseHTTPRequestHandler):
    pushes: list[tuple[str, Any]] = []

    def do_POST(self) -> None:  # http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _Leader.pushes.append((self.path, body))
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def leader() -> Iterator[str]:
    _Leader.pushes = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Leader)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture
def standin() -> Iterator[Standin]:
    s = Standin()
    yield s
    s.stop()


def test_simulated_peers_turn_ready_push_to_the_acting_leader_and_are_counted_per_asker(standin: Standin,
                                                                                        leader: str) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    standin.schedule("E1", {"vm-0002": 0.0, "vm-0003": 600.0}, [dead, leader],
                     ["vm-0000", "vm-0001", "vm-0002", "vm-0003"])
    client = http()

    def ask(src: str, vm: str) -> dict[str, Any]:
        return client.get(f"{standin.peer_url(src, vm)}/v1/events/E1", timeout=5).json()

    wait_until(lambda: _Leader.pushes, 10, "the push to the live leader")
    assert _Leader.pushes == [("/v1/events/E1/peer-ready", {"vm": "vm-0002"})]
    assert ask("L", "vm-0002")["ready"] is True
    seen = ask("F", "vm-0003")
    assert (seen["names_self"], seen["rank"]) == (True, 3), "named at its place in Resources, as maintd answers"
    assert ask("L", "vm-0003")["ready"] is False
    assert ask("F", "vm-0002")["ready"] is True
    assert client.get(f"{standin.peer_url('L', 'vm-0002')}/v1/events/OTHER", timeout=5).status_code == 404

    stats = standin.stats("E1")
    assert stats["asks"] == {"L": 2, "F": 2}
    assert stats["requests_by_src"] == {"L": 3, "F": 2}  # every request, whatever its event or path
    assert stats["ready"] == 1 and stats["last_ready_wall"] is not None
    assert stats["pushes"] == {"ok": 1}
