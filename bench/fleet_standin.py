"""`python -m bench.fleet_standin`: one process that answers for many simulated maintd peers.

Each simulated peer has its own base URL, `http://127.0.0.1:PORT/{src}/p/{vm}`, where `src` names
the real agent that was given that URL (so requests are counted per asking agent). A peer answers
`GET {base}/v1/events/{id}` as maintd does (`vm_name`, `ready`, `names_self`, and `rank`, its place in
the event's Resources, without which a maintd leader does not count its `ready`) and accepts
`POST {base}/v1/events/{id}/peer-ready`. When a simulated peer turns ready it pushes
`POST {leader}/v1/events/{id}/peer-ready {"vm": name}` to the acting leader, as a real follower
would: the first of the event's `leaders` that accepts the connection.

Control, for the benchmark only: `POST /admin/event {"event_id", "ready_in": {vm: seconds},
"leaders": [base URL, ...], "resources": [vm, ...]}` schedules the peers' readiness;
`GET /admin/stats?event_id=ID` returns the counts. Prints `{"event": "standin.ready", "port": PORT}`
on stdout once it listens; runs until SIGTERM. Stdlib asyncio with keep-alive HTTP/1.1: one thread
serves thousands of requests a second.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

MAX_HEAD = 16 * 1024


@dataclass
class SimEvent:
    """One event's simulated peers: when each turned ready, and who asked what."""

    leaders: list[str]
    resources: list[str] = field(default_factory=list)
    """The event's Resources in IMDS order (a peer's rank is its place here)."""
    ready_wall: dict[str, float] = field(default_factory=dict)
    """vm -> wall-clock time it turned ready (absent while not ready)."""
    asks: Counter[str] = field(default_factory=Counter)
    """src -> GETs received."""
    asks_after_ready: Counter[str] = field(default_factory=Counter)
    """src -> GETs for a peer that had already answered that src `ready` (wasted)."""
    answered_ready: set[tuple[str, str]] = field(default_factory=set)
    per_peer: Counter[str] = field(default_factory=Counter)
    """vm -> GETs received (all sources)."""
    hints_received: Counter[str] = field(default_factory=Counter)
    pushes: Counter[str] = field(default_factory=Counter)
    """outcome ('ok', 'failed') -> pushes sent to the acting leader."""
    scheduled: int = 0


