"""The disruption budget under chaos, judged from outside: real agents, the emulator, Azurite behind one
`StoreProxy` per member (`tests/store_proxy.py`: faults per member).

Each member listens on a loopback address of its own (127.0.0.2, 127.0.0.3, ...) with `advertise` left at its
default (on a loopback-only listener that is none) and no `wake_url`: the members have no address for each other,
no wake hint can pass between them, and the store is their only link, as in a scale set behind an NSG.

What is observed is what an operator sees: who is out of rotation (`Rotation`: each member's /probe every
100 ms), the StartRequests POSTs each VM's IMDS received, who was forced (`budget.forced` in its log), the
group's record as a member's `/v1/fleet` shows it. The scenarios are tests/faults/test_budget_chaos.py.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from email.utils import parsedate_to_datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import requests

from tests.azurite import ACCOUNT, Azurite
from tests.e2e.harness import Agent, Emulator, http
from tests.e2e.test_store_e2e import metric, store_config
from tests.store_chaos import ProxyConfig
from tests.store_proxy import StoreProxy

GROUP = "web"
PROBE = {"lb_timeout": "11s", "lb_interval": "5s", "drain_grace": "0s"}
"""The shortest drain the config allows: 11 s out of rotation before the hooks' work counts as done."""
HOOK = ('if [ -n "$GATED" ]; then while [ ! -e "$DIR/$MAINTD_VM_NAME.go" ]; do sleep 0.1; done; fi; '
        'sleep "$SLEEP"')
"""The checkpoint: `SLEEP` seconds; a gated one first waits for the test to `open` its gate (a member that holds
its place as long as the test wants)."""
REJOIN = "1s"
"""B7's rejoin_wait here (the default, probe.lb_timeout, would add 11 s to each handoff): ten probe rounds between one
member back in rotation and the next out, so the sampler can order them."""
PROBE_EVERY, PROBE_TIMEOUT = 0.1, 2.0
StartEmulator = Callable[..., Emulator]
StartAgent = Callable[..., Agent]


class Rotation:
    """Each member's /probe every 100 ms, a thread per member: who was out of rotation, when (wall clock). An
    answer other than 200 is out; a probe that does not answer within PROBE_TIMEOUT (a paused daemon, a loaded
    host) is unknown: counted, taken for neither, and the member's last answer no longer stands."""

    def __init__(self, agents: dict[str, Agent], zone: dict[str, str] | None = None) -> None:
        self.agents, self.zone = agents, zone or {}
        self.state: dict[str, bool | None] = dict.fromkeys(agents)
        self.timeline: list[tuple[float, str, bool | None]] = []
        """Every answer: (when, member, out); None: no answer."""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(vm, a), daemon=True) for vm, a in agents.items()]
        for t in self._threads:
            t.start()

    def _run(self, vm: str, agent: Agent) -> None:
        session = http()
        while not self._stop.is_set():
            try:
                out: bool | None = session.get(agent.base + "/probe", timeout=PROBE_TIMEOUT).status_code != 200
            except requests.RequestException:
                out = None
            with self._lock:
                self.state[vm] = out
                self.timeline.append((time.time(), vm, out))
            self._stop.wait(PROBE_EVERY)

    def out_now(self) -> set[str]:
        with self._lock:
            return {vm for vm, out in self.state.items() if out}

    def moments(self, ignore: Callable[[str, float], bool] | None = None) -> list[tuple[float, frozenset[str]]]:
        """Who was out after each answer; `ignore(vm, when)`: answers not to count (taken for unknown)."""
        with self._lock:
            timeline = list(self.timeline)
        state: dict[str, bool | None] = dict.fromkeys(self.agents)
        found = []
        for when, vm, out in timeline:
            state[vm] = None if ignore is not None and ignore(vm, when) else out
            found.append((when, frozenset(v for v, o in state.items() if o)))
        return found

    def most_out(self, ignore: Callable[[str, float], bool] | None = None) -> int:
        return max((len(out) for _, out in self.moments(ignore)), default=0)

    def most_zones_out(self) -> int:
        return max((len({self.zone[vm] for vm in out}) for _, out in self.moments()), default=0)

    def ever_out(self) -> set[str]:
        return {vm for _, vm, out in self.timeline if out}

    def intervals(self, vm: str) -> list[tuple[float, float]]:
        """When `vm` was out: from its first answer out to its first answer in rotation after it (no answer
        ends nothing)."""
        found: list[tuple[float, float]] = []
        start = None
        for when, _, out in self.answers(vm):
            if out and start is None:
                start = when
            elif out is False and start is not None:
                found.append((start, when))
                start = None
        if start is not None:
            found.append((start, float("inf")))
        return found

    def answers(self, vm: str) -> list[tuple[float, str, bool | None]]:
        with self._lock:
            return [s for s in self.timeline if s[1] == vm]

    def gaps(self) -> list[float]:
        """Seconds from each time a member was back in rotation to the next time one went out (the load balancer's
        time to send traffic to the one back, B7), over the whole timeline."""
        spans = sorted(span for vm in self.agents for span in self.intervals(vm))
        return [later[0] - earlier[1] for earlier, later in zip(spans, spans[1:], strict=False)]

    def together(self, a: str, b: str) -> float:
        """Seconds `a` and `b` were out at once."""
        return sum(max(0.0, min(e1, e2) - max(s1, s2)) for s1, e1 in self.intervals(a) for s2, e2 in self.intervals(b))

    def unanswered(self, vm: str | None = None) -> int:
        with self._lock:
            return sum(1 for _, who, out in self.timeline if out is None and vm in (None, who))

    def report(self) -> str:
        """Each member's times out of rotation, relative to the first sample: for an assertion's message."""
        t0 = self.timeline[0][0] if self.timeline else 0.0
        return "; ".join(f"{vm} out " + ", ".join(f"+{s - t0:.1f}..+{e - t0:.1f}" for s, e in self.intervals(vm))
                         for vm in self.agents)

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(PROBE_TIMEOUT + 3)


