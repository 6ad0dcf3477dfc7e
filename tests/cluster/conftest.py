"""The real cluster, once per module: two Pacemaker nodes in network namespaces, an IMDS in each, one
maintd per node. Root only (and Pacemaker, Corosync, resource-agents installed); elsewhere the tests
skip, naming what is missing. Everything is torn down when the module ends, a test fails, or the
run is interrupted (the processes also die with the test process: PR_SET_PDEATHSIG)."""

from __future__ import annotations

import shutil
import signal
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.netns import Cluster, missing
from tests.cluster.rig import ClusterImds, NodeAgent, running

HANDLER: dict[str, Any] = {"name": "cluster", "type": "pacemaker", "phases": ["scheduled", "completed"],
                           "move_timeout": "8s"}


@dataclass
class Rig:
    cluster: Cluster
    imds: ClusterImds
    agents: dict[str, NodeAgent]
    base: Path

    def node(self, name: str) -> Any:
        return next(n for n in self.cluster.nodes if n.name == name)

    def other(self, name: str) -> str:
        return next(n.name for n in self.cluster.nodes if n.name != name)


def _skip_unless_able() -> None:
    lack = missing()
    if lack:
        pytest.skip("the Pacemaker cluster tests need " + ", ".join(lack))


@pytest.fixture(scope="module")
def rig() -> Iterator[Rig]:
    _skip_unless_able()
    base = Path(tempfile.mkdtemp(prefix="maintd-cluster-"))
    cluster = Cluster(base / "cluster")
    previous = signal.getsignal(signal.SIGTERM)

    def interrupted(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupted)  # a killed run still tears the cluster down
    try:
        with running(cluster, HANDLER, base, started_duration=2.0) as (imds, agents):
            yield Rig(cluster, imds, agents, base)
    finally:
        signal.signal(signal.SIGTERM, previous)
        shutil.rmtree(base, ignore_errors=True)  # a failing scenario prints each maintd's lines itself
