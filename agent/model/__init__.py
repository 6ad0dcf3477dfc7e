"""The pure types every wing shares: events and documents, the tracker's diff between two
documents, handler phases and outcomes.

May import: the standard library and `agent.errors` only. Every other wing may import this one.
"""
