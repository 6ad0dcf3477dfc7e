"""The rules of coordinated approval, pure: gate verdicts (the specs are `agent.model.gate_specs`),
takeover, peer timeout, asking cadence.

No I/O here: `coordinator` (peers) and `gates` (gate answers) do the HTTP through `peers` and call
these functions with what they learned. Changing a coordination rule means changing this module.

Traffic shape (O(N) per event): the acting leader asks each peer it has not heard ready from,
at once and then with exponential backoff (`recheck_delay`); a peer that becomes ready pushes
that to the acting leader, which checks it with one request. A follower asks only the lower-ranked
peers up to the first one that answers (`watch_chain`), at `liveness_interval`, to notice when the
leader chain is gone.

Who may post (the peer backend's S1, for the coordinator and the model checker alike; all pure,
over `PeerState`s): `right_to_post` (None, or why not) and `may_post` (auto mode) combine the
takeover rule (`lower_reachable`) with `readiness_missing`: a `ready` from every VM named,
lower-ranked included, a lower-ranked peer's only while it answers. `silent_leaders` names the
lower-ranked peers whose silence makes this VM lead but holds its approval. The approval policy
(`windows.approval_policy.decide`) adds this VM's own readiness and the profile.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

from agent.model.events import maintenance_property
from agent.model.gate_specs import FleetGate

# --- gate verdicts ------------------------------------------------------------------------------

PeerHealth = Literal["ok", "unhealthy", "unreachable"]
"""A VM's health as the fleet gate counts it (the peers' /v1/health, or a store marker's `health`)."""
OK: Final = "ok"
UNHEALTHY: Final = "unhealthy"
UNREACHABLE: Final = "unreachable"


@dataclass(frozen=True)
class Held:
    """Why an approval is held: the gate and a readable reason."""

    gate: str
    reason: str


# --- gate verdicts ---------------------------------------------------------------------------

def allowed_unhealthy(total: int, max_percent: int) -> int:
    """How many of `total` VMs may be unhealthy: ceil(total × max_percent / 100), as Service Fabric rounds."""
    return math.ceil(total * max_percent / 100)


def fleet_verdict(states: dict[str, str], gate: FleetGate) -> Held | None:
    """Hold when more VMs are unhealthy than the policy tolerates; `states` maps VM name to ok/unhealthy/unreachable."""
    counted = {n: s for n, s in states.items() if not (s == UNREACHABLE and gate.unreachable_counts_as == "ignore")}
    bad = sorted(n for n, s in counted.items() if s != OK)
    allowed = allowed_unhealthy(len(counted), gate.max_percent_unhealthy)
    if len(bad) <= allowed:
        return None
    shown = ", ".join(f"{n} ({states[n]})" for n in bad[:5]) + (f" +{len(bad) - 5} more" if len(bad) > 5 else "")
    return Held("fleet", f"{len(bad)} of {len(counted)} VMs unhealthy, {gate.max_percent_unhealthy}% allows "
                         f"{allowed}: {shown}")


def peer_state(health: Any, event_id: str, warning_as_error: bool) -> str:
    """ok or unhealthy from a `/v1/health` body, leaving out the reports about the event itself.

    A body of the wrong shape is `unreachable`; a report whose fields are not strings is unhealthy
    (an answer maintd cannot read never makes a VM look healthy).
    """
    if not isinstance(health, dict) or not isinstance(health.get("HealthEvents"), list):
        return UNREACHABLE
    bad = {"Error"} | ({"Warning"} if warning_as_error else set())
    for report in health["HealthEvents"]:
        if not isinstance(report, dict):
            continue
        state = "Error" if report.get("IsExpired") else report.get("HealthState")
        if not isinstance(state, str):
            return UNHEALTHY
        about_event = report.get("SourceId") == "maintenance" or (
            report.get("SourceId") == "maintd" and report.get("Property") == maintenance_property(event_id))
        if not about_event and state in bad:
            return UNHEALTHY
    return OK


