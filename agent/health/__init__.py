"""What this VM reports about itself: the health store (Service Fabric model), health rules and
their sampling, the rotation (in or out of the load balancer) and the TCP probe.

May import: `agent.model` and the base.
"""
