"""STUB: to be replaced by the real `health` handler."""

from agent.handlers.base import Context, Handler, Result


class HealthHandler(Handler):
    type_name = "health"

    def scheduled(self, ctx: Context) -> Result:
        raise NotImplementedError

    def started(self, ctx: Context) -> Result:
        raise NotImplementedError

    def completed(self, ctx: Context) -> Result:
        raise NotImplementedError
