"""STUB: to be replaced by the real `webhook` handler."""

from agent.handlers.base import Context, Handler, Result


class WebhookHandler(Handler):
    type_name = "webhook"

    def scheduled(self, ctx: Context) -> Result:
        raise NotImplementedError

    def started(self, ctx: Context) -> Result:
        raise NotImplementedError

    def completed(self, ctx: Context) -> Result:
        raise NotImplementedError
