"""Chaos scenarios for the store backend: real agents, the emulator, Azurite behind one `StoreProxy` per VM.

Each scenario starts a fleet, injects one fault, adds one Reboot naming every VM and returns an `Outcome`:
what an operator would notice (StartRequests POSTs, whether one came before every hook had ended, how long
after the last hook the approval came) and what the fault cost (store requests, RSS, log volume). The
tests in tests/faults/test_store_chaos.py and tests/e2e/test_store_pause_e2e.py assert on the outcomes;
`python -m bench store_chaos` prints them as a matrix.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.azurite import ACCOUNT, KEY, Azurite
from tests.e2e.harness import Agent, Emulator, wait_until
from tests.e2e.test_store_e2e import FLEX, hook, store_config
from tests.store_proxy import Request, Rule, StoreProxy, replace_element, strip_element

TAKEOVER = 4.0
"""takeover_after for every scenario (seconds): short, so a takeover fits a test."""
StartEmulator = Callable[[list[str]], Emulator]
StartAgent = Callable[..., Agent]


class ProxyConfig:
    """What `store_config` needs of a server: a connection string, here through one VM's proxy."""

    def __init__(self, proxy: StoreProxy) -> None:
        self.proxy = proxy

    def connection_string(self) -> str:
        return self.proxy.connection_string(KEY)


@dataclass
class Fleet:
    """A running fleet: the emulator, each VM's agent and store proxy, the hooks' `done` files, the container."""

    emu: Emulator
    vms: list[str]
    agents: dict[str, Agent]
    proxies: dict[str, StoreProxy]
    done: Path
    container: str
    server: Azurite

    def add(self, make: Callable[[], Rule]) -> None:
        """A rule of its own (`make()`: each counts its own matches) on each VM's proxy."""
        for proxy in self.proxies.values():
            proxy.add(make())

    def approvals(self) -> list[dict[str, Any]]:
        """The StartRequests POSTs IMDS accepted, in time order."""
        return sorted((a for vm in self.vms for a in self.emu.approvals(vm)), key=lambda a: a["time"])

    def posts(self) -> list[dict[str, Any]]:
        """Every StartRequests POST IMDS received (answered with an error too)."""
        return [r for vm in self.vms for r in self.emu.requests(vm)
                if r["method"] == "POST" and "scheduledevents" in r["path"]]

    def hook_ends(self) -> dict[str, float]:
        """When each VM's hook ended (wall clock), for those that did."""
        return {vm: float((self.done / f"{vm}.done").read_text()) for vm in self.vms
                if (self.done / f"{vm}.done").exists()}

    def store_requests(self) -> list[Request]:
        return [r for p in self.proxies.values() for r in p.requests()]

    def stop(self) -> None:
        for proxy in self.proxies.values():
            proxy.stop()


def start_fleet(start_emulator: StartEmulator, start_agent: StartAgent, tmp_path: Path, server: Azurite,
                hook_seconds: tuple[float, ...], **coordination: Any) -> Fleet:
    """Agents with Flexible names on a new container, each through its own proxy, each hook its own length."""
    container = server.new_container()
    vms = FLEX[:len(hook_seconds)]
    emu = start_emulator(vms)
    done = tmp_path / "done"
    done.mkdir()
    proxies = {vm: StoreProxy(server.url, ACCOUNT) for vm in vms}
    agents = {vm: start_agent(emu, vm, {**store_config(ProxyConfig(proxies[vm]), container,  # type: ignore[arg-type]
                                                       tmp_path / f"{vm}-conf", **coordination),
                                        **hook(seconds, done)})
              for vm, seconds in zip(vms, hook_seconds, strict=True)}
    return Fleet(emu, vms, agents, proxies, done, container, server)


@dataclass
class Outcome:
    """One scenario as an operator sees it, and what the fault cost."""

    fault: str
    posts: int
    """StartRequests POSTs IMDS received (an injected IMDS error answer included)."""
    approvals: int
    """POSTs IMDS accepted: exactly one, or zero where no VM may approve."""
    early: int
    """Accepted POSTs that came before every VM's hook had ended (S1: must be 0)."""
    to_approval: float | None
    """Seconds from the last hook's end to the first accepted POST."""
    store_requests: int
    figures: dict[str, Any] = field(default_factory=dict)

    def row(self) -> dict[str, Any]:
        return {"fault": self.fault, "posts": self.posts, "approvals": self.approvals, "early": self.early,
                "to_approval_s": None if self.to_approval is None else round(self.to_approval, 1),
                "store_requests": self.store_requests, **self.figures}


