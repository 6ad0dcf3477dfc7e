"""What an approval gate is configured to check (pure settings types): the top-level `gates:` section
and a profile's `gates:` override share them, so they live where both the windows and the
coordination wing can read them; the verdicts are `agent.coordination.coordination_rules`."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, cast

from agent.errors import ConfigValueError
from agent.model.config_schema import choice, duration, integer, list_of, opt, optional, section, text


def _regex(value: Any) -> str:
    pattern = text()(value)
    try:
        re.compile(pattern)
    except re.error as exc:
        raise ConfigValueError("", f"{pattern!r} is not a regular expression: {exc}") from None
    return cast(str, pattern)


@dataclass(frozen=True)
class FleetGate:
    max_percent_unhealthy: int = opt(integer(0, 100),
                                     doc="share (%) of the event's VMs that may be unhealthy; rounds up")
    unreachable_counts_as: str = opt(choice("error", "ignore"), "error",
                                     "error: an unreachable peer counts as unhealthy; ignore: it is left out")


@dataclass(frozen=True)
class PrometheusGate:
    url: str = opt(text(r"^https?://\S+$", "a base URL such as http://prometheus:9090"), doc="Prometheus base URL")
    alerts: tuple[str, ...] = opt(list_of(_regex, unique=True), (),
                                  "block while an alert whose name matches one of these (names or regexes) fires")
    query: str | None = opt(optional(text()), None, "PromQL; block while it returns any sample")
    timeout: float = opt(duration(0.1, 60), 5.0, "timeout of one whole query (answer head and body)")
    on_failure: str = opt(choice("block", "ignore"), "block", "what a failed query means: block, or ignore the gate")

    def validate(self) -> None:
        if not self.alerts and not self.query:
            raise ConfigValueError("alerts", "set alerts (alert names or regexes), query (PromQL), or both")


@dataclass(frozen=True)
class Gates:
    fleet: FleetGate | None = opt(optional(section(FleetGate)), None, "fleet health gate (off when unset)")
    prometheus: PrometheusGate | None = opt(optional(section(PrometheusGate)), None,
                                            "Prometheus alert gate (off when unset)")

    @property
    def active(self) -> bool:
        return self.fleet is not None or self.prometheus is not None


NO_GATES = Gates()
