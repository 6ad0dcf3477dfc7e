"""Fleet safety: what holds across the VMs of a group rather than one event. The disruption budget (at most
`max_unavailable` members out of rotation by maintd's choice, B1-B7: the places record and its rules, this
member's lease, its steps, its polls, the wake hints) and the fleet history (one record per VM per event).
Both are carried by a shared store (today the Azure Blob store of `agent.coordination.store`).

May import: `agent.model`, `agent.coordination` (the `coordination.budget` settings), `agent.coordination.store`
(the store it is carried by: its requests, errors and answers) and the base.
"""
