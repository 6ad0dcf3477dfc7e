"""Fixtures that start and always stop the real processes."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from tests.e2e.harness import Agent, Emulator


@pytest.fixture
def start_emulator() -> Iterator[Callable[..., Emulator]]:
    started: list[Emulator] = []

    def start(vms: list[str], *extra: str) -> Emulator:
        emu = Emulator(vms, *extra)
        started.append(emu)
        return emu

    yield start
    for emu in started:
        emu.stop()


@pytest.fixture
def start_agent(tmp_path) -> Iterator[Callable[..., Agent]]:
    started: list[Agent] = []

    def start(emu: Emulator, name: str, extra: dict | None = None, env: dict | None = None,
              port: int | None = None, host: str = "127.0.0.1") -> Agent:
        agent = Agent(tmp_path / name, emu.urls[name], name, extra, env, port, host)
        started.append(agent)
        return agent

    yield start
    for agent in started:
        agent.stop()
