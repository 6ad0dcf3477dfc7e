"""What survives a restart: the state store (events seen, run results, drain flag, approvals),
its file on disk written atomically, and the audit journal.

May import: `agent.model` and the base.
"""
