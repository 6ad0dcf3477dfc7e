"""Part of the base: what maintd tells its operator. Structured logs (`logs`), every Prometheus metric (`metrics`)
and their text exposition (`metrics_text`). It imports no wing but `agent.model`.
"""
