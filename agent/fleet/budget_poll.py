"""B4, the handoff needs no traffic between members, pure: how often a waiting member reads the places record.

A release seats the next members in the releaser's own write (`budget_rules.grant`); nobody tells them. The
members a write could seat next read the record every HEAD_POLL_S, with a conditional read (If-None-Match on the
ETag last seen: a 304 has no body), so a release reaches them within about a second whatever happens to hints.
Who could be seated next: in line order, the first `head = min(cap, HEAD_MAX)` waiters of the topology bucket
that may go next, where a bucket is the whole group (`spread: none`) or one zone (fault domain), and the bucket
that may go next is the holders' own (a release there seats its waiters) or, once it has no waiter left (its
holders can only come back now) or nobody holds a place, the first waiter's too (the last holder back seats its
bucket's waiters). One write seats at most `cap` members, so a head of `cap` covers any one write.

The rest read less often the further back they are: `rounds = rank // head` places behind the head, every
ROUND_POLL_S x rounds, at most `fallback_poll` (and release_after / 4, so an entry never lapses). A member moves
forward only as members ahead of it are seated and come back; as long as a member holds its place longer than
2 x ROUND_POLL_S (a drain, a reboot), a member reads again before the line could have moved past it, so it is in
the head by the time a write can seat it. Wake hints stay, as an accelerator only.

`blob_rate` is the cost on the one record, per second, that the defaults are held to: under 10 % of Azure's
per-blob target of 500 requests/s at 1000 members (`RATE_TARGET`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime

from agent.coordination.coordination_settings import BudgetConfig
from agent.fleet.budget_rules import Entry, Places, capacity

HEAD_POLL_S = 1.0
"""Seconds between two reads of a member a write could seat next."""
HEAD_MAX = 20
"""The most members of one bucket that read every HEAD_POLL_S (the cost of B4 at a large cap)."""
ROUND_POLL_S = 15.0
"""Seconds between two reads per round of `head` members ahead of the reader, beyond the head."""
RATE_TARGET = 50.0
"""Requests per second on one blob the budget keeps under: 10 % of Azure's per-blob target of 500."""


def _bucket(entry: Entry, spread: str) -> str:
    return entry.zone if spread == "zone" else entry.fault_domain if spread == "fault_domain" else ""


def _line(places: Places) -> list[Entry]:
    return sorted(places.waiting, key=lambda e: (e.since, e.vm))


def standing(places: Places, vm: str, spread: str) -> tuple[int, bool] | None:
    """`vm`'s rank among the waiters of its bucket (0: first) and whether its bucket may go next (the holders'
    bucket, or the first waiter's); None when it is not waiting."""
    line = _line(places)
    me = next((w for w in line if w.vm.casefold() == vm.casefold()), None)
    if me is None:
        return None
    mine = _bucket(me, spread)
    rank = sum(1 for w in line if _bucket(w, spread) == mine and (w.since, w.vm) < (me.since, me.vm))
    nexts = {_bucket(h, spread) for h in places.holders}
    if not any(_bucket(w, spread) in nexts for w in line):  # the holders' bucket has nobody left to seat
        nexts.add(_bucket(line[0], spread))
    return rank, spread == "none" or mine in nexts


def head_size(cap: int) -> int:
    return max(1, min(cap, HEAD_MAX))


def poll_after(places: Places | None, vm: str, cap: int, spread: str, fallback_poll: float,
               release_after: float) -> float:
    """Seconds until a waiting member reads the record again (B4)."""
    longest = min(fallback_poll, release_after / 4)
    found = standing(places, vm, spread) if places is not None else None
    if found is None:
        return min(HEAD_POLL_S, longest)  # not listed yet (its entry is being written): look again soon
    rank, next_up = found
    rounds = rank // head_size(cap)
    if rounds == 0 and next_up:
        return min(HEAD_POLL_S, longest)
    return min(ROUND_POLL_S * max(1, rounds), longest)


def waiter_poll(config: BudgetConfig, places: Places | None, vm: str) -> float:
    """`poll_after` for a member of this budget, its capacity taken over the record's live members."""
    cap = capacity(config.max_unavailable, len(places.members) if places is not None else 1)
    return poll_after(places, vm, cap, config.spread, config.fallback_poll, config.release_after)


def time_left(not_befores: Iterable[datetime | None], now: datetime) -> float | None:
    """Seconds to the earliest of these NotBefores (None: none known): how much of a Retry-After is affordable."""
    at = min((nb for nb in not_befores if nb is not None), default=None)
    return None if at is None else (at - now).total_seconds()


class Every:
    """Due once every `interval` seconds of a monotonic clock, the first time `interval` after `start`."""

    def __init__(self, interval: float, start: float) -> None:
        self.interval, self.at = interval, start + interval

    def due(self, now: float) -> bool:
        if now < self.at:
            return False
        self.at = now + self.interval
        return True


@dataclass(frozen=True)
class Load:
    """A group's shape for `blob_rate`: how many members, how many of them wait, in how many buckets."""

    members: int
    waiting: int
    holders: int
    buckets: int = 1


def blob_rate(load: Load, cap: int, fallback_poll: float, release_after: float, member_ttl: float) -> float:
    """Requests per second on the places record (reads, 304s included, and writes): the waiters' polls (head and
    rounds), their entries' renewals (a write every release_after / 4), the holders' renewals (a read and a
    write as often), and the idle members' stamps (a read and a write every member_ttl / 3). One bucket's waiters
    poll at the head's rate (the holders' while it has waiters, else the first waiter's: `standing`); the
    waiters spread evenly over `buckets`."""
    head = head_size(cap)
    per_bucket = load.waiting / max(1, load.buckets)
    polls = 0.0
    for b in range(max(1, load.buckets)):
        next_up = b == 0
        for rank in range(round(per_bucket)):
            rounds = rank // head
            wait = HEAD_POLL_S if rounds == 0 and next_up else ROUND_POLL_S * max(1, rounds)
            polls += 1.0 / min(wait, fallback_poll, release_after / 4)
    renew = release_after / 4
    idle = max(0, load.members - load.waiting - load.holders)
    return polls + load.waiting / renew + 2.0 * load.holders / renew + 2.0 * idle / (member_ttl / 3)


def worst_rates(members: Sequence[int], cap_share: float, buckets: int, fallback_poll: float, release_after: float,
                member_ttl: float) -> dict[int, float]:
    """`blob_rate` with every member not holding a place waiting, for each group size (the figure the defaults
    are checked against)."""
    out = {}
    for n in members:
        cap = max(1, int(n * cap_share))
        out[n] = blob_rate(Load(n, n - cap, cap, buckets), cap, fallback_poll, release_after, member_ttl)
    return out
