"""`drain`: take the VM out of the load balancer's rotation (the probe answers 503) and wait until
the LB has noticed; put it back when the event is gone.

The wait is `probe.lb_timeout + probe.drain_grace` (Cloud Services LoadBalancerProbe semantics:
the LB may take its whole probe timeout to notice, then in-flight connections get the grace),
shortened to the event's deadline by the runner, and cut short when the event leaves the document.
The drain is persisted (state store), so after a reboot the VM stays out of rotation until the
event has left the document. A drain that lands after its event has gone (the `completed` phase
runs at once, beside a cut `scheduled` run) is lifted again at once.
"""

from __future__ import annotations

from agent.handlers.base import CANCELED, OK, Context, Handler, Result, Settings
from agent.model.outcomes import PHASE_SCHEDULED, PHASE_STARTED


def drain_key(event_id: str) -> str:
    """The rotation's key for the drain this handler holds for an event."""
    return f"event:{event_id}"


class DrainHandler(Handler):
    type_name = "drain"
    leaves_rotation = (PHASE_SCHEDULED, PHASE_STARTED)

    def _key(self, ctx: Context) -> str:
        return drain_key(ctx.event.event_id)

    def minimum_timeout(self, settings: Settings) -> float:
        """The run needs at least the whole wait (the runner still caps it at the deadline)."""
        return settings.drain_wait + 5.0

    def _take_out(self, ctx: Context) -> bool:
        """Drain for the event; False when it was already drained or the event is gone."""
        e = ctx.event
        when = f" not before {e.not_before:%H:%M:%S} UTC" if e.not_before else ""
        new = self.services.rotation.drain(self._key(ctx), f"{e.event_type} {e.event_id}{when}", ctx.clock.now())
        if ctx.event_gone:  # `completed` may already have lifted the drain: do not leave one behind
            self.services.rotation.undrain(self._key(ctx), e.event_id, ctx.clock.now())
            return False
        return new

    def scheduled(self, ctx: Context) -> Result:
        self._take_out(ctx)
        full = ctx.settings.drain_wait
        wait = min(full, max(0.0, ctx.timeout - 1.0))
        if ctx.sleep(wait):
            return Result(CANCELED, f"the load balancer wait was cut short (less than {wait:.0f}s)")
        short = " (shortened to the event's deadline)" if wait < full else ""
        return Result(OK, f"out of rotation; waited {wait:.0f}s for the load balancer{short}")

    def started(self, ctx: Context) -> Result:
        new = self._take_out(ctx)
        return Result(OK, "out of rotation" + (" (the event was first seen Started)" if new else " (already)"))

    def completed(self, ctx: Context) -> Result:
        removed = self.services.rotation.undrain(self._key(ctx), ctx.event.event_id, ctx.clock.now())
        left = self.services.rotation.drains()
        detail = "back in rotation" if not left else f"event drain lifted; still out for: {', '.join(sorted(left))}"
        return Result(OK, detail if removed else "was not drained for this event")
