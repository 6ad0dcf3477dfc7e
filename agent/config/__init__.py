"""The config file: reading it safely (YAML with positions, bounded), the core sections and
`Config`, which assembles each wing's own settings types. No wing imports this one; the loop and
the face do.

May import: `agent.model`, `agent.policy`, `agent.coordination`, `agent.prepare`, `agent.health`,
`agent.handlers` (each for its settings types) and the base.
"""
