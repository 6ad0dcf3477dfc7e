"""A handler that never holds preparation (`on_failure: continue`) gets a short first try, then goes on in the
background while the drain and the hooks after it keep their time; a `before_drain` handler (the silence) runs
right before the drain whatever the order. The runner on the injected clock: no test waits for time to pass."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest

from agent.clock import SystemClock
from agent.handlers.base import FAILED, OK, Context, Handler, HandlerSpec, Result, Services, Settings
from agent.health.health_store import HealthStore
from agent.health.rotation import Rotation
from agent.model.events import Event
from agent.model.outcomes import RUNNING
from agent.model.tracker import Tracked, Transition
from agent.prepare.handler_runner import Runner
from agent.prepare.readiness import Readiness
from agent.prepare.run_order import FIRST_TRY
from agent.prepare.run_records import RunKey
from agent.state.state_store import Store
from agent.telemetry.metrics import Metrics
from tests.e2e.harness import wait_until

LB_WAIT = 11.0


class Script:
    """What the handlers did, and the gate a `stuck` handler waits at (a helper refusing or hanging)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.budgets: dict[str, float] = {}
        self.leaving: dict[str, bool] = {}
        self.stuck: set[str] = set()
        self.release = threading.Event()
        self.entered = threading.Event()
        self.lock = threading.Lock()


SCRIPT = Script()


class Recorder(Handler):
    type_name = "recorder"

    def _do(self, ctx: Context) -> Result:
        with SCRIPT.lock:
            SCRIPT.calls.append((self.spec.name, ctx.phase))
            SCRIPT.budgets[f"{self.spec.name}:{ctx.phase}"] = ctx.timeout
            SCRIPT.leaving[f"{self.spec.name}:{ctx.phase}"] = ctx.leaving_rotation
        if self.spec.name in SCRIPT.stuck:
            SCRIPT.entered.set()
            SCRIPT.release.wait(30)  # real time only if the runner wrongly waits for it; released by the test
            return Result(FAILED, "the helper never answered")
        return Result(OK)

    scheduled = started = completed = _do


class DrainLike(Recorder):
    leaves_rotation = ("scheduled", "started")


class SilenceLike(Recorder):
    before_drain = True


@pytest.fixture(autouse=True)
def _fresh():
    global SCRIPT
    SCRIPT = Script()
    yield
    SCRIPT.release.set()


def make(tmp_path, clock, *handlers: tuple[type[Handler], HandlerSpec]):
    store = Store(tmp_path, clock)
    health = HealthStore(clock)
    services = Services(clock=clock, store=store, metrics=Metrics(), rotation=Rotation(store, health, ["*"]),
                        health=health, settings=Settings(vm_name="vm1"))
    return Runner([cls(spec, services) for cls, spec in handlers], services), store


def spec(name: str, phases=("scheduled",), **kw) -> HandlerSpec:
    return HandlerSpec(name=name, type="recorder", phases=tuple(phases), **kw)


def reboot(clock, seconds: float = 45.0) -> Event:
    return Event("E1", "Reboot", "Scheduled", ("vm1",), not_before=clock.now() + timedelta(seconds=seconds))


def started_in_order(logs, phase: str) -> list[str]:
    """The handlers in the order the runner started them in `phase` (its log, written on the phase's lane)."""
    return [entry["handler"] for entry in logs if entry["event"] == "handler.started" and entry["phase"] == phase]


