"""Preparing this VM: when to start (the plan), holding `scheduled` work until it is due, and
running handlers on worker lanes with timeouts, cancellation and run records.

May import: `agent.model`, `agent.windows`, `agent.state.state_store`, `agent.health.health_store`, `agent.handlers` and the base.
"""
