"""The soak's long form: one agent polling every 5 ms for 100,000 polls with events coming and going, after a
warm-up to a steady event population (100 s: the 60 s retention and its pruning, 20 s notices); RSS, file
descriptors and threads must not grow (tests/soak.py: the same run and checks as the suite's short form,
tests/faults/test_soak.py, which warms up only until each kind of event has come and gone once).

`python -m bench soak` writes bench/results/soak.json (about ten minutes); `--quick` measures 6,000 polls.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from bench.common import write
from tests.e2e.harness import Agent, Emulator
from tests.soak import AGENT_CONFIG, EMULATOR_ARGS, LONG_NOTICES, Footprint, soak


def run(quick: bool = False) -> dict[str, Any]:
    polls = 6_000 if quick else 100_000
    with tempfile.TemporaryDirectory() as tmp:
        emu = Emulator(["vm-1", "vm-2"], *EMULATOR_ARGS)
        agent = None
        try:
            agent = Agent(Path(tmp) / "vm-1", emu.urls["vm-1"], "vm-1", AGENT_CONFIG)

            def show(s: Footprint) -> None:
                print(f"  {s.polls} polls: RSS {s.rss_mb:.1f} MB, fds {s.fds}, threads {s.threads}, "
                      f"live events {s.live_events}", flush=True)

            result = soak(emu, agent, polls, LONG_NOTICES, steady=True, on_sample=show)
            healthy = agent.get("/healthz").status_code == 200
        finally:
            if agent is not None:
                agent.stop()
            emu.stop()
    print(f"  {result.line()}", flush=True)
    checks = [*result.checks(), ("/healthz after the soak", "200" if healthy else "not 200", "200", healthy)]
    return write("soak", result.figures(), checks, quick)