def outcome(fleet: Fleet, fault: str, **figures: Any) -> Outcome:
    approvals = fleet.approvals()
    ends = fleet.hook_ends()
    last = max(ends.values()) if len(ends) == len(fleet.vms) else float("inf")
    first = approvals[0]["time"] if approvals else None
    return Outcome(fault, len(fleet.posts()), len(approvals), sum(a["time"] < last for a in approvals),
                   None if first is None or last == float("inf") else first - last,
                   len(fleet.store_requests()), figures)


def settle(fleet: Fleet, limit: float, after: float = 2 * TAKEOVER) -> None:
    """Wait for the first approval (at most `limit` s), then `after` s more for any second POST."""
    try:
        wait_until(fleet.approvals, limit, "the approval", interval=0.2)
    except AssertionError:
        return
    time.sleep(after)


# --- the scenarios --------------------------------------------------------------------------------

def no_fault(fleet: Fleet, limit: float = 45.0) -> Outcome:
    """No fault at all: the baseline, and what a VM costs when nothing goes wrong (its store requests over
    the event and 2 x takeover_after after it, and `store.marker_forged` lines about its own marker)."""
    fleet.emu.add_event(event_type="Reboot", resources=fleet.vms, notice=300)
    settle(fleet, limit)
    per_vm = [len(p.requests()) for p in fleet.proxies.values()]
    forged = sum(len(a.events("store.marker_forged")) for a in fleet.agents.values())
    return outcome(fleet, "none", requests_per_vm_max=max(per_vm), marker_forged_lines=forged)


def lost_answers(fleet: Fleet, limit: float = 45.0) -> Outcome:
    """The first answer to each VM's marker write, listing, claim and outcome record is lost after the write
    landed (the connection is reset): the SDK retries, the claim's retry finds the VM's own record."""
    fleet.add(lambda: Rule("lose", method="PUT", path="/vm/", count=1))
    fleet.add(lambda: Rule("lose", query="comp=list", count=1))
    fleet.add(lambda: Rule("lose", method="PUT", meta={"state": "claimed"}, count=1))
    fleet.add(lambda: Rule("lose", method="PUT", meta={"state": "approved"}, count=1))
    fleet.emu.add_event(event_type="Reboot", resources=fleet.vms, notice=300)
    settle(fleet, limit)
    lost = sum(r.fault == "lose" for r in fleet.store_requests())
    return outcome(fleet, "lost answers (write landed)", answers_lost=lost)


def early_retries(fleet: Fleet) -> list[str]:
    """Requests to a throttled path (the blob, or the listed folder) before its Retry-After had elapsed."""
    early = []
    for vm, proxy in fleet.proxies.items():
        seen = proxy.requests()
        for i, r in enumerate(seen):
            if r.retry_after is None:
                continue
            key = (r.path, re.sub(r"&?marker=[^&]*", "", r.query))
            early += [f"{vm}: {n.method} {n.blob or n.query[:60]} {n.at - r.at:.2f}s after a Retry-After of "
                      f"{r.retry_after:g}s" for n in seen[i + 1:]
                      if (n.path, re.sub(r"&?marker=[^&]*", "", n.query)) == key and n.at < r.at + r.retry_after]
    return early


def throttled(fleet: Fleet, retry_after: float = 3.0, limit: float = 60.0) -> Outcome:
    """503 ServerBusy with Retry-After on each VM's first two listings, its first marker write and its claim."""
    fleet.add(lambda: Rule("throttle", query="comp=list", count=2, retry_after=retry_after))
    fleet.add(lambda: Rule("throttle", method="PUT", path="/vm/", count=1, retry_after=retry_after))
    fleet.add(lambda: Rule("throttle", method="PUT", meta={"state": "claimed"}, count=1, retry_after=retry_after))
    fleet.emu.add_event(event_type="Reboot", resources=fleet.vms, notice=300)
    settle(fleet, limit)
    early = early_retries(fleet)
    throttled = sum(r.fault == "throttle" for r in fleet.store_requests())
    return outcome(fleet, f"503 ServerBusy, Retry-After {retry_after:g}s", throttled=throttled,
                   before_retry_after=len(early), examples=early[:3])