def unwell(health: Any) -> frozenset[tuple[str, str, str]]:
    """The reports of a `/v1/health` body that a fleet gate may count against the VM (Warning, Error, expired), by
    (SourceId, Property, state): when this changes, so may the gate's verdict about the VM."""
    reports = health.get("HealthEvents") if isinstance(health, dict) else None
    return frozenset((str(r.get("SourceId")), str(r.get("Property")),
                      "Expired" if r.get("IsExpired") else str(r.get("HealthState")))
                     for r in reports or () if isinstance(r, dict)
                     and (r.get("IsExpired") or r.get("HealthState") not in ("Ok", None)))


def health_word(health: Any, event_id: str) -> str:
    """What a ready follower tells its acting leader of its health for an event, each time it changes: the fleet
    gate's verdict about it both ways Warning may count (`ok`, `warning`: unhealthy only under
    consider_warning_as_error, `unhealthy`, `unreachable` for a body of the wrong shape)."""
    lax = peer_state(health, event_id, False)
    if lax != OK:
        return lax
    return "warning" if peer_state(health, event_id, True) != OK else OK


def firing(alerts_body: Any, patterns: Sequence[str]) -> list[str]:
    """Names of firing alerts (from /api/v1/alerts) that match one of `patterns` in full; ValueError on a bad shape."""
    data = alerts_body.get("data") if isinstance(alerts_body, dict) else None
    alerts = data.get("alerts") if isinstance(data, dict) else None
    if not isinstance(alerts, list):
        raise ValueError("no data.alerts list in the answer")
    compiled = [re.compile(p) for p in patterns]
    names = set()
    for a in alerts:
        labels = a.get("labels") if isinstance(a, dict) and a.get("state") == "firing" else None
        name = labels.get("alertname") if isinstance(labels, dict) else None
        if isinstance(name, str):
            names.add(name)
    return sorted(n for n in names if any(c.fullmatch(n) for c in compiled))


def query_samples(query_body: Any) -> int:
    """How many samples a /api/v1/query answer holds; ValueError when it is not a Prometheus result."""
    data = query_body.get("data") if isinstance(query_body, dict) else None
    result = data.get("result") if isinstance(data, dict) else None
    if isinstance(result, list):
        return len(result)
    if isinstance(result, (int, float, str)) or result is None:
        raise ValueError(f"data.result is {type(result).__name__}, not a list of samples")
    raise ValueError("no data.result in the answer")


# --- peers: what this VM knows, and the rules over it ----------------------------------------

@dataclass
class PeerState:
    """What this VM knows of one peer for one event (mutated by the coordinator under its lock)."""

    ready: bool = False
    last_ok: float | None = None
    failing_since: float | None = None
    last_asked: float = float("-inf")
    asks: int = 0
    """Asks so far that did not find the peer ready (drives the backoff)."""
    hinted: bool = False
    hint_at: float = float("-inf")
    in_flight: bool = False
    detail: str = ""
    url: str | None = None
    via: str = ""

    def unreachable_for(self, now: float) -> float:
        """Seconds since the peer was last known alive, while it fails to answer (0 when it answered last time)."""
        return now - self.failing_since if self.failing_since is not None else 0.0

    @property
    def failing(self) -> bool:
        return self.failing_since is not None


def failed_since(peer: PeerState, now: float) -> float:
    """When a peer that just failed to answer was last known alive: its last answer, or now if it never answered."""
    if peer.failing_since is not None:
        return peer.failing_since
    return peer.last_ok if peer.last_ok is not None else now


def liveness_interval(poll_interval: float, takeover_after: float) -> float:
    """How often a follower asks the peers ranked before it: a quarter of takeover_after, within [poll, 5 s]."""
    return max(poll_interval, min(takeover_after / 4, 5.0))


def recheck_delay(asks: int, poll_interval: float, recheck_max: float) -> float:
    """Wait before asking a not-ready peer again after `asks` asks: poll_interval doubling up to recheck_max."""
    return min(recheck_max, poll_interval * 2.0 ** max(0, min(asks, 32) - 1))


