"""Serial lanes on a bounded thread pool: jobs with the same key run one after another, in order.

A `concurrent.futures` pool starts a new thread whenever a job arrives while every thread it has is
busy, up to its maximum, and never lets one go. Submitting every job straight to it makes the
number of threads follow the largest burst of jobs ever seen, not the work that can really go in
parallel. A lane takes one pool worker for as long as its key has queued work, so the threads
follow the number of keys busy at once: the runner keys by event (an event's phases run in order,
events in parallel), the coordinator by peer (one request at a time to each peer, on its keep-alive
connection, however many events are asking it).

A job that raises never leaves its work stuck: the lane logs `lane.internal_error`, counts it
(`on_error`, the lane's metric), then runs the job's own `failed` callback with the exception, so the
user puts its state back (clears its busy flag, hands back a failure to retry with backoff), and goes
on with the key's next job. A `failed` callback that raises is logged and counted the same way.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
from collections.abc import Callable, Hashable

from agent.telemetry import logs

Job = Callable[[], None]
Failed = Callable[[Exception], None]


class Lanes:
    """Per-key FIFO queues drained on at most `max_workers` threads; thread-safe."""

    def __init__(self, max_workers: int, name: str, on_error: Callable[[], None] = lambda: None) -> None:
        self.name = name
        self.on_error = on_error
        self.log = logs.get(name)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=name)
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._queues: dict[Hashable, collections.deque[tuple[Job, Failed | None]]] = {}
        self._running: set[Hashable] = set()  # keys whose lane a worker is draining
        self._closed = False

    def submit(self, key: Hashable, job: Job, failed: Failed | None = None) -> None:
        """Run `job` after every job already queued for `key` (at once if the lane is free); if it raises,
        `failed(exception)` runs next on the same lane (see the module docstring)."""
        with self._lock:
            if self._closed:  # shut down: dropped, as a stopping daemon drops queued work
                return
            queue = self._queues.get(key)
            if queue is not None:
                queue.append((job, failed))
                return
            self._queues[key] = collections.deque([(job, failed)])
        try:
            self._pool.submit(self._drain, key)
        except RuntimeError:  # shut down: the job is dropped, as a stopping daemon drops queued work
            with self._lock:
                del self._queues[key]
                self._idle.notify_all()

    def _drain(self, key: Hashable) -> None:
        while True:
            with self._lock:
                queue = self._queues.get(key)  # None: shut down before this lane started
                if not queue or self._closed:
                    self._queues.pop(key, None)
                    self._running.discard(key)
                    self._idle.notify_all()
                    return
                self._running.add(key)
                job, failed = queue.popleft()
            try:
                job()
            except Exception as exc:  # a job should handle its own errors; the lane must outlive one that did not
                self._internal_error(key, exc, "job")
                if failed is not None:
                    try:
                        failed(exc)
                    except Exception as again:
                        self._internal_error(key, again, "failed callback")

    def _internal_error(self, key: Hashable, exc: Exception, where: str) -> None:
        self.log.error("lane.internal_error", lane=self.name, key=str(key)[:120], where=where, error=repr(exc)[:500],
                       exc_info=True)
        try:
            self.on_error()
        except Exception:  # counting must never be what stops a lane
            pass

    def busy(self) -> list[Hashable]:
        """Keys with queued or running work."""
        with self._lock:
            return list(self._queues)

    def wait_idle(self, timeout: float) -> bool:
        """Block until no lane has queued or running work; False if `timeout` passed first."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._queues, timeout)

    def shutdown(self) -> None:
        """Take no more work; jobs not yet started are dropped (those queued behind a running job of their key
        too: a stopped lane used to run its whole queue), a running one is left to finish."""
        with self._lock:
            self._closed = True
            for key in [k for k in self._queues if k not in self._running]:
                del self._queues[key]  # its lane never started; the pool drops it below
            for queue in self._queues.values():
                queue.clear()
            self._idle.notify_all()
        self._pool.shutdown(wait=False, cancel_futures=True)
