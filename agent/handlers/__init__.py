"""Handlers: what runs when an event reaches a phase (built-ins and `maintd.handlers` plugins)."""
