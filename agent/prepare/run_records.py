"""Pure rules over a handler's run and its stored record (`RunRecord`: `{"outcome", "attempt", "detail", ...}`):
what a run that returned, hung or was cut comes to, the attempt a record counts, whether an
interrupted run runs again (and why not), whether a scheduled-phase result still keeps the VM from
being ready, and the not-ready reason in words that say what to do. No I/O: the runner runs the
handlers and reads and writes the records; these decide.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, NotRequired, TypedDict

from agent.handlers.spec import HandlerSpec, Result
from agent.model.outcomes import CANCELED, FAILED, INTERRUPTED, OK, PHASES, RUNNING, SKIPPED, TIMED_OUT

_RUN_PREFIX = "handler:"
_ROUND_MARK = "#"

@dataclass(frozen=True)
class RunKey:
    """Where one handler's run in one phase of one round is recorded in the state store: `handler:<name>:<phase>`
    for the first round (the key every maintd wrote before rounds), `handler:<name>:<phase>#<round>` for a later
    one (the one place that builds or reads these keys). A round is one preparation of the event: a VM that lost
    its place in the disruption budget returned to rotation and prepares again in the next round."""

    handler: str
    phase: str
    round: int = 1

    def __str__(self) -> str:
        suffix = f"{_ROUND_MARK}{self.round}" if self.round > 1 else ""
        return f"{_RUN_PREFIX}{self.handler}:{self.phase}{suffix}"

    @staticmethod
    def parse(key: str) -> RunKey | None:
        """The run a state-store key names; None for any other record (approval, preparation, round)."""
        if not key.startswith(_RUN_PREFIX):
            return None
        handler, sep, phase = key[len(_RUN_PREFIX):].rpartition(":")
        phase, mark, number = phase.partition(_ROUND_MARK)
        rnd = 1 if not mark else int(number) if number.isascii() and number.isdigit() and len(number) < 6 else 0
        return RunKey(handler, phase, rnd) if sep and handler and phase in PHASES and rnd >= 1 else None


ROUND_KEY = "round"
"""The state store's record of an event's round (`{"round": n, "at", "reason", "restore": n - 1}`); none means the
first. `restore`: the round whose `completed` phase returns the VM to rotation (a lost place), recorded before it
starts: a restart runs it again (what already ran is skipped, an interrupted run goes again)."""


def round_of(results: dict[str, Any]) -> int:
    """The round an event's records say it is in (1 when they say nothing sensible)."""
    rec = results.get(ROUND_KEY)
    value = rec.get("round") if isinstance(rec, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else 1


def restoring(results: dict[str, Any]) -> int | None:
    """The round whose return to rotation (a lost place's `completed` phase) the records say is to run, if any."""
    rec = results.get(ROUND_KEY)
    value = rec.get("restore") if isinstance(rec, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and 1 <= value < round_of(results) else None


class RunRecord(TypedDict):
    """A handler's run as the runner records it at `RunKey`: `running`, its start and attempt; then how it ended.
    The readers below accept any shape: a record read back may come from an older maintd or a damaged file."""

    outcome: str
    started_at: str
    attempt: NotRequired[int]
    detail: NotRequired[str]
    duration_seconds: NotRequired[float]
    finished_at: NotRequired[str]
    on_failure: NotRequired[str]
    exit_code: NotRequired[int]
    output: NotRequired[str]
    """The tail of what the handler printed."""
    background: NotRequired[bool]
    """The run of a non-holding handler went on in the background past its first try (kept once it ended)."""


DETAIL_SHOWN = 200
"""Characters of a result's detail quoted in a not-ready reason."""
OUTPUT_TAIL = 4000
"""Characters of a run's output kept in its record (the tail)."""


def finished_record(result: Result, on_failure: str, duration: float, started_at: str, finished_at: str,
                    previous: dict[str, Any] | None) -> RunRecord:
    """The record of a run that ended, replacing its `running` one (`previous`: its attempt, and whether it went on
    in the background, are kept)."""
    record: RunRecord = {"outcome": result.outcome, "detail": result.detail, "duration_seconds": round(duration, 3),
                         "started_at": started_at, "finished_at": finished_at, "on_failure": on_failure}
    if previous is not None and "attempt" in previous:
        record["attempt"] = previous["attempt"]
    if previous is not None and previous.get("background") is True:
        record["background"] = True
    if result.exit_code is not None:
        record["exit_code"] = result.exit_code
    if result.output:
        record["output"] = result.output[-OUTPUT_TAIL:]
    return record


LEFT_THE_DOCUMENT = "the event left the document"
"""Why an event's work was cut, in its records and logs: the event is gone (the handlers' own words too)."""
PLACE_LOST = "its budget place was lost: back in rotation, queued again"
"""Why an event's work was cut: its place in the disruption budget was lost (B2); it prepares again once seated."""


def run_result(result: Result | None, event_gone: bool, stopping: bool, allowed: float,
               why: str = LEFT_THE_DOCUMENT) -> Result | None:
    """What a run comes to: its own result (None when it did not return within its budget); canceled
    when its work was cut meanwhile (`event_gone`, for `why`: the event left the document, or its budget place
    was lost) unless it ended ok; None (abandoned, settled at the next start) when maintd is stopping; otherwise
    timed out when it did not return."""
    if result is not None and result.outcome == OK:
        return result
    if event_gone:
        if result is None:
            return Result(CANCELED, f"{why}; the handler did not return and was abandoned")
        if result.outcome != CANCELED:
            return Result(CANCELED, f"{why} during the run ({result.outcome}: {result.detail})", result.exit_code,
                          result.output)
        return replace(result, detail=result.detail.replace(LEFT_THE_DOCUMENT, why))
    if stopping:
        return None
    return result or Result(TIMED_OUT, f"still running after {allowed:.0f}s; abandoned")


def attempt_of(record: dict[str, Any] | None) -> int:
    """The attempt a stored run record counts (1 when it says nothing sensible)."""
    value = record.get("attempt") if record else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else 1


def interrupted_verdict(spec: HandlerSpec | None, attempt: int, current: bool) -> tuple[bool, str]:
    """Whether a run found `running` at start runs again, and the detail recorded: only a configured
    handler, in the phase the event is still in, with `rerun_interrupted` and attempts left."""
    if spec is None:
        return False, "interrupted; the handler is no longer configured"
    if not current:
        return False, "interrupted; the event has moved on to another phase"
    if not spec.rerun_interrupted:
        return False, "interrupted; rerun_interrupted: false"
    if attempt < spec.max_attempts:
        return True, f"interrupted, attempt {attempt} of {spec.max_attempts}; runs again"
    return False, f"interrupted, attempt {attempt} of {spec.max_attempts}"


def blocks(record: dict[str, Any] | None, on_failure: str) -> bool:
    """Whether a scheduled-phase result keeps the VM from being ready: anything but ok, unless it
    ended, or goes on in the background past its first try, and the handler says `on_failure: continue`."""
    rec = record or {}
    outcome = rec.get("outcome")
    if on_failure == "continue" and (outcome in (FAILED, TIMED_OUT, SKIPPED, CANCELED)
                                     or (outcome == RUNNING and rec.get("background") is True)):
        return False
    return outcome != OK


def why_not_ready(name: str, record: dict[str, Any] | None, max_attempts: int, event_id: str) -> str:
    """What keeps one scheduled handler from counting as ready, in words that say what to do."""
    rec = record or {}
    outcome, attempt = rec.get("outcome"), attempt_of(rec)
    if outcome is None:
        return f"{name} has not run yet"
    if outcome == RUNNING:
        return f"{name} is running (attempt {attempt} of {max_attempts}, since {rec.get('started_at', '?')})"
    if outcome == INTERRUPTED:
        return f"{name} was interrupted (attempt {attempt} of {max_attempts}); it runs again"
    detail = str(rec.get("detail") or "")[:DETAIL_SHOWN]
    return (f"{name} {str(outcome).replace('_', ' ')}" + (f" ({detail})" if detail else "")
            + f"; on_failure: block — approve by hand with `maintd approve {event_id}`")
