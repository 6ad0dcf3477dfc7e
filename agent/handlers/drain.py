"""`drain`: take the VM out of the load balancer's rotation (the probe answers 503) and wait until
the LB has noticed; put it back when the event is gone.

The wait is `probe.lb_timeout + probe.drain_grace` (Cloud Services LoadBalancerProbe semantics:
the LB may take its whole probe timeout to notice, then in-flight connections get the grace),
shortened to the event's deadline by the runner. The drain is persisted (state store), so after a
reboot the VM stays out of rotation until the event has left the document.
"""

from __future__ import annotations

from agent.handlers.base import FAILED, OK, Context, Handler, Result


class DrainHandler(Handler):
    type_name = "drain"
    idempotent = True

    def _key(self, ctx: Context) -> str:
        return f"event:{ctx.event.event_id}"

    def wait_seconds(self) -> float:
        """How long the LB may need to stop sending new connections, plus the drain grace."""
        probe, profile = self.services.config.probe, self.services.profile
        lb_timeout = profile.lb_timeout if profile and profile.lb_timeout is not None else probe.lb_timeout
        grace = profile.drain_grace if profile and profile.drain_grace is not None else probe.drain_grace
        return lb_timeout + grace

    def minimum_timeout(self) -> float:
        """The run needs at least the whole wait (the runner still caps it at the deadline)."""
        return self.wait_seconds() + 5.0

    def _take_out(self, ctx: Context) -> bool:
        e = ctx.event
        when = f" not before {e.not_before:%H:%M:%S} UTC" if e.not_before else ""
        return self.services.rotation.drain(self._key(ctx), f"{e.event_type} {e.event_id}{when}", ctx.clock.now())

    def scheduled(self, ctx: Context) -> Result:
        self._take_out(ctx)
        wait = min(self.wait_seconds(), max(0.0, ctx.timeout - 1.0))
        if ctx.sleep(wait):
            return Result(FAILED, f"interrupted after leaving rotation; waited less than {wait:.0f}s")
        short = " (shortened to the event's deadline)" if wait < self.wait_seconds() else ""
        return Result(OK, f"out of rotation; waited {wait:.0f}s for the load balancer{short}")

    def started(self, ctx: Context) -> Result:
        new = self._take_out(ctx)
        return Result(OK, "out of rotation" + (" (the event was first seen Started)" if new else " (already)"))

    def completed(self, ctx: Context) -> Result:
        removed = self.services.rotation.undrain(self._key(ctx))
        left = self.services.rotation.drains()
        detail = "back in rotation" if not left else f"event drain lifted; still out for: {', '.join(sorted(left))}"
        return Result(OK, detail if removed else "was not drained for this event")
