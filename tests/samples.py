"""Read a metric the way Prometheus sees it: by exported name and labels, through the registry's public API
(never a client library's private attributes, which change between prometheus-client releases)."""

from __future__ import annotations

from agent.telemetry.metrics import Metrics


def sample(metrics: Metrics, name: str, **labels: str) -> float:
    """The value of series `name{labels}` as a scrape would show it (0 when the series does not exist yet)."""
    return metrics.registry.get_sample_value(name, labels) or 0.0
