"""The pure types every wing shares: events and documents, the tracker's diff between two
documents, handler phases and outcomes, this VM's identity, the time format, approval gate specs
and the vocabulary every section's settings are written in (`config_schema`).

May import: the base (`errors`) only. Every wing may import this one.
"""
