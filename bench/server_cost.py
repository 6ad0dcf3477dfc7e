"""The HTTP server's cost per request, and what replacing its hand-written request parser with h11 would change.

- `parse`: microseconds to read one request head from bytes, the hand-written parser (`head_end` + `parse_head`)
  against h11 0.14 (Debian 12's python3-h11) reading the same bytes: a fresh `h11.Connection` per request, and one
  connection cycling through pipelined requests as a server would (answer sent through h11, `start_next_cycle`).
- `served`: CPU of the server's `http` thread per request, 20 000 pipelined probes on 8 keep-alive connections
  (this checkout; with `MAINTD_BENCH_BEFORE=/path/to/checkout` also that tree, run the same way).
- `hostile`: the framing payloads of the hostile suites (smuggling, bare LF/CR, obs-fold, limits, malformed
  targets): which ones each parser refuses.

h11 is not a dependency: `pip install h11==0.14.0` into the venv to compare (skipped with a note otherwise).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from typing import Any

from bench.common import write
from tests.e2e.harness import CLEAN_ENV

PROBE = b"GET /probe HTTP/1.1\r\nHost: 10.0.0.4:8080\r\nUser-Agent: Load Balancer Agent\r\n\r\n"
PEER = (b"GET /v1/events/3D1B5E4F-0000-4000-8000-000000000000 HTTP/1.1\r\nHost: 10.0.0.5:8080\r\n"
        b"User-Agent: python-requests/2.28.1\r\nAccept-Encoding: gzip, deflate\r\nAccept: */*\r\n"
        b"Connection: keep-alive\r\nAuthorization: Bearer 0123456789abcdef0123456789abcdef\r\n\r\n")
HOSTILE = [
    b"POST /v1/drain HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    b"POST /v1/drain HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nContent-Length: 44\r\n\r\n",
    b"POST /v1/drain HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
    b"POST /v1/drain HTTP/1.1\r\nHost: x\r\nContent-Length: +4\r\n\r\n",
    b"POST /v1/drain HTTP/1.1\r\nHost: x\r\nContent-Length: 4, 4\r\n\r\n",
    b"POST /v1/drain HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    b"GET /probe HTTP/1.1\r\nX-A: 1\r\n Transfer-Encoding: chunked\r\n\r\n",
    b"GET /probe HTTP/1.1\r\nX-A: 1\nGET /v1/status HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET /probe HTTP/1.1\r\nX-A: 1\rHost: x\r\n\r\n",
    b"GET /probe HTTP/1.1\nHost: x\r\n\r\n",
    b"GET /probe HTTP/1.1\nHost: x\n\n",
    b"GET /probe HTTP/1.1\r\nHost : x\r\n\r\n",
    b"GET /probe HTTP/1.1\r\n" + b"X: a\r\n" * 101 + b"\r\n",
    b"GET /probe HTTP/1.1\r\nX: " + b"a" * 70_000 + b"\r\n\r\n",
    b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\n\r\n",
    b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
    b"GET /probe HTTP/2.0\r\n\r\n",
    b"GET /probe HTTP/1.1 \r\n\r\n",
    b"GET  /probe HTTP/1.1\r\n\r\n",
    b"GET http://[ HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET probe HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET /pro\x7fbe HTTP/1.1\r\nHost: x\r\n\r\n",
]


def hand_written(data: bytes) -> Any:
    from agent.http.http_wire import head_end, parse_head

    end = head_end(data)
    if end < 0:
        raise ValueError("incomplete: the server waits, then answers 408")
    return parse_head(data[:end], 65536)


def h11_fresh(data: bytes) -> Any:
    import h11

    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=64 * 1024)
    conn.receive_data(data)
    event = conn.next_event()
    if event is h11.NEED_DATA:
        raise ValueError("incomplete")
    return event


def h11_cycle() -> Callable[[bytes], Any]:
    """One h11 connection reading request after request, answering each through h11 as a server must."""
    import h11

    conn = h11.Connection(h11.SERVER)
    answer = h11.Response(status_code=200, headers=[("Content-Length", "3")])

    def one(data: bytes) -> Any:
        conn.receive_data(data)
        event = conn.next_event()
        conn.next_event()  # EndOfMessage
        conn.send(answer)
        conn.send(h11.Data(data=b"OK\n"))
        conn.send(h11.EndOfMessage())
        conn.start_next_cycle()
        return event

    return one


def per_call_us(fn: Callable[[bytes], Any], data: bytes, n: int) -> float:
    """Median of 5 blocks of microseconds per call."""
    blocks = []
    for _ in range(5):
        t0 = time.thread_time()
        for _ in range(n):
            fn(data)
        blocks.append((time.thread_time() - t0) / n * 1e6)
    return round(sorted(blocks)[2], 2)


def refuses(fn: Callable[[bytes], Any], data: bytes) -> bool:
    try:
        fn(data)
    except Exception:
        return True
    return False


SERVED = textwrap.dedent("""
    import json, socket, sys, time, threading
    from agent.http.routes import ApiServer
    from agent.telemetry.metrics import Metrics
    from tests.http.test_server import FakeBackend
    n, conns = int(sys.argv[1]), 8
    srv = ApiServer("127.0.0.1:0", FakeBackend(), Metrics(), max_body_bytes=65536)
    srv.serve_in_background()
    port = srv.socket.getsockname()[1]
    time.sleep(0.2)
    def cpu():
        with open(f"/proc/self/task/{srv.loop.native_id}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / 100
    def client(k):
        with socket.create_connection(("127.0.0.1", port)) as s:
            want = n // conns
            s.sendall(b"GET /probe HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n" * want)
            got = 0
            while got < want:
                got += s.recv(1 << 20).count(b"HTTP/1.1 200")
    before = cpu()
    threads = [threading.Thread(target=client, args=(k,)) for k in range(conns)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    print(json.dumps({"us_per_request": round((cpu() - before) / n * 1e6, 1)}))
    srv.close()
""")


def served(tree: str, n: int) -> float:
    """CPU microseconds of the `http` thread per pipelined probe, the server from `tree` (median of 3)."""
    runs = []
    for _ in range(3):
        done = subprocess.run([sys.executable, "-c", SERVED, str(n)], capture_output=True, text=True, timeout=120,
                              env={**CLEAN_ENV, "PYTHONPATH": f"{tree}:{os.getcwd()}"}, cwd=tree)
        runs.append(json.loads(done.stdout)["us_per_request"])
    return sorted(runs)[1]


def run(quick: bool = False) -> dict[str, Any]:
    n = 2000 if quick else 20000
    try:
        import h11
        version: str | None = h11.__version__
    except ImportError:
        version = None
    figures: dict[str, Any] = {"h11": version}
    parse = {"hand_written": {"probe": per_call_us(hand_written, PROBE, n), "peer": per_call_us(hand_written, PEER, n)}}
    if version:
        parse["h11_fresh_connection"] = {"probe": per_call_us(h11_fresh, PROBE, n),
                                         "peer": per_call_us(h11_fresh, PEER, n)}
        parse["h11_pipelined_cycle"] = {"probe": per_call_us(h11_cycle(), PROBE, n),
                                        "peer": per_call_us(h11_cycle(), PEER, n)}
        figures["hostile"] = {"payloads": len(HOSTILE),
                              "hand_written_refuses": sum(refuses(hand_written, p) for p in HOSTILE),
                              "h11_refuses": sum(refuses(h11_fresh, p) for p in HOSTILE),
                              "h11_accepts": [p[:60].decode("latin-1") for p in HOSTILE
                                              if refuses(hand_written, p) and not refuses(h11_fresh, p)]}
    figures["parse_us"] = parse
    figures["served_us_per_request"] = {"this checkout": served(os.getcwd(), n)}
    before = os.environ.get("MAINTD_BENCH_BEFORE")
    if before:
        figures["served_us_per_request"]["before"] = served(before, n)
    hw = parse["hand_written"]
    checks = [("parse one head, hand-written: probe / peer ask", f"{hw['probe']} / {hw['peer']} us", "reported", True),
              ("server CPU per pipelined probe (http thread)",
               " / ".join(f"{k}: {v} us" for k, v in figures["served_us_per_request"].items()), "reported", True)]
    if version:
        cyc, hostile = parse["h11_pipelined_cycle"], figures["hostile"]
        checks += [(f"parse one head, h11 {version} (pipelined cycle): probe / peer ask",
                    f"{cyc['probe']} / {cyc['peer']} us", "reported", True),
                   ("hostile framing payloads refused: hand-written / h11",
                    f"{hostile['hand_written_refuses']} / {hostile['h11_refuses']} of {hostile['payloads']}",
                    "reported", True)]
    return write("server_cost", figures, checks, quick)