def test_a_silence_that_cannot_be_made_costs_the_drain_only_its_first_try(tmp_path, clock, logs):
    """Alertmanager refusing or hanging, a Reboot 45 s away: the silence (39 s budget) gets its first try, the drain
    then starts with its whole budget and the VM is ready once it is done, while the silence goes on trying."""
    SCRIPT.stuck.add("silence")
    runner, store = make(tmp_path, clock, (SilenceLike, spec("silence", timeout=39.0, on_failure="continue")),
                         (DrainLike, spec("drain", timeout=LB_WAIT + 5)), (Recorder, spec("hook", timeout=10.0)))
    e = reboot(clock)
    t0 = clock.monotonic()
    runner.submit(Transition("appeared", e, True, clock.now()))
    wait_until(lambda: any(entry["event"] == "handler.finished" and entry["handler"] == "hook" for entry in logs), 10,
               "the hook after the drain to finish")
    assert started_in_order(logs, "scheduled") == ["silence", "drain", "hook"]
    assert SCRIPT.budgets["drain:scheduled"] == LB_WAIT + 5 and SCRIPT.budgets["hook:scheduled"] == 10.0
    assert clock.monotonic() - t0 == pytest.approx(FIRST_TRY), "the phase waited for the first try only"
    rec = store.result("E1", str(RunKey("silence", "scheduled")))
    assert rec["outcome"] == RUNNING and rec["background"] is True
    ready = Readiness.of(runner).is_ready(Tracked(e, True, clock.now(), "b", False))
    assert ready, "readiness never waits on the background"
    assert any(entry["event"] == "handler.background" and entry["handler"] == "silence" for entry in logs)

    SCRIPT.release.set()  # the helper answers at last (here: still failing)
    assert runner.wait_idle(10)
    rec = store.result("E1", str(RunKey("silence", "scheduled")))
    assert rec["outcome"] == FAILED and rec["background"] is True, "its end is recorded like any run's"


def test_a_holding_handler_is_waited_for_and_a_quick_one_is_not_sent_to_the_background(tmp_path, logs):
    """on_failure: block keeps the phase (and readiness) until it ends; a non-holding run that returns within its
    first try is an ordinary run (the real clock: its first try is real seconds, the run takes none)."""
    clock = SystemClock()
    runner, store = make(tmp_path, clock, (Recorder, spec("quick", on_failure="continue")),
                         (Recorder, spec("checkpoint", timeout=30.0)))
    SCRIPT.stuck.add("checkpoint")
    e = reboot(clock, 120)
    runner.submit(Transition("appeared", e, True, clock.now()))
    assert SCRIPT.entered.wait(10)
    assert not Readiness.of(runner).is_ready(Tracked(e, True, clock.now(), "b", False)), "a holding run holds readiness"
    assert store.result("E1", str(RunKey("checkpoint", "scheduled")))["outcome"] == RUNNING
    SCRIPT.release.set()
    assert runner.wait_idle(10)
    assert store.result("E1", str(RunKey("quick", "scheduled"))).get("background") is None
    assert not [entry for entry in logs if entry["event"] == "handler.background"]
    pending = Readiness.of(runner).pending(Tracked(e, True, clock.now(), "b", False))
    assert pending == ["checkpoint"], "it failed, and holds"


@pytest.mark.parametrize("listed", [("drain", "silence"), ("silence", "drain"), ("hook", "drain", "silence")])
def test_the_silence_runs_right_before_the_drain_whatever_the_order(tmp_path, clock, logs, listed):
    """The drain listed first (a natural order) no longer leaves the VM out of rotation before any silence: the
    silence runs right before it, told that the VM leaves rotation next; hooks keep their place."""
    kinds = {"drain": (DrainLike, spec("drain", phases=("scheduled", "completed"))),
             "silence": (SilenceLike, spec("silence", phases=("scheduled", "completed"), on_failure="continue")),
             "hook": (Recorder, spec("hook"))}
    runner, _ = make(tmp_path, clock, *(kinds[name] for name in listed))
    e = reboot(clock, 600)
    runner.submit(Transition("appeared", e, True, clock.now()))
    assert runner.wait_idle(10)
    assert started_in_order(logs, "scheduled") == [n for n in listed if n == "hook"] + ["silence", "drain"]
    assert SCRIPT.leaving == {f"{n}:scheduled": n == "silence" for n in listed}
    runner.submit(Transition("vanished", e, True, clock.now(), "Scheduled", "completed"))
    assert runner.wait_idle(10)
    assert started_in_order(logs, "completed") == [n for n in listed if n != "hook"], \
        "no drain in completed: the list's order"


