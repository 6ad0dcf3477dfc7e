"""The config file: its core sections and `Config`, reading the file safely, and the schema
helpers (durations, positions, hints) every section's spec uses.

May import: the base and each wing's own settings types (the wings never import `agent.config.config`).
"""
