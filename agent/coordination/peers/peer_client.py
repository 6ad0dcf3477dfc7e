"""Every HTTP call maintd makes to a peer or a gate: readiness asks, readiness pushes, health reads, Prometheus.

One keep-alive `requests.Session`, made at the first call (requests is several MB of memory a VM that
never has a multi-VM event need not pay), with `trust_env = False` (a proxy never sits between peers) and
no adapter-level retries: the coordinator's cadence is the retry. The shared bearer token goes
only with requests to peer URLs (which `addressing` built from the configured map, file or
template), never to Prometheus. Every exchange goes through `boundedhttp`: one deadline for the
whole exchange and a byte cap on the body, so a trickling or endless answer costs at most the
request timeout and the cap. Answers are parsed with `jsonsafe` (size and depth capped), and
anything unexpected is an answer of the wrong shape, never an exception for the caller.

What an ask means for the takeover rule: only silence (connection refused, a timeout, an answer
that did not end within the deadline) makes a peer unreachable. Any HTTP answer, a 503 or a garbled
body included, says the peer is alive, and not ready.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from agent.coordination.gate_http import MAX_ANSWER_BYTES, GateClient
from agent.coordination.peers.peer_addressing import event_url
from agent.errors import AnswerTooLarge
from agent.trust import jsonsafe

READY, NOT_READY, UNREACHABLE, INVALID = "ready", "not_ready", "unreachable", "invalid"
"""Outcomes of a readiness ask (the `outcome` label of maintd_peer_requests_total)."""


@dataclass(frozen=True)
class Answer:
    """A peer's answer to `GET /v1/events/{id}`: the outcome and a short readable detail."""

    outcome: str
    detail: str

    @property
    def ready(self) -> bool:
        return self.outcome == READY

    @property
    def reachable(self) -> bool:
        return self.outcome != UNREACHABLE


def readiness(status: int, body: bytes, name: str, rank: int) -> Answer:
    """What peer `name`'s answer means: ready only for a 200 whose JSON object says `"ready": true`
    and that the peer's own view of the event names it at `rank` (its place in the asker's Resources).

    Any other status is an answer of a live peer that is not ready (never `unreachable`: a leader
    answering 503 under load must not be taken over). An answer that names another VM (`vm_name`)
    is invalid, never ready: two peers given one URL (a copy-paste in a peers file, a port another
    agent holds) would otherwise let one VM's readiness stand for another's. A peer whose view does
    not name it (`names_self`) at that rank has prepared nothing for this event, so its `ready` is
    not counted.
    """
    if status == 404:
        return Answer(NOT_READY, "has not seen the event yet")
    if status != 200:
        return Answer(INVALID, f"answered {status}")
    try:
        parsed = jsonsafe.loads(body, max_bytes=MAX_ANSWER_BYTES)
    except ValueError as exc:
        return Answer(INVALID, f"answer is not JSON: {str(exc)[:80]}")
    if not isinstance(parsed, dict) or not isinstance(parsed.get("ready"), bool):
        return Answer(INVALID, 'answer has no "ready": true/false')
    answered_as = parsed.get("vm_name")
    if isinstance(answered_as, str) and answered_as.casefold() != name.casefold():
        return Answer(INVALID, f"answered as {answered_as[:64]!r}: another VM has this peer's address")
    if not parsed["ready"]:
        return Answer(NOT_READY, "preparing")
    if parsed.get("names_self") is not True or parsed.get("rank") != rank:
        shown = parsed.get("rank") if isinstance(parsed.get("rank"), int) else None
        return Answer(INVALID, f"says ready, but its view of the event does not name it at rank {rank} "
                               f"(names_self {parsed.get('names_self') is True}, rank {shown})")
    return Answer(READY, "ready")


class PeerClient(GateClient):
    """HTTP to peers and gates on one session (a `GateClient` with the peers' token); thread-safe."""

    def __init__(self, token_reader: Callable[[], str | None], timeout: float, pool_size: int) -> None:
        super().__init__(timeout, pool_size)
        self.token_reader = token_reader

    def _headers(self) -> dict[str, str]:
        token = self.token_reader()
        return {"Authorization": f"Bearer {token}"} if token else {}

    def ask(self, base: str, event_id: str, name: str, rank: int) -> Answer:
        """Whether peer `name`, at `base` and of `rank` in the event's Resources, is ready for the event."""
        try:
            r = self._exchange("GET", event_url(base, event_id), max_bytes=MAX_ANSWER_BYTES, headers=self._headers())
            return readiness(r.status, r.body, name, rank)
        except AnswerTooLarge as exc:  # it answered, at length: alive, and not ready
            return Answer(INVALID, str(exc))
        except (OSError, ValueError) as exc:  # silence: refused, timed out, no whole answer in time
            return Answer(UNREACHABLE, type(exc).__name__)
        except Exception as exc:  # whatever else the exchange raised, it is not a ready peer; asked again later
            return Answer(INVALID, f"{type(exc).__name__}: {str(exc)[:80]}")

    def push_ready(self, base: str, event_id: str, vm_name: str, health: str | None = None) -> bool:
        """Tell the peer at `base` (the acting leader) that this VM is ready, or (`health`) that its health changed
        since; True when it took the message."""
        body = {"vm": vm_name} if health is None else {"vm": vm_name, "health": health}
        try:
            r = self._exchange("POST", event_url(base, event_id, "/peer-ready"), max_bytes=MAX_ANSWER_BYTES,
                               truncate=True, json=body, headers=self._headers())
            return 200 <= r.status < 300
        except Exception:  # a push is retried until taken; nothing it met may stop the lane
            return False
