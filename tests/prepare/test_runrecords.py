"""The pure rules over a handler's run: what a run comes to, whether an interrupted one runs again,
what keeps the VM from being ready — the words an operator reads in `maintd status` and the journal."""

from __future__ import annotations

import pytest

from agent.handlers.base import HandlerSpec, Result
from agent.model.outcomes import CANCELED, FAILED, OK, TIMED_OUT
from agent.prepare.run_records import PLACE_LOST, RunKey, blocks, interrupted_verdict, run_result, why_not_ready

SPEC = HandlerSpec(name="drain", type="drain", phases=("scheduled",), max_attempts=3)


@pytest.mark.parametrize("spec, attempt, current, again, detail", [
    (SPEC, 1, True, True, "interrupted, attempt 1 of 3; runs again"),
    (SPEC, 3, True, False, "interrupted, attempt 3 of 3"),
    (SPEC, 1, False, False, "interrupted; the event has moved on to another phase"),
    (None, 1, True, False, "interrupted; the handler is no longer configured"),
    (HandlerSpec(name="x", type="exec", phases=("scheduled",), rerun_interrupted=False), 1, True, False,
     "interrupted; rerun_interrupted: false"),
])
def test_an_interrupted_run_goes_again_only_while_it_can(spec, attempt, current, again, detail):
    """Again only for a configured handler, in the event's phase, with rerun_interrupted and attempts left."""
    assert interrupted_verdict(spec, attempt, current) == (again, detail)


@pytest.mark.parametrize("outcome, on_failure, blocking", [
    (None, "continue", True), (OK, "block", False), (FAILED, "block", True), (FAILED, "continue", False),
    (TIMED_OUT, "continue", False), ("running", "continue", True),
])
def test_what_keeps_the_vm_from_being_ready(outcome, on_failure, blocking):
    """Anything but ok blocks, unless the run ended and the handler says on_failure: continue."""
    assert blocks({"outcome": outcome} if outcome else None, on_failure) is blocking


def test_the_not_ready_reason_says_what_to_do():
    """A failed blocking handler names its detail and the command that approves by hand."""
    assert why_not_ready("drain", {"outcome": FAILED, "detail": "lb said no"}, 3, "E1") == \
        "drain failed (lb said no); on_failure: block — approve by hand with `maintd approve E1`"


def test_a_run_comes_to_its_result_or_canceled_or_abandoned_or_timed_out():
    """ok stands; a gone event cancels; a stop abandons (settled at restart); a hung run times out."""
    ok, failed = Result(OK, "done"), Result(FAILED, "exit 1", 1)
    assert run_result(ok, True, True, 60) is ok, "an ok run stands, whatever happened meanwhile"
    assert run_result(failed, True, False, 60).outcome == CANCELED
    assert run_result(None, True, False, 60).detail == \
        "the event left the document; the handler did not return and was abandoned"
    assert run_result(failed, False, True, 60) is None, "stopping: settled at the next start"
    assert run_result(None, False, False, 60) == Result(TIMED_OUT, "still running after 60s; abandoned")
    assert run_result(failed, False, False, 60) is failed


def test_a_run_cut_by_a_lost_budget_place_says_so_and_not_that_the_event_left() -> None:
    """The record (and `maintd events ID`) of a run cut because the VM's budget place was lost: why, in its words."""
    hook = Result(CANCELED, "the event left the document: the hook's process group got SIGTERM; it exited", -15)
    for got in (hook, Result(FAILED, "exit 1", 1), None):
        result = run_result(got, True, False, 60, PLACE_LOST)
        assert result is not None and result.outcome == CANCELED
        assert "its budget place was lost: back in rotation, queued again" in result.detail
        assert "left the document" not in result.detail


def test_a_run_key_reads_back_what_it_writes_and_nothing_else():
    """Run records are found by their key alone: handler names with colons survive; approval and
    preparation records, unknown phases and empty names are not runs."""
    for run in (RunKey("drain", "scheduled"), RunKey("ckpt:db", "completed")):
        assert RunKey.parse(str(run)) == run
    assert str(RunKey("drain", "scheduled")) == "handler:drain:scheduled"  # the state file's format
    for other in ("approval", "preparation", "handler:x:later", "handler::scheduled", "handler:scheduled",
                  "round", "handler:x:scheduled#", "handler:x:scheduled#0", "handler:x:scheduled#two"):
        assert RunKey.parse(other) is None
    for run in (RunKey("drain", "scheduled", 2), RunKey("ckpt:db", "completed", 17)):
        assert RunKey.parse(str(run)) == run  # a later round of the event (a lost budget place)
    assert str(RunKey("drain", "scheduled", 1)) == "handler:drain:scheduled"


def test_a_non_holding_run_in_the_background_does_not_keep_the_vm_from_being_ready():
    """Past its first try, a continue handler's run goes on in the background: readiness does not wait for it; a
    blocking handler's run, or one still in its first try, does."""
    assert blocks({"outcome": "running", "background": True}, "continue") is False
    assert blocks({"outcome": "running", "background": True}, "block") is True
    assert blocks({"outcome": "running"}, "continue") is True
