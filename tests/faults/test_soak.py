"""Soak, short form: many polls at a 5 ms interval with events coming and going; memory, fds and threads stay flat.

The agent warms up until every kind of event has come and gone once (notices of at most 3 s), then
`MAINTD_SOAK_POLLS` polls (default 6000) are measured against the footprint at that point: a leak per poll, per
event or per handler run shows within them. The long form, which first warms up to a steady event population
(100 s: the 60 s retention and its pruning, 20 s notices) and measures 100,000 polls, is `python -m bench soak`
(bench/soak.py); both run tests/soak.py and its checks.
"""

from __future__ import annotations

import os

import pytest

from tests.soak import AGENT_CONFIG, EMULATOR_ARGS, SHORT_NOTICES, soak

pytestmark = pytest.mark.e2e

POLLS = int(os.environ.get("MAINTD_SOAK_POLLS", "6000"))


def test_soak_memory_fds_and_threads_stay_flat(start_emulator, start_agent):
    """Once warm, nothing may grow: RSS under 2 MB, no more descriptors or threads than after the warm-up (bounded
    pools sized by peers and busy events, not by traffic)."""
    emu = start_emulator(["vm-1", "vm-2"], *EMULATOR_ARGS)
    agent = start_agent(emu, "vm-1", AGENT_CONFIG)
    result = soak(emu, agent, POLLS, SHORT_NOTICES, steady=False)
    print("\n" + result.line())
    for figure, measured, target, met in result.checks():
        assert met, f"{figure}: {measured} (target {target})"
    assert agent.get("/healthz").status_code == 200