def readiness_due(peer: PeerState, now: float, poll_interval: float, recheck_max: float) -> bool:
    """Whether the acting leader should ask this peer now (never a ready one, never two at a time)."""
    if peer.ready or peer.in_flight:
        return False
    return peer.hinted or now - peer.last_asked >= recheck_delay(peer.asks, poll_interval, recheck_max)


def liveness_due(peer: PeerState, now: float, every: float) -> bool:
    """Whether a follower should ask a peer of its leader chain now (ready or not: it may have died since)."""
    return not peer.in_flight and now - peer.last_asked >= every


def gate_recheck_delay(approval_retry_for: float) -> float:
    """How long a held approval waits before its gates are asked again, and the least time between two queries of
    one Prometheus gate: a twelfth of `approval_retry_for` (5 s by default), never less than a second (a firing
    alert must not turn into a query loop). A change in the fleet gate's input decides again sooner."""
    return max(1.0, approval_retry_for / 12)


def push_due(leader: str, told: str | None, last_target: str | None, last_push: float, now: float,
             every: float) -> bool:
    """Whether a ready follower should push to the acting leader now: until one took it, every `every`."""
    return told != leader and (last_target != leader or now - last_push >= every)


def hint_accepted(peer: PeerState, now: float, poll_interval: float) -> bool:
    """A readiness push makes the peer due at once, at most once per poll interval (pushes are unauthenticated)."""
    return not peer.ready and now - peer.hint_at >= poll_interval


def watch_chain(lower: Sequence[str], peers: Mapping[str, PeerState]) -> list[str]:
    """The lower-ranked peers a follower asks: in rank order, up to and including the first not failing."""
    chain: list[str] = []
    for name in lower:
        chain.append(name)
        peer = peers.get(name)
        if peer is None or not peer.failing:
            break
    return chain


def acting_leader(lower: Sequence[str], peers: Mapping[str, PeerState]) -> str | None:
    """The lowest-ranked peer not known to be failing (where readiness is pushed); None: this VM leads or will."""
    return next((n for n in lower if not (peers.get(n) and peers[n].failing)), None)


def leads_soon(lower: Sequence[str], peers: Mapping[str, PeerState], now: float, takeover_after: float) -> bool:
    """Whether this VM asks for readiness: it leads, or every lower-ranked peer has been unreachable for half
    of `takeover_after` (so it knows who is ready when it takes over, and a leader's blip starts no storm)."""
    return all(n in peers and peers[n].unreachable_for(now) >= takeover_after / 2 for n in lower)


def lower_reachable(lower: Sequence[str], peers: Mapping[str, PeerState], now: float,
                    takeover_after: float) -> list[str]:
    """Lower-ranked peers that still count as present: not failing for `takeover_after` (the takeover rule)."""
    return [n for n in lower if peers.get(n) is None or peers[n].unreachable_for(now) < takeover_after]


def not_ready(names: Sequence[str], peers: Mapping[str, PeerState], now: float, unreachable_peers: str,
              peer_timeout: float) -> list[str]:
    """Peers that block approval: not ready, unless `ignore` and unreachable for `peer_timeout`
    (the peer-timeout rule). A `ready` once heard counts while the peer is silent: use it only for
    peers that can never be posting themselves (see `readiness_missing`)."""
    waiting = []
    for name in names:
        peer = peers.get(name)
        if peer is not None and peer.ready:
            continue
        if waived(peer, now, unreachable_peers, peer_timeout):
            continue
        waiting.append(name)
    return waiting


def waived(peer: PeerState | None, now: float, unreachable_peers: str, peer_timeout: float) -> bool:
    """The opt-out of S1: with `unreachable_peers: ignore`, a peer silent for `peer_timeout` is not waited for."""
    return unreachable_peers == "ignore" and peer is not None and peer.unreachable_for(now) >= peer_timeout


