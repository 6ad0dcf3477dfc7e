"""STUB: to be replaced by the real `exec` handler."""

from agent.handlers.base import Context, Handler, Result


class ExecHandler(Handler):
    type_name = "exec"

    def scheduled(self, ctx: Context) -> Result:
        raise NotImplementedError

    def started(self, ctx: Context) -> Result:
        raise NotImplementedError

    def completed(self, ctx: Context) -> Result:
        raise NotImplementedError
