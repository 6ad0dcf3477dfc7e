"""The `azure_blob` store backend: the pure protocol (layout, records, next step), the only code that
imports azure-storage-blob, the managed-identity token, the per-event exchange on worker lanes, the
approver thread's claim, and the backend as the coordinator sees it.

May import: `agent.coordination` (its shared rules and settings, the `Backend` interface), `agent.model`,
`agent.policy` (the approval modes), `agent.health` and the base.
"""
