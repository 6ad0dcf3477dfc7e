"""The peers backend: how a peer is addressed from its name, the peers file and its watch, the one
HTTP client for peers and Prometheus, and this VM's per-event exchange with its peers (asks,
readiness pushes, the leader-chain watch).

May import: `agent.coordination` (its shared rules and settings, the `Backend` interface), `agent.model`,
`agent.policy` (the approval modes), `agent.health` and the base.
"""