@dataclass
class Group:
    """One budget group at work: the emulator, each member's agent, store proxy and loopback address."""

    emu: Emulator
    agents: dict[str, Agent]
    proxies: dict[str, StoreProxy]
    gates: Path
    container: str
    server: Azurite
    zone: dict[str, str] = field(default_factory=dict)
    not_before: dict[str, float] = field(default_factory=dict)
    """Each event's NotBefore (wall clock), by EventId."""
    rotation: Rotation | None = None

    def watch(self) -> Rotation:
        self.rotation = Rotation(self.agents, self.zone)
        return self.rotation

    def event(self, vms: list[str], notice: float, event_type: str = "Reboot") -> str:
        """A new event naming `vms` (over in 2 s once started); its NotBefore kept in `not_before`."""
        eid = self.emu.add_event(event_type=event_type, resources=vms, notice=notice, duration_seconds=2)
        doc = self.emu.admin("GET", "events", vms[0])
        nb = next(e["NotBefore"] for e in doc["Events"] if e["EventId"] == eid)
        self.not_before[eid] = parsedate_to_datetime(nb).timestamp() if nb else time.time()
        return eid

    def open(self, vm: str) -> None:
        """Let `vm`'s gated checkpoint end."""
        (self.gates / f"{vm}.go").touch()

    def approvals(self, vm: str) -> list[dict[str, Any]]:
        """The StartRequests POSTs `vm`'s IMDS accepted."""
        return list(self.emu.approvals(vm))

    def posts(self, vm: str) -> list[float]:
        """When `vm`'s IMDS received a StartRequests POST (wall clock), answered or not."""
        return [r["time"] for r in self.emu.requests(vm) if r["method"] == "POST" and "scheduledevents" in r["path"]]

    def approved_early(self, eid: str) -> bool:
        """Some POST approving `eid` was accepted before its NotBefore."""
        return any(eid in a["event_ids"] and a["time"] < self.not_before[eid]
                   for vm in self.agents for a in self.approvals(vm))

    def forced(self) -> dict[str, list[str]]:
        """Who was forced out over budget, for which events (the `budget.forced` lines)."""
        return {vm: [str(e.get("event_id")) for e in a.events("budget.forced")] for vm, a in self.agents.items()
                if a.events("budget.forced")}

    def fleet(self, vm: str) -> dict[str, Any]:
        """The budget as `vm`'s /v1/fleet shows it ({} when it does not answer)."""
        try:
            body = self.agents[vm].get("/v1/fleet").json()
        except (requests.RequestException, ValueError):
            return {}
        return body.get("budget") or {} if isinstance(body, dict) else {}

    def metric(self, vm: str, name: str, **labels: str) -> float:
        return metric(self.agents[vm], name, **labels)

    def stop(self) -> None:
        if self.rotation is not None:
            self.rotation.close()
        for proxy in self.proxies.values():
            proxy.stop()


