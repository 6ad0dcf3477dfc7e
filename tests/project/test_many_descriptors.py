"""A process holding more than 1023 descriptors (a busy daemon, a long test run: the limit here is far higher)
still sleeps, wakes, probes and hangs as it should: `select()` fails on a descriptor over 1023 (ValueError), so
every wait on one descriptor uses `poll()`. Three test failures of full runs were this: the loop's sleep, the
emulator's hang, and a SIGHUP timer that outlived a test whose sleep had raised."""

from __future__ import annotations

import os
import resource
import socket
import time
from collections.abc import Iterator

import pytest
import requests

from agent.clock import FakeClock, PipeSleeper
from agent.emulator import Emulator
from agent.health.tcp_probe import TcpProbe

HIGH = 1100


@pytest.fixture
def high_descriptors() -> Iterator[None]:
    """Hold descriptors until the next one opened is over 1023 (skip where the limit does not allow it)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < HIGH + 64:
        pytest.skip(f"RLIMIT_NOFILE is {soft}: no descriptor over 1023 can be opened here")
    held: list[int] = []
    base = os.open(os.devnull, os.O_RDONLY)
    held.append(base)
    while held[-1] < HIGH:
        held.append(os.dup(base))
    try:
        yield
    finally:
        for fd in held:
            os.close(fd)


def test_the_loops_sleep_wakes_and_times_out_on_a_high_descriptor(high_descriptors):
    """A wake ends the loop's sleep at once, and an unwoken sleep ends at its time, with its pipe over 1023."""
    sleeper = PipeSleeper()
    assert sleeper.fileno() > 1023
    sleeper.wake()
    started = time.monotonic()
    sleeper.sleep(5)
    assert time.monotonic() - started < 1.0
    started = time.monotonic()
    sleeper.sleep(0.05)
    assert time.monotonic() - started >= 0.04


def test_a_hang_still_ends_in_the_clients_read_timeout_on_a_high_descriptor(high_descriptors):
    """The emulator's hanging answer waits for the client to give up; it never drops the connection itself."""
    emu = Emulator(["vm-1"], clock=FakeClock(), rate_limit=None)
    urls = emu.start()
    session = requests.Session()
    session.trust_env = False
    try:
        emu.add_fault(kind="hang", count=1)
        with pytest.raises(requests.ReadTimeout):
            session.get(urls["vm-1"] + "/metadata/scheduledevents", params={"api-version": "2020-07-01"},
                        headers={"Metadata": "true"}, timeout=0.3)
    finally:
        session.close()
        emu.stop()


def test_the_tcp_probe_follows_rotation_on_a_high_descriptor(high_descriptors):
    """`probe.mode: tcp` with its sockets over 1023: the port accepts while in rotation and closes once out."""
    state = {"in": True}
    probe = TcpProbe("127.0.0.1:0", lambda: state["in"])
    probe.start()
    try:
        with socket.create_connection(("127.0.0.1", probe.port), timeout=5):
            pass
        state["in"] = False
        probe.notify()
        deadline = time.monotonic() + 10
        while probe.listening and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", probe.port), timeout=5).close()
    finally:
        probe.stop()
