"""maintd's own HTTP server: the selector event loop, strict wire parsing, one connection's
state, and the route table with who may call what (operators, peers). It serves a backend it is
handed (the loop's API facade) and imports none of the wings it serves.

May import: the base.
"""
