"""S1 and S2 hold in every reachable state of both backends: three VMs, every interleaving, one fault of
any kind per path (crash and restart, pause, lost answer, lost message, odd record, restart, IMDS 500, and
on the peers a wedged server), the real decision functions deciding (see tests/model/*_model.py for what
each step calls). On the store, a pause the claimer's monotonic clock does not count runs on its own: the claim
fence holds there, S2 does not (the xfail below, a finding).

A failure prints the shortest counterexample: the numbered steps from the start to the broken promise.
The figures (states, time) go to bench/results/model_check.json through `python -m bench model`.
"""

from __future__ import annotations

import pytest

from agent.coordination import coordination_rules
from agent.coordination.approver import Approver
from agent.coordination.coordination_rules import not_ready
from agent.coordination.peers import peer_backend
from agent.coordination.store import store_claim
from agent.coordination.store.store_claim import StoreClaims
from agent.fleet.budget_rules import CHOSEN
from tests.model.budget_model import OUT, BudgetModel, dead_place_taken_over, granted_unnoticed
from tests.model.common import FREEZE, LOST_ANSWER, PAUSE, POST_ERROR
from tests.model.explorer import Result, explore
from tests.model.peer_model import PeerModel
from tests.model.store_model import StoreModel

POSTED = {"a POST": lambda s: bool(s.imds.posted_by)}
PAIRED = (PAUSE, POST_ERROR, LOST_ANSWER)
"""The faults the two-fault run combines: a pause with a failed or lost POST."""


@pytest.fixture(scope="module")
def peers() -> Result:
    result = explore(PeerModel(), outcomes=POSTED)
    print(f"\npeers: {result.figures()}")
    return result


@pytest.fixture(scope="module")
def store() -> Result:
    result = explore(StoreModel(), outcomes=POSTED)
    print(f"\nstore: {result.figures()}")
    return result


@pytest.fixture(scope="module")
def frozen() -> Result:
    result = explore(StoreModel(kinds=(FREEZE,)), outcomes=POSTED)
    print(f"\nstore, a frozen monotonic clock: {result.figures()}")
    return result


def holds(result: Result, prop: str) -> None:
    found = result.violations.get(prop)
    assert found is None, f"{result.model} model:\n{found.render() if found else ''}"


def test_the_search_is_complete_and_reaches_a_post(peers: Result, store: Result):
    """Every reachable state was visited, and some of them POST (a model that never approves proves nothing)."""
    for result in (peers, store):
        assert result.complete and result.states > 1000
        assert result.reached.get("a POST", 0) > 0


def test_peers_s1_no_post_before_every_vm_said_ready(peers: Result):
    """Peer backend: no POST while any VM named has not said it is ready, whoever is silent and why."""
    holds(peers, "S1")


def test_peers_s2_one_vm_posts(peers: Result):
    """Peer backend: at most one VM POSTs, also when the leader is paused between its decision and its send."""
    holds(peers, "S2")


def test_store_s1_no_post_before_every_vm_said_ready(store: Result):
    """Store backend: no POST while any VM named has no readable `ready` marker."""
    holds(store, "S1")


def test_store_s2_one_vm_posts(store: Result):
    """Store backend: at most one VM POSTs, also when the claimer is paused past takeover_after and resumes; and no
    VM POSTs under a claim the store's record no longer holds (the fence)."""
    holds(store, "S2")
    holds(store, "fence")


def test_store_a_frozen_claimer_never_posts_under_a_claim_taken_over(frozen: Result):
    """Store backend, a pause the claimer's monotonic clock does not count (a suspend, a hypervisor freeze) while
    another VM takes the claim over: the order's deadline cannot see it, the recheck's read of the record withholds
    the POST (the fence); S1 and the records hold too."""
    assert frozen.complete and frozen.reached.get("a POST", 0) > 0
    for prop in ("S1", "records", "fence"):
        holds(frozen, prop)


def test_store_s2_with_a_frozen_claimer(frozen: Result):
    """Store backend: at most one VM POSTs when the claimer's monotonic clock stops during a pause. Its deadline
    says no time passed; the recheck finds the claim `takeover_after` old on the store's clock and withholds it."""
    holds(frozen, "S2")


def test_the_checker_finds_the_recheck_that_trusts_the_etag_alone(monkeypatch: pytest.MonkeyPatch):
    """The checker is not blind to the first finding of the freeze: with the recheck as it shipped (the record's
    ETag, not its age on the store's clock) a claimer frozen past takeover_after POSTs, and so does its taker."""
    monkeypatch.setattr(store_claim, "age_of", lambda item, date: 0.0)
    result = explore(StoreModel(kinds=(FREEZE,)), outcomes=POSTED)
    found = result.violations.get("S2")
    assert found is not None, "the checker did not find the ETag-only recheck broken"
    assert "is frozen, its monotonic clock stopped" in found.render()


