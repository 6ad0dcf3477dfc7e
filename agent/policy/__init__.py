"""The policy: when maintenance may happen and whether this VM may approve it early. Recurrences and
fixed dates (schedules), the profiles and which one is in force, the approval decision a profile sets
(`approval_policy.decide`, the coordinator's core). All pure.

May import: `agent.model` and the base.
"""
