"""Agreeing with the other VMs an event names on one early approval: the per-event
coordinator, the peer exchange and client, how peers are addressed, the pure coordination rules
and the approval gates.

May import: `agent.model`, `agent.windows`, `agent.state.state_store`, `agent.health.health_store`, `agent.imds.imds_client` and the base.
"""