def member_config(proxy: StoreProxy, container: str, workdir: Path, gates: Path, budget: dict[str, Any], *,
                  gated: bool = False, sleep: float = 3.0, timeout: float = 10.0, drain: bool = True,
                  token_file: str | None = None, auto_name: bool = False) -> dict[str, Any]:
    """A member's config: the store through its proxy, the budget (`advertise` at its default), the drain and a
    checkpoint of `sleep` seconds (`gated`: ending only once the test opens its gate) with `timeout`, which is
    part of what its last safe moment allows for (drain wait plus the hooks' timeouts, and 5 s)."""
    cfg = store_config(ProxyConfig(proxy), container, workdir,  # type: ignore[arg-type]
                       budget={"group": GROUP, "max_unavailable": 1, "rejoin_wait": REJOIN, **budget})
    if token_file is not None:
        cfg["coordination"]["token_file"] = token_file
    checkpoint = {"name": "checkpoint", "type": "exec", "phases": ["scheduled"], "timeout": f"{timeout:g}s",
                  "command": ["/bin/sh", "-c", HOOK],
                  "env": {"SLEEP": f"{sleep:g}", "DIR": str(gates), "GATED": "1" if gated else ""}}
    handlers = [{"name": "drain", "type": "drain", "phases": ["scheduled", "completed"], "timeout": "30s"}] \
        if drain else []
    return {**cfg, "probe": PROBE, "handlers": handlers + [checkpoint],
            **({"identity": {"name": "auto"}} if auto_name else {})}


def start_group(start_emulator: StartEmulator, start_agent: StartAgent, tmp_path: Path, server: Azurite,
                vms: list[str], budget: dict[str, Any], *, zones: int = 0,
                before: Callable[[str], None] | None = None, each: Callable[[str], dict[str, Any]] | None = None,
                token: bool = False) -> Group:
    """Members `vms` of group `web` on a new container, each on 127.0.0.(2 + i) through its own proxy.
    `budget`: the budget's keys; `zones`: the emulator's zones (compute zone i % zones + 1, names from IMDS);
    `before(container)`: runs before any member starts (a forged record); `each(vm)`: member_config's keyword
    arguments for that member; `token`: a coordination token_file shared by the members."""
    container = server.new_container()
    if before is not None:
        before(container)
    emu = start_emulator(vms, *(["--zones", str(zones)] if zones else []))
    gates = tmp_path / "gates"
    gates.mkdir()
    token_file = None
    if token:
        token_file = str(tmp_path / "coordination.token")
        Path(token_file).write_text("coordination-secret-" + os.urandom(8).hex() + "\n")
        os.chmod(token_file, 0o600)
    proxies = {vm: StoreProxy(server.url, ACCOUNT) for vm in vms}

    def one(i_vm: tuple[int, str]) -> Agent:
        i, vm = i_vm
        cfg = member_config(proxies[vm], container, tmp_path / f"{vm}-conf", gates, budget,
                            token_file=token_file, auto_name=zones > 0, **(each(vm) if each else {}))
        return start_agent(emu, vm, cfg, host=f"127.0.0.{2 + i}")

    # one after another on the test's thread: a maintd dies with the thread that started it (tests/reaper.py)
    agents = {vm: one((i, vm)) for i, vm in enumerate(vms)}
    zone = {vm: str(i % zones + 1) for i, vm in enumerate(vms)} if zones else {}
    return Group(emu, agents, proxies, gates, container, server, zone)


# --- forged records ---------------------------------------------------------------------------------

def iso(at: datetime) -> str:
    return at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def entry(vm: str, why: str, renewed: datetime, since: datetime | None = None, url: str = "",
          zone: str = "", event: str = "forged") -> dict[str, str]:
    """One entry of the places record as a member writes it."""
    return {"vm": vm, "zone": zone, "fault_domain": "", "event": event, "why": why, "since": iso(since or renewed),
            "renewed": iso(renewed), **({"url": url} if url else {})}


def forge(server: Azurite, container: str, holders: Iterable[dict[str, str]] = (),
          waiting: Iterable[dict[str, str]] = (), members: dict[str, str] | None = None) -> None:
    """Write the group's places record straight into the store, as anyone with write access to it could."""
    from azure.storage.blob import ContainerClient

    body = {"maintd": 1, "kind": "places", "group": GROUP, "holders": list(holders), "waiting": list(waiting),
            "members": members or {}}
    with ContainerClient.from_connection_string(server.connection_string(), container) as direct:
        direct.get_blob_client(f"budget/{GROUP}/places").upload_blob(json.dumps(body).encode(), overwrite=True)


def stale_members(n: int, age: timedelta) -> dict[str, str]:
    """`n` member names the group no longer has (a scale-in, or forged), last seen `age` ago."""
    seen = iso(datetime.now(UTC) - age)
    return {f"gone{i:04d}": seen for i in range(n)}


class Listener:
    """A local HTTP listener that records each request it gets and whether it carried an Authorization header
    (where a forged record's `url` points)."""

    def __init__(self) -> None:
        self.got: list[tuple[str, str, bool]] = []
        listener = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: object) -> None:  # the base class's name
                pass

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                listener.got.append((self.command, self.path, "Authorization" in self.headers))
                self.send_response(200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            do_GET = do_PUT = do_POST

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def with_authorization(self) -> list[tuple[str, str, bool]]:
        return [g for g in self.got if g[2]]

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