def poll_gap(fleet: Fleet, vm: str, since: float) -> float:
    """The longest gap between two IMDS polls of `vm` since `since` (wall clock): the loop never waits."""
    polls = [r["time"] for r in fleet.emu.requests(vm) if r["method"] == "GET" and "scheduledevents" in r["path"]
             and r["time"] >= since]
    return max((b - a for a, b in zip(polls, polls[1:], strict=False)), default=0.0)


def latency(fleet: Fleet, delay: float, limit: float = 45.0) -> Outcome:
    """Every store request held `delay` seconds."""
    fleet.add(lambda: Rule("latency", delay=delay))
    start = time.time()
    fleet.emu.add_event(event_type="Reboot", resources=fleet.vms, notice=300)
    settle(fleet, limit)
    gap = max(poll_gap(fleet, vm, start) for vm in fleet.vms)
    return outcome(fleet, f"latency {delay:g}s on every request", poll_gap_max_s=round(gap, 2))


ODD = ("empty attempt", "no Last-Modified", "odd types")


def odd_record(fleet: Fleet, kind: str, limit: float = 45.0) -> Outcome:
    """One record the protocol did not write: `empty attempt` (an approval record, written into Azurite,
    whose attempt is empty: listed back as None; it stays), `no Last-Modified` (a marker listed without it,
    in each VM's first two listings), `odd types` (a marker listed with a nested element for its state,
    None to the SDK, and no ETag, in each VM's first two listings)."""
    first = fleet.vms[0].casefold()
    if kind == "no Last-Modified":
        fleet.add(lambda: Rule("rewrite", query="comp=list", count=2, edit=strip_element(f"vm/{first}",
                                                                                              "Last-Modified")))
    elif kind == "odd types":
        edits = (replace_element(f"vm/{first}", "state", "<b>ready</b>"), strip_element(f"vm/{first}", "Etag"))
        fleet.add(lambda: Rule("rewrite", query="comp=list", count=2,
                                  edit=lambda body: edits[1](edits[0](body))))
    eid = fleet.emu.add_event(event_type="Reboot", resources=fleet.vms, notice=300)
    if kind == "empty attempt":
        from azure.storage.blob import ContainerClient

        with ContainerClient.from_connection_string(fleet.server.connection_string(), fleet.container) as direct:
            direct.get_blob_client(f"events/{eid.lower()}/approval").upload_blob(b"", metadata={
                "maintd": "1", "kind": "approval", "event": eid.lower(), "by": fleet.vms[0], "state": "claimed",
                "attempt": ""}, overwrite=True)
    written = time.time()
    settle(fleet, limit)
    approvals = fleet.approvals()
    return outcome(fleet, f"odd record: {kind}",
                   after_record_s=round(approvals[0]["time"] - written, 1) if approvals else None)


def _proc_kb(pid: int, field_name: str) -> int:
    text = Path(f"/proc/{pid}/status").read_text()
    match = re.search(rf"^{field_name}:\s+(\d+) kB", text, re.M)
    return int(match.group(1)) if match else 0


def big_listing(fleet: Fleet, size: int = 50 << 20, limit: float = 45.0) -> Outcome:
    """The first listing answer of the fleet's first VM padded to `size` bytes of blobs under the event's folder
    (markers the protocol did not write): its RSS (before, peak, after), its log volume, its IMDS polls. In
    a fleet of one, the VM can approve only once it has read a listing."""
    vm = fleet.vms[0]
    agent = fleet.agents[vm]
    fleet.proxies[vm].add(Rule("pad", query="comp=list", count=1, size=size))
    time.sleep(1.5)  # the store client (the SDK) is loaded on the first tick: RSS before counts it
    pid = agent.proc.pid
    before = _proc_kb(pid, "VmRSS")
    lines, events = len(agent.raw), len(agent.events())
    start = time.time()
    eid = fleet.emu.add_event(event_type="Reboot", resources=fleet.vms, notice=300)

    def digested() -> bool:  # the padded answer was read and judged: a listing, or a failed request
        return agent.proc.poll() is not None or any(
            e.get("event") in ("store.listed", "store.request_failed") and e.get("event_id") == eid
            for e in agent.events()[events:])

    try:
        wait_until(digested, limit, "the 50 MB listing to be read", interval=0.2)
    except AssertionError:
        pass
    settle(fleet, limit, after=1.0)
    quiet = [len(agent.raw)]
    while time.time() < start + 3 * limit and (time.sleep(1.0) or len(agent.raw) != quiet[-1]):
        quiet.append(len(agent.raw))  # until its log is quiet for a second (a line per odd blob takes a while)
    if agent.proc.poll() is not None:
        return outcome(fleet, f"listing answer of {size >> 20} MB", exited=agent.proc.returncode)
    peak, after = _proc_kb(pid, "VmHWM"), _proc_kb(pid, "VmRSS")
    logged = agent.raw[lines:]
    return outcome(fleet, f"listing answer of {size >> 20} MB", rss_before_mb=round(before / 1024),
                   rss_peak_mb=round(peak / 1024), rss_after_mb=round(after / 1024), log_lines=len(logged),
                   log_bytes=sum(map(len, logged)),
                   invalid_record_lines=sum('"store.invalid_record"' in line for line in logged),
                   poll_gap_max_s=round(poll_gap(fleet, vm, start), 2))


