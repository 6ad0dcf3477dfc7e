"""Agreeing with the other VMs an event names on one early approval: the per-event coordinator,
the approver, the pure coordination rules, the approval gates and the `coordination:` settings; the
backends live in sub-packages, `agent.coordination.peers` and `agent.coordination.store`.

May import: `agent.model`, `agent.policy`, `agent.loop.tick` (the pass it decides on), `agent.state`, `agent.health`,
`agent.imds` and the base.
"""