def readiness_missing(lower: Sequence[str], higher: Sequence[str], peers: Mapping[str, PeerState], now: float,
                      unreachable_peers: str, peer_timeout: float) -> list[str]:
    """S1, the peers this VM still needs a positive `ready` from before it may POST: every VM named in
    Resources but itself, the lower-ranked ones included (a takeover hands over the right to post,
    never the readiness of the peer taken over).

    Silence, an error or a wedge is never readiness. A higher-ranked peer's `ready`, once heard, stays
    (readiness is final, and a higher-ranked peer never posts while this VM leads). A lower-ranked
    peer's `ready` counts only while it answers: a lower-ranked peer that falls silent may be alive
    behind a one-way partition or a wedged server, leading and posting itself, so its old answer is no
    licence for a second POST (S2). Under `unreachable_peers: wait` a VM of rank > 0 therefore never
    posts; a silent leader means the event starts at NotBefore. `ignore` waives any peer silent for
    `peer_timeout`, lower-ranked included (the explicit opt-out of S1 and S2).
    """
    waiting = []
    for name in lower:
        peer = peers.get(name)
        if (peer is None or not peer.ready or peer.failing) and not waived(peer, now, unreachable_peers,
                                                                             peer_timeout):
            waiting.append(name)
    return waiting + not_ready(higher, peers, now, unreachable_peers, peer_timeout)


def silent_leaders(lower: Sequence[str], peers: Mapping[str, PeerState], now: float, takeover_after: float,
                   unreachable_peers: str, peer_timeout: float) -> list[str]:
    """The lower-ranked peers that make this VM the acting leader by their silence (all silent for
    `takeover_after`) yet hold its approval, because silence is never readiness: non-empty means no
    early approval unless they answer again (the event starts at NotBefore). Empty when some lower-ranked
    peer still answers (this VM does not lead) or every silent one is waived by `ignore`."""
    if not lower or lower_reachable(lower, peers, now, takeover_after):
        return []
    return readiness_missing(lower, [], peers, now, unreachable_peers, peer_timeout)


def split_ranks(resources: Sequence[str], vm_name: str) -> tuple[list[str], list[str]]:
    """The other VMs named, as (ranked before this VM, ranked after it); ([], others) when it is not named."""
    others = [r for r in resources if r.casefold() != vm_name.casefold()]
    rank = next((i for i, r in enumerate(resources) if r.casefold() == vm_name.casefold()), 0)
    return others[:rank], others[rank:]


def right_to_post(lower: Sequence[str], higher: Sequence[str], peers: Mapping[str, PeerState], now: float, *,
                  needs_readiness: bool, takeover_after: float, unreachable_peers: str,
                  peer_timeout: float) -> str | None:
    """None when this VM's peer knowledge gives it the right to post, else why not: it is the acting leader
    (every lower-ranked peer silent for `takeover_after`, or none) and, when the mode waits for the peers
    (`auto`; `needs_readiness`), S1 holds. The coordinator's decision and the approver's recheck right
    before every send both come here."""
    present = lower_reachable(lower, peers, now, takeover_after)
    if present:
        return f"not the leader: {', '.join(present[:5])} ranked before this VM"
    missing = readiness_missing(lower, higher, peers, now, unreachable_peers, peer_timeout) if needs_readiness \
        else []
    return f"waiting for peers: {', '.join(missing[:5])}" if missing else None


def may_post(lower: Sequence[str], higher: Sequence[str], peers: Mapping[str, PeerState], now: float, *,
             takeover_after: float, unreachable_peers: str, peer_timeout: float) -> bool:
    """Whether this VM's peer knowledge lets it POST in `auto` mode (its own readiness and the profile aside):
    it is the acting leader (every lower-ranked peer silent for `takeover_after`, or none) and S1 holds
    (`readiness_missing` is empty). The model checker calls this with every reachable knowledge."""
    return right_to_post(lower, higher, peers, now, needs_readiness=True, takeover_after=takeover_after,
                         unreachable_peers=unreachable_peers, peer_timeout=peer_timeout) is None
