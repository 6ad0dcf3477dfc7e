"""maintd's own HTTP server: the selector event loop, strict wire parsing, one connection's
state, and the route table with who may call what (operators, peers).

May import: the base, `agent.model`, and `agent.loop.api` only through the facade it is handed.
"""
