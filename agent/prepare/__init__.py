"""Preparing this VM: when to start (the plan and `prepare:` settings), holding `scheduled` work
until it is due, and running handlers on worker lanes with timeouts, cancellation and run records.

May import: `agent.model`, `agent.policy`, `agent.loop.tick` (the pass it prepares on), `agent.state`,
`agent.handlers` and the base.
"""
