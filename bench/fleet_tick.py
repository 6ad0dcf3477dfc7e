"""What one coordination pass costs the leader's loop thread at fleet size, in process.

The daemon calls `Coordinator.tick` on its loop thread after every poll and whenever a peer's
readiness changes (a push, an answer), so at 1000 VMs it runs tens of times a second while peers
turn ready. Here a leader's coordinator holds one event naming N VMs, every peer already asked and
not yet due again (the steady state of a long preparation: no request leaves the process), and the
pass is timed on the fake clock's frozen time: the per-tick work that does not depend on the network.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from agent.clock import FakeClock
from agent.coordination.coordination_rules import PeerState
from agent.coordination.coordination_settings import CoordinationConfig
from agent.coordination.coordinator import Coordinator
from agent.coordination.peers.peer_backend import EventPeers, PeerBackend
from agent.loop.tick import Tick
from agent.model.events import Event
from agent.model.tracker import Tracked
from agent.policy.approval_policy import Profile
from agent.state.state_store import Store
from agent.telemetry.metrics import Metrics

AUTO = Profile(name="default", approval="auto")


def tick_cost(n: int, ticks: int = 300, repeats: int = 5) -> dict[str, Any]:
    """Milliseconds per `tick` of a leader of `n` VMs waiting for all but two (best and median of `repeats`)."""
    clock = FakeClock()
    names = [f"vm-{i:04d}" for i in range(n)]
    event = Event("E1", "Reboot", "Scheduled", tuple(names), not_before=clock.now() + timedelta(minutes=15))
    tracked = {"E1": Tracked(event, True, clock.now(), "b", False)}
    with tempfile.TemporaryDirectory() as tmp:
        coord = Coordinator(CoordinationConfig(peer_url="http://{name}.invalid:8088"), approve=lambda ids: None,
                            store=Store(Path(tmp), clock), clock=clock, metrics=Metrics())
        try:
            backend = coord.backend
            assert isinstance(backend, PeerBackend)
            peers = backend._events.setdefault("E1", EventPeers()).exchange.peers
            now = clock.monotonic()
            for name in names[1:]:
                peers[name] = PeerState(last_asked=now, asks=6, last_ok=now, ready=name in names[-2:])
            runs = []
            for _ in range(repeats):
                start = time.perf_counter()
                for _ in range(ticks):
                    coord.tick(Tick.of(tracked, names[0], AUTO, False, lambda t: [],
                                       now=clock.now(), monotonic=clock.monotonic()))
                runs.append((time.perf_counter() - start) / ticks * 1000)
        finally:
            coord.stop()
    return {"n": n, "ms_per_tick_best": round(min(runs), 3), "ms_per_tick_median": round(statistics.median(runs), 3)}
