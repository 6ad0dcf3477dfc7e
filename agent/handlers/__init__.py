"""Handlers: what runs when an event reaches a phase (built-ins and `maintd.handlers` plugins).
`agent.handlers.base` is the plugin API third-party handlers import, so this package keeps its path.

May import: `agent.model`, `agent.state`, `agent.health` (the parts `Services` hands a handler) and the base.
"""