class Standin:
    """The simulated peers' state and the admin operations."""

    def __init__(self) -> None:
        self.events: dict[str, SimEvent] = {}
        self.unknown = 0
        self.by_src: Counter[str] = Counter()
        """src -> every request to a simulated peer, whatever its path or event (from start)."""
        self._pushing: set[asyncio.Task[None]] = set()
        """Pushes under way (the loop keeps only weak references to tasks)."""

    def schedule(self, loop: asyncio.AbstractEventLoop, body: dict[str, Any]) -> dict[str, Any]:
        event = self.events.setdefault(str(body["event_id"]), SimEvent(leaders=list(body.get("leaders", []))))
        event.leaders = list(body.get("leaders", event.leaders))
        event.resources = [str(r) for r in body.get("resources", event.resources)]
        for vm, delay in dict(body["ready_in"]).items():
            loop.call_later(max(0.0, float(delay)), self._turn_ready, loop, str(body["event_id"]), vm)
            event.scheduled += 1
        return {"scheduled": event.scheduled}

    def _turn_ready(self, loop: asyncio.AbstractEventLoop, event_id: str, vm: str) -> None:
        event = self.events[event_id]
        event.ready_wall[vm] = time.time()
        task = loop.create_task(self._push(event, event_id, vm))
        self._pushing.add(task)
        task.add_done_callback(self._pushing.discard)

    async def _push(self, event: SimEvent, event_id: str, vm: str) -> None:
        """Tell the acting leader: the first leader that takes the connection (a dead one refuses it)."""
        body = json.dumps({"vm": vm}).encode()
        for base in event.leaders:
            parts = urlsplit(base)
            try:
                reader, writer = await asyncio.wait_for(
                    asyncio.open_connection(parts.hostname, parts.port or 80), timeout=2)
            except (TimeoutError, OSError):
                continue
            try:
                writer.write(f"POST {parts.path.rstrip('/')}/v1/events/{event_id}/peer-ready HTTP/1.1\r\n"
                             f"Host: {parts.netloc}\r\nContent-Type: application/json\r\n"
                             f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
                await writer.drain()
                status = (await asyncio.wait_for(reader.readline(), timeout=2)).split(b" ")[1:2]
                event.pushes["ok" if status and status[0].startswith(b"2") else "failed"] += 1
            except (TimeoutError, OSError, IndexError):
                event.pushes["failed"] += 1
            finally:
                writer.close()
            return
        event.pushes["failed"] += 1

    def stats(self, event_id: str) -> dict[str, Any]:
        event = self.events.get(event_id)
        totals = {"requests_by_src": dict(self.by_src), "unknown_requests": self.unknown}
        if event is None:
            return {"event_id": event_id, "known": False, **totals}
        counts = sorted(event.per_peer.values())
        return {"event_id": event_id, "known": True, **totals, "scheduled": event.scheduled,
                "ready": len(event.ready_wall), "last_ready_wall": max(event.ready_wall.values(), default=None),
                "asks": dict(event.asks), "asks_after_ready": dict(event.asks_after_ready),
                "hints_received": dict(event.hints_received), "pushes": dict(event.pushes),
                "asks_per_peer_max": counts[-1] if counts else 0,
                "asks_per_peer_median": counts[len(counts) // 2] if counts else 0}

    def peer(self, method: str, src: str, vm: str, rest: list[str]) -> tuple[int, dict[str, Any]]:
        """A simulated peer's answer to `{method} /{src}/p/{vm}/{rest...}`."""
        self.by_src[src] += 1
        if len(rest) < 3 or rest[:2] != ["v1", "events"]:
            return 404, {"error": "no such endpoint"}
        event = self.events.get(rest[2])
        if event is None:
            self.unknown += 1
            return 404, {"error": f"no current event {rest[2]}"}
        if method == "POST" and rest[3:] == ["peer-ready"]:
            event.hints_received[src] += 1
            return 200, {"event_id": rest[2], "asked_again": False}
        if method != "GET" or len(rest) != 3:
            return 405, {"error": "method not allowed"}
        event.asks[src] += 1
        event.per_peer[vm] += 1
        ready = vm in event.ready_wall
        if (src, vm) in event.answered_ready:
            event.asks_after_ready[src] += 1
        elif ready:
            event.answered_ready.add((src, vm))
        rank = next((i for i, r in enumerate(event.resources) if r.casefold() == vm.casefold()), None)
        return 200, {"vm_name": vm, "event_id": rest[2], "present": True, "ready": ready,
                     "names_self": rank is not None, "rank": rank}


class HttpProtocol(asyncio.Protocol):
    """Minimal keep-alive HTTP/1.1: request line, headers, Content-Length body; pipelining allowed."""

    def __init__(self, standin: Standin, loop: asyncio.AbstractEventLoop) -> None:
        self.standin = standin
        self.loop = loop
        self.buffer = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while True:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(self.buffer) > MAX_HEAD and self.transport is not None:
                    self.transport.close()
                return
            head = self.buffer[:end].decode("latin-1").split("\r\n")
            length = 0
            close = False
            for line in head[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value.strip() or 0)
                elif name.strip().lower() == "connection" and value.strip().lower() == "close":
                    close = True
            if len(self.buffer) < end + 4 + length:
                return
            body = self.buffer[end + 4:end + 4 + length]
            self.buffer = self.buffer[end + 4 + length:]
            method, target = (head[0].split(" ") + ["", ""])[:2]
            status, answer = self._handle(method, target, body)
            payload = json.dumps(answer).encode()
            assert self.transport is not None
            self.transport.write(f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\n"
                                 f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
            if close:
                self.transport.close()
                return

    def _handle(self, method: str, target: str, body: bytes) -> tuple[int, dict[str, Any]]:
        url = urlsplit(target)
        parts = [unquote(p) for p in url.path.strip("/").split("/")]
        try:
            if parts[:2] == ["admin", "event"] and method == "POST":
                return 200, self.standin.schedule(self.loop, json.loads(body))
            if parts[:2] == ["admin", "stats"] and method == "GET":
                return 200, self.standin.stats(parse_qs(url.query).get("event_id", [""])[0])
        except (ValueError, KeyError, TypeError) as exc:
            return 400, {"error": str(exc)}
        if len(parts) >= 3 and parts[1] == "p":
            return self.standin.peer(method, parts[0], parts[2], parts[3:])
        return 404, {"error": "no such endpoint"}


async def serve(host: str, port: int) -> None:
    loop = asyncio.get_running_loop()
    standin = Standin()
    server = await loop.create_server(lambda: HttpProtocol(standin, loop), host, port, backlog=1024)
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    print(json.dumps({"event": "standin.ready", "port": server.sockets[0].getsockname()[1]}), flush=True)
    await stop.wait()
    server.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.fleet_standin", description=__doc__.split("\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    args = p.parse_args(argv)
    asyncio.run(serve(args.host, args.port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
