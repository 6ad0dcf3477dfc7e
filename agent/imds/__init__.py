"""Talking to the Instance Metadata Service: the Scheduled Events client (poll, compute metadata,
StartRequests) and its own HTTP/1.1 connection that never uses a proxy.

May import: `agent.model` and the base (`clock`, `errors`, `jsonsafe`, `logs`, `metrics`, `retry`).
"""