def test_store_records_of_any_shape_never_raise(store: Result):
    """Store backend: an odd approval record or marker is a problem to report, never an exception."""
    holds(store, "records")


def test_store_a_pause_inside_the_retry_backoff_after_an_imds_500():
    """Store backend, two faults on one path (the issue's run: the claimer's first POST gets a 500 and the pause
    falls in its retry backoff; or a lost answer and a pause): still one VM POSTs, none early."""
    result = explore(StoreModel(max_faults=2, kinds=PAIRED), outcomes=POSTED)
    print(f"\nstore, two of {PAIRED}: {result.figures()}")
    for prop in ("S1", "S2"):
        holds(result, prop)


def test_the_checker_finds_a_leader_whose_silence_waives_its_readiness(monkeypatch: pytest.MonkeyPatch):
    """The checker is not blind: with the old rule (only higher-ranked peers need to be ready) it finds S1 broken
    by a paused leader, and prints the steps."""
    def old_rule(lower, higher, peers, now, unreachable_peers, peer_timeout):
        return not_ready(higher, peers, now, unreachable_peers, peer_timeout)

    monkeypatch.setattr(peer_backend, "readiness_missing", old_rule)  # the decision
    monkeypatch.setattr(coordination_rules, "readiness_missing", old_rule)  # the recheck before the send
    result = explore(PeerModel(kinds=(PAUSE,)))
    assert "S1" in result.violations
    trace = result.violations["S1"].render()
    assert "FAULT vm-a is paused" in trace and "POSTs StartRequests" in trace


def test_the_checker_finds_a_paused_claimer_posting_again(monkeypatch: pytest.MonkeyPatch):
    """The checker is not blind: without the recheck before each send it finds S2 broken by a paused claimer."""
    monkeypatch.setattr(Approver, "lapsed", lambda self, order, deadline: None)
    result = explore(StoreModel(kinds=(PAUSE,)))
    assert "S2" in result.violations
    assert "is paused" in result.violations["S2"].render()


def test_the_checker_finds_a_frozen_claimer_posting_after_a_takeover(monkeypatch: pytest.MonkeyPatch):
    """The checker sees what the recheck's read of the record saves: with the claim recheck always holding
    (`StoreClaims.holds` answers None; the pause alone still passes, the order's deadline catches it), a claimer
    frozen with its monotonic clock stopped resumes after another VM took the claim over, and POSTs under it."""
    monkeypatch.setattr(StoreClaims, "holds", lambda self, event_id, within: None)
    result = explore(StoreModel(kinds=(FREEZE,)))
    assert {"fence", "S2"} <= set(result.violations), list(result.violations)
    steps = result.violations["fence"].steps
    frozen = next(n for n, label in enumerate(steps) if "is frozen" in label)
    taken = next(n for n, label in enumerate(steps) if "takes over" in label and label.endswith(": won"))
    resumed = next(n for n, label in enumerate(steps) if label.endswith(" resumes"))
    assert frozen < taken < resumed and "POSTs StartRequests" in steps[-1], result.violations["fence"].render()


@pytest.mark.parametrize("cap, spread", [(1, "none"), (2, "zone")])
def test_budget_b1_never_more_than_max_unavailable_out_by_choice(cap: int, spread: str):
    """Three members racing for `cap` places through one record (read, then If-Match write), one of them forced
    at any time, back and released, each release handing its place to the next in line in the same write, one
    member dying before it is out: never more than `cap` out by choice (a place handed over counts at once),
    never two zones with spread zone, and a place handed to a member that never notices is freed after
    release_after and taken by another."""
    result = explore(BudgetModel(cap, spread), outcomes={
        "out by choice": lambda s: any(m.why == CHOSEN and m.phase == OUT for m in s.members),
        "handed over, not yet noticed": granted_unnoticed, "a dead member's place taken over": dead_place_taken_over})
    print(f"\n{result.model}: {result.figures()}")
    assert result.complete and all(result.reached.get(k, 0) > 0 for k in (
        "out by choice", "handed over, not yet noticed", "a dead member's place taken over")), result.reached
    holds(result, "B1")
    holds(result, "B3")


def test_the_checker_finds_a_budget_written_without_if_match():
    """The same members writing the record blindly (no If-Match): the checker finds two out by choice."""
    result = explore(BudgetModel(1, "none", blind=True), max_states=20_000)
    assert "B1" in result.violations