def test_a_later_phase_of_a_handler_waits_for_its_background_run_and_the_others_do_not(tmp_path, clock):
    """Approved early while the silence still tries: its started run comes after its scheduled one (never two runs
    of one handler for one event at once); the phase's other handlers run meanwhile."""
    SCRIPT.stuck.add("silence")
    runner, store = make(tmp_path, clock,
                         (SilenceLike, spec("silence", phases=("scheduled", "started"), on_failure="continue")),
                         (Recorder, spec("flush", phases=("started",))))
    e = reboot(clock, 600)
    runner.submit(Transition("appeared", e, True, clock.now()))
    assert SCRIPT.entered.wait(10)
    started = Event("E1", "Reboot", "Started", ("vm1",))
    runner.submit(Transition("status_changed", started, True, clock.now(), "Scheduled"))
    wait_until(lambda: store.result("E1", str(RunKey("flush", "started"))), 10, "the flush to run")
    assert ("silence", "started") not in SCRIPT.calls, "its started run waits for its scheduled one"
    SCRIPT.stuck.clear()
    SCRIPT.release.set()
    assert runner.wait_idle(10)
    assert SCRIPT.calls.index(("silence", "scheduled")) < SCRIPT.calls.index(("silence", "started"))
    assert store.result("E1", str(RunKey("silence", "started")))["outcome"] == OK


def test_an_event_that_leaves_cuts_the_background_run_too(tmp_path, clock, logs):
    """The event canceled while the silence tries in the background: the cut reaches it (logged), completed runs."""
    SCRIPT.stuck.add("silence")
    runner, store = make(tmp_path, clock,
                         (SilenceLike, spec("silence", phases=("scheduled",), on_failure="continue")),
                         (Recorder, spec("undo", phases=("completed",))))
    e = reboot(clock, 600)
    runner.submit(Transition("appeared", e, True, clock.now()))
    assert SCRIPT.entered.wait(10)
    wait_until(lambda: store.result("E1", str(RunKey("silence", "scheduled"))).get("background"), 10,
               "the silence's run to go on in the background")
    runner.submit(Transition("vanished", e, True, clock.now(), "Scheduled", "canceled"))
    assert any(entry["event"] == "handler.canceling" and entry["handler"] == "silence" for entry in logs)
    SCRIPT.release.set()
    assert runner.wait_idle(10)
    assert store.result("E1", str(RunKey("silence", "scheduled")))["outcome"] == "canceled"
    assert ("undo", "completed") in SCRIPT.calls


def test_the_budget_counts_a_non_holding_handlers_first_try_only(tmp_path, clock):
    """What preparation needs before NotBefore (the disruption budget's last safe moment): the drain's wait, a
    holding hook's whole timeout, a silence's first try (its retries go on in the background, not in the phase)."""
    from agent.config.config import loads
    from agent.loop.daemon import Daemon
    from agent.loop.fleet_pass import preparation_needs
    from agent.systemd import Notifier

    cfg = loads(f"identity: {{name: vm1}}\nstate: {{dir: {tmp_path}}}\nimds: {{endpoint: 'http://127.0.0.1:9'}}\n"
                "probe: {lb_timeout: 11s, lb_interval: 5s, drain_grace: 0s}\nhandlers:\n"
                "  - {name: drain, type: drain, phases: [scheduled, completed]}\n"
                "  - {name: silence, type: alertmanager, phases: [scheduled], timeout: 1m, urls: ['http://am:9093'],"
                " matchers: ['instance=\"{vm}\"']}\n"
                "  - {name: notify, type: webhook, phases: [scheduled], timeout: 20s, url: 'http://hook:80/x'}\n")
    d = Daemon(cfg, clock, boot_id="boot-1", notifier=Notifier({}))
    try:
        assert preparation_needs(d.parts.services.settings, d.config.handlers) == LB_WAIT + FIRST_TRY + 20.0
    finally:
        d.shutdown()
