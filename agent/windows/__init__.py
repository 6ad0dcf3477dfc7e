"""When maintenance may happen: recurrences and fixed dates (schedules), profile selection,
and the approval policy a profile sets. All pure.

May import: `agent.model` and the base only.
"""
