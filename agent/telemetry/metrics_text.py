"""The Prometheus text exposition (format 0.0.4) of collected metric families, as `prometheus_client`'s
`generate_latest` writes it for maintd's metrics, without loading its exposition module (that module
imports its HTTP servers and clients, urllib.request and ssl: about 7 MB resident for the life of the
process; decision 0220). `tests/base/test_metrics_text.py` holds the two byte for byte equal.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client.utils import floatToGoString

_number: Callable[[float], str] = floatToGoString
"""A value as Go writes it (`+Inf`, `NaN`, `1.2345678e+06`), as the scrapers expect."""

_PROMETHEUS_TYPE = {"info": "gauge", "stateset": "gauge", "gaugehistogram": "histogram", "unknown": "untyped"}
"""OpenMetrics types written as the text format's."""
_OPENMETRICS_ONLY = ("_created", "_gsum", "_gcount")
"""Sample suffixes the text format has no place for in their family: each becomes a gauge family of its own."""


def _escape_help(text: str) -> str:
    return text.replace("\\", r"\\").replace("\n", r"\n")


def _sample_line(sample: Any) -> str:
    labels = ""
    if sample.labels:
        labels = "{" + ",".join(
            '{}="{}"'.format(k, v.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\""))
            for k, v in sorted(sample.labels.items())) + "}"
    timestamp = f" {int(float(sample.timestamp) * 1000):d}" if sample.timestamp is not None else ""
    return f"{sample.name}{labels} {_number(sample.value)}{timestamp}\n"


def exposition(families: Iterable[Any]) -> bytes:
    """The text format of `families` (a registry's `collect()`): HELP, TYPE and samples of each."""
    out: list[str] = []
    for family in families:
        name = family.name + ("_total" if family.type == "counter" else "_info" if family.type == "info" else "")
        out.append(f"# HELP {name} {_escape_help(family.documentation)}\n")
        out.append(f"# TYPE {name} {_PROMETHEUS_TYPE.get(family.type, family.type)}\n")
        apart: dict[str, list[str]] = {}
        for sample in family.samples:
            suffix = next((s for s in _OPENMETRICS_ONLY if sample.name == family.name + s), None)
            if suffix is None:
                out.append(_sample_line(sample))
            else:
                apart.setdefault(suffix, []).append(_sample_line(sample))
        for suffix, lines in sorted(apart.items()):
            out.append(f"# HELP {family.name}{suffix} {_escape_help(family.documentation)}\n")
            out.append(f"# TYPE {family.name}{suffix} gauge\n")
            out.extend(lines)
    return "".join(out).encode("utf-8")
