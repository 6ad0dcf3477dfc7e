"""The daemon's poll loop and what is built around it: wiring every part from a `Config`,
reloads, the poll cadence, what the loop reports, and the API facade over the parts.

May import: every wing. No wing imports this one (except the face: `cli`, `demo`).
"""
