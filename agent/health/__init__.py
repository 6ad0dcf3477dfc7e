"""What this VM reports about itself: the health store (Service Fabric model), health rules and
their sampling, the rotation (in or out of the load balancer, persisted in the state store) and the
TCP probe (which reads its listen address as the HTTP server does).

May import: `agent.model`, `agent.state`, `agent.http` and the base.
"""
