"""Agreeing with the other VMs an event names on one early approval: the per-event coordinator,
the peer exchange and client, how peers are addressed, the pure coordination rules, the approval
gates and the `coordination:` settings.

May import: `agent.model`, `agent.windows`, `agent.state`, `agent.health`, `agent.imds` and the base.
"""
