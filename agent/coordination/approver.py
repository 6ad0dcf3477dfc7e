"""The approval worker: one approval after another on a thread of its own, so the loop never waits on
Prometheus, a peer, the store or IMDS. Each approval is one sequence, read top-down in `Approver._run`:

1. decide (pure): the loop decided (`approval_policy.decide` in `Coordinator.tick`) and sent an `Order`;
   the gates (`approval_gates`) may still hold it;
2. take the right to post: `Backend.take_right` (on the store, the claim; the peers grant it as decided);
3. recheck (S2, at most one POST per event), immediately before every send, the first and each retry
   (`Approver.lapsed`): the order's deadline on the monotonic clock, set when the loop granted the right (a
   process paused past it sends nothing); the coordinator's check (`still_right`: the event still Scheduled
   in this VM's last poll, under a budget this VM's place within its lease); the backend's
   (`Backend.right_to_post`: on the peers still the acting leader with every VM ready, on the store the
   claim still holds). A lapsed right ends the order with `approval.withheld`; the loop decides again
   after a fresh poll;
4. send: POST StartRequests to IMDS (`approve`: the IMDS client in force), retried with backoff;
5. record: `sending` in the state store before the first send, `sent` or `failed` after the last (a
   restart never re-sends a `sent` approval); then the backend settles its right (`Backend.settle`: on
   the store, `approved` or `released`).

It owns nothing of the loop's: an `Order` (immutable) comes in, and an `Outcome` (immutable) goes back
through a queue that the loop drains at its next tick (`Coordinator.absorb`), so the per-event
coordination state has one owner, the loop.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

from agent.clock import Clock
from agent.coordination.approval_gates import GateChecker
from agent.coordination.backend import Backend, Step
from agent.coordination.coordination_rules import Held
from agent.errors import ImdsError, kept_in_memory
from agent.imds.imds_client import is_transient
from agent.model.approval import APPROVAL_KEY, FAILED, SENDING, SENT, ApprovalRecord
from agent.model.gate_specs import Gates
from agent.model.timefmt import iso_z
from agent.retry import retrying as retrying_on
from agent.state.state_store import Store
from agent.telemetry import logs
from agent.telemetry.metrics import Metrics


@dataclass(frozen=True)
class Order:
    """What the loop asks for: approve `event_id` now, unless a gate holds it."""

    event_id: str
    vm_name: str
    reason: str
    gates: Gates
    resources: tuple[str, ...]
    step: Step | None
    """The backend's step (the store's: claim or take over); None on a backend without steps (the peers)."""
    held_before: Held | None
    """The gate that held it last time (a hold is logged when it changes)."""
    retry_for: float
    warning_as_error: bool
    mode: str = "auto"
    """The approval mode the decision was taken in (what the recheck asks of the peers)."""
    deadline: float = float("inf")
    """Monotonic time after which the right to post has lapsed (set when the loop granted it)."""


class RightLapsed(Exception):
    """The right to post lapsed before a send: the reason is the message."""


@dataclass(frozen=True)
class Outcome:
    """What came of an order: the gate that holds it (or None), and when all retries failed (monotonic)."""

    event_id: str
    held: Held | None
    failed_at: float | None


class Approver:
    """Runs orders one at a time on its worker thread and queues their outcomes for the loop."""

    def __init__(self, *, approve: Callable[[list[str]], None], store: Store, clock: Clock, metrics: Metrics,
                 gate_checker: GateChecker, backend: Backend, done: Callable[[], None],
                 right: Callable[[Order], str | None] = lambda order: None) -> None:
        """`done` is called after each outcome is queued: it wakes the loop to take it. `right` is the
        coordinator's part of the recheck before every send, `backend.right_to_post` the backend's."""
        self.approve_fn = approve
        self.right = right
        self.store = store
        self.clock = clock
        self.metrics = metrics
        self.gate_checker = gate_checker
        self.backend = backend
        self.done = done
        self.log = logs.get("coordinator")
        self.cancel = threading.Event()
        self._outcomes: queue.SimpleQueue[Outcome] = queue.SimpleQueue()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="approve")
        self._futures: set[concurrent.futures.Future[None]] = set()
        self._lock = threading.Lock()  # the futures under way, nothing else

    def submit(self, order: Order) -> None:
        future = self._pool.submit(self._run, order)
        with self._lock:
            self._futures.add(future)
        future.add_done_callback(self._done)

    def _done(self, future: concurrent.futures.Future[None]) -> None:
        with self._lock:
            self._futures.discard(future)

    def outcomes(self) -> list[Outcome]:
        """The outcomes since the last call, oldest first (the loop's thread takes them)."""
        out = []
        while True:
            try:
                out.append(self._outcomes.get_nowait())
            except queue.Empty:
                return out

    def wait_idle(self, timeout: float) -> bool:
        """Block until no order is under way (tests, benchmarks)."""
        with self._lock:
            pending = set(self._futures)
        return not concurrent.futures.wait(pending, timeout=timeout)[1]

    def stop(self) -> None:
        self.cancel.set()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _run(self, order: Order) -> None:
        """One approval, the five steps of the module docstring; its outcome always goes back to the loop."""
        held: Held | None = order.held_before
        failed_at: float | None = None
        try:
            held = self._gate(order)  # 1. decided on the loop; a gate may still hold it
            if held is None:
                failed_at = self._approve(order)
        finally:
            self._outcomes.put(Outcome(order.event_id, held, failed_at))
            self.done()

    def _gate(self, order: Order) -> Held | None:
        """The gate holding the approval, if any (logged and journaled when that changes)."""
        gates, eid = order.gates, order.event_id
        held = self.gate_checker.check(gates, eid, order.resources, order.vm_name, order.warning_as_error) \
            if gates.active else None
        if held is not None and held != order.held_before:
            self.log.warning("approval.held", event_id=eid, gate=held.gate, reason=held.reason)
            self.store.journal("approval.held", event_id=eid, gate=held.gate, reason=held.reason)
        elif held is None and order.held_before is not None:
            self.log.info("approval.gate_open", event_id=eid, gate=order.held_before.gate)
        return held

    def _approve(self, order: Order) -> float | None:
        """Steps 2 to 5: None when sent (or not this VM's to send), else when it failed or was withheld
        (monotonic)."""
        right = self.backend.take_right(order.event_id, order.vm_name, order.step, order.retry_for)  # 2.
        if right is None:
            return None
        failed_at: float | None = None
        sent: bool | None = None  # stays None if the sends raise: the backend then records nothing
        try:
            if right.within > 0:
                failed_at = self._post(order, right.within)  # 3. recheck, 4. send, 5. record: each send
            sent = right.within > 0 and failed_at is None
        finally:
            self.backend.settle(order.event_id, order.vm_name, right, sent)  # 5. the backend's record
        return failed_at

    def lapsed(self, order: Order, deadline: float) -> str | None:
        """Why the right to post no longer holds, or None: checked immediately before every send."""
        if self.clock.monotonic() >= deadline:
            return "its deadline passed (this process was paused, or the retries ran out of time)"
        reason = self.right(order)
        if reason is None:
            reason = self.backend.right_to_post(order.event_id, order.resources, order.vm_name, order.mode,
                                                order.step)
        return reason

    def _post(self, order: Order, within: float) -> float | None:
        """Steps 3 to 5: POST StartRequests with retries for at most `within` seconds, each send right after its
        recheck (`lapsed`), `sending` recorded before the first and `sent` or `failed` after the last; None when
        sent, else when it failed or was withheld (monotonic)."""
        eid, vm_name, reason = order.event_id, order.vm_name, order.reason
        deadline = min(order.deadline, self.clock.monotonic() + within)
        retrying = retrying_on(self.clock, retry_if=is_transient, within=within, cancel=self.cancel)
        attempts = 0

        def post() -> None:
            nonlocal attempts
            lapsed = self.lapsed(order, deadline)  # 3. recheck, immediately before this send
            if lapsed is not None:
                raise RightLapsed(lapsed)
            if attempts == 0:  # 5. record, before the first send
                self._record(eid, {"status": SENDING, "by": vm_name, "at": iso_z(self.clock.now()),
                                   "reason": reason})
            attempts += 1
            self.approve_fn([eid])  # 4. send

        try:
            retrying(post)
        except RightLapsed as exc:  # 5. record how it ended: withheld, failed or sent
            self.log.warning("approval.withheld", event_id=eid, reason=str(exc), attempts=attempts,
                             effect="not sent: the right to post lapsed; decided again after a fresh poll")
            if attempts:
                self._record(eid, {"status": FAILED, "by": vm_name, "error": f"withheld: {exc}",
                                   "attempts": attempts, "at": iso_z(self.clock.now())}, "approval.withheld")
            return self.clock.monotonic()
        except ImdsError as exc:
            self.metrics.approvals.labels(FAILED).inc()
            self.log.error("approval.failed", event_id=eid, error=str(exc), code=exc.code, attempts=attempts,
                           body=exc.body[:200] or None)
            self._record(eid, {"status": FAILED, "by": vm_name, "error": str(exc), "attempts": attempts,
                               "at": iso_z(self.clock.now())}, "approval.failed")
            return self.clock.monotonic()
        self.metrics.approvals.labels(SENT).inc()
        self.log.info("approval.sent", event_id=eid, by=vm_name, reason=reason, attempts=attempts)
        self._record(eid, {"status": SENT, "by": vm_name, "reason": reason, "attempts": attempts,
                           "at": iso_z(self.clock.now())}, "approval.sent")
        return None

    def _record(self, event_id: str, value: ApprovalRecord, journal: str | None = None) -> None:
        with kept_in_memory():  # a full disk never stops the approval
            self.store.record(event_id, APPROVAL_KEY, value, journal=journal)