# --- pauses (SIGSTOP: a frozen VM, a live migration, swapping) -------------------------------------

def _pause(agent: Agent, seconds: float, until: Callable[[], Any] | None = None, limit: float = 40.0) -> float:
    """SIGSTOP the agent (its hook, a child, runs on) for `seconds`, and then until `until()` is true (at most
    `limit` s in all); when it was resumed (wall clock)."""
    os.kill(agent.proc.pid, signal.SIGSTOP)
    try:
        time.sleep(seconds)
        if until is not None:
            wait_until(until, limit - seconds, "the fleet to move on while the VM is paused", interval=0.1)
    finally:
        os.kill(agent.proc.pid, signal.SIGCONT)
    return time.time()


def paused_claimer(fleet: Fleet, imds_500: bool = False, limit: float = 40.0) -> Outcome:
    """The VM that claims is paused right after its claim (the `store.claimed` line; with `imds_500`, right
    after its first POST, which IMDS answers 500, so the pause falls in its retry backoff) and resumed after
    2 x takeover_after once another VM has taken the claim over (or an approval is in: the claimer's POST
    went before the pause): one POST in all, the claimer's or the taker's, never both. Resuming after a fixed
    time raced the takeover on a loaded host: a claimer woken before it rightly POSTed itself."""
    if imds_500:
        for vm in fleet.vms:
            fleet.emu.admin("POST", "faults", vm, vm=vm, kind="status", status=500, path="/metadata/scheduledevents",
                            method="POST", count=1)
    fleet.emu.add_event(event_type="Reboot", resources=fleet.vms, notice=300)

    def claimer() -> str | None:
        if imds_500:
            return next((p["vm"] for p in fleet.posts()), None)
        return next((vm for vm, a in fleet.agents.items() if a.events("store.claimed")), None)

    vm = wait_until(claimer, limit, "a claim", interval=0.005)
    claims = {other: len(a.events("store.claimed")) for other, a in fleet.agents.items()}

    def moved_on() -> bool:
        return bool(fleet.approvals()) or any(len(a.events("store.claimed")) > claims[other]
                                              for other, a in fleet.agents.items() if other != vm)

    resumed = _pause(fleet.agents[vm], 2 * TAKEOVER, until=moved_on, limit=limit)
    settle(fleet, limit, after=2 * TAKEOVER)
    after = [a for a in fleet.approvals() if a["vm"] == vm and a["time"] >= resumed]
    return outcome(fleet, "claimer paused after its claim" + (", its POST 500" if imds_500 else ""),
                   claimer_posts_after_resume=len(after))


def _children(pid: int) -> list[str]:
    """The child processes of `pid` (its hook, once spawned)."""
    tasks = Path(f"/proc/{pid}/task")
    return [c for t in tasks.iterdir() for c in (t / "children").read_text().split()]


def paused_preparing(fleet: Fleet, pause: float, limit: float = 40.0) -> Outcome:
    """The slowest VM (the last one) is paused once its hook runs (a child of the agent, which runs on), past
    its hook's end and 2 x takeover_after: no POST before its hook ended; one after it resumed."""
    vm = fleet.vms[-1]
    fleet.emu.add_event(event_type="Reboot", resources=fleet.vms, notice=300)
    agent = fleet.agents[vm]
    wait_until(lambda: _children(agent.proc.pid), 20, "its hook to run")
    resumed = _pause(agent, pause)
    settle(fleet, limit)
    approvals = fleet.approvals()
    return outcome(fleet, "preparing VM paused past its hook's end",
                   after_resume_s=round(approvals[0]["time"] - resumed, 1) if approvals else None)
