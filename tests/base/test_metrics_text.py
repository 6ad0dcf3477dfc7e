"""/metrics is written by `agent.telemetry.metrics_text` (so prometheus_client's exposition, with its HTTP servers
and ssl, is never loaded: decision 0220): a scraper must read exactly what prometheus_client's own `generate_latest`
would have written, whatever the values and labels."""

from __future__ import annotations

import math

from prometheus_client import generate_latest
from prometheus_client.metrics import MetricWrapperBase

from agent.telemetry.metrics import Metrics

ODD = 'web "a"\\b\nc é'
"""A label value with every character the text format escapes, and one it does not."""


def every_metric(metrics: Metrics) -> list[MetricWrapperBase]:
    return [v for v in vars(metrics).values() if isinstance(v, MetricWrapperBase)]


def test_the_exposition_is_generate_latests_byte_for_byte():
    metrics = Metrics()
    assert metrics.render() == generate_latest(metrics.registry)  # the zeros a fresh daemon shows
    for i, metric in enumerate(every_metric(metrics)):
        child = metric.labels(*[ODD] * len(metric._labelnames)) if metric._labelnames else metric
        kind = metric._type
        if kind == "counter":
            child.inc(i + 0.5)
        elif kind == "gauge":
            child.set((math.inf, -math.inf, math.nan, 1e-9, -3, 12345678901234.5)[i % 6])
        elif kind == "histogram":
            for value in (0.001, 0.7, 3, 1e6):
                child.observe(value)
    text = metrics.render()
    assert text == generate_latest(metrics.registry)
    assert b'\\"a\\"\\\\b\\nc \xc3\xa9' in text and b"_bucket{" in text and b"+Inf" in text
