"""A lost budget place's return to rotation (`Runner.restore`) after a kill -9 (issue 34's follow-ups): maintd died
right after the place was lost, the cut scheduled run still `running` on disk and the return not started. The
restart's restore settles that run (it will not run again: the event is to be prepared anew in the next round)
and runs the round's `completed` phase: nothing is left `running` for good (`maintd events` would say so, and the
event would never count as ended for this VM)."""

from __future__ import annotations

from agent.handlers.base import FAILED, OK
from agent.model.outcomes import RUNNING
from agent.prepare.run_records import ROUND_KEY, RunKey
from tests.prepare.test_runner import CALLS, Recorder, ev, make, spec


def test_a_restore_after_a_crash_settles_the_cut_run_and_runs_the_rounds_completed_phase(tmp_path, clock):
    CALLS.clear()  # the runner tests' recorder, shared
    Recorder.behaviour = {}
    runner, store, _ = make(tmp_path, clock, spec("a"), spec("c", phases=("completed",)))
    store.record("E1", str(RunKey("a", "scheduled")), {"outcome": RUNNING, "attempt": 1})
    store.record("E1", str(RunKey("c", "completed")), {"outcome": RUNNING, "attempt": 1})
    store.record("E1", ROUND_KEY, {"round": 2, "restore": 1})
    runner.restore(ev(clock=clock), True, 1)
    assert runner.wait_idle(5)
    assert CALLS == [("c", "completed", "E1")], "the return to rotation ran again, the cut run did not"
    results = store.results("E1")
    assert results[str(RunKey("c", "completed"))]["outcome"] == OK
    assert results[str(RunKey("c", "completed"))]["attempt"] == 2
    assert results[str(RunKey("a", "scheduled"))]["outcome"] == FAILED
    assert not [k for k, r in results.items() if r.get("outcome") == RUNNING]
    CALLS.clear()
    runner.restore(ev(clock=clock), True, 1)  # the next restart: nothing left to do
    assert runner.wait_idle(5) and CALLS == []
