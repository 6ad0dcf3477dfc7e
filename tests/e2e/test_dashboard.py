"""The shipped dashboard and alert rules against real data: a real Prometheus (Debian's) scrapes a real
`maintd run` that handles events from the emulator, and every PromQL expression of
packaging/grafana/maintd.json and packaging/prometheus/alerts.yml goes through the query API."""

from __future__ import annotations

import json
import math
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.e2e.harness import free_port, http, wait_until
from tests.reaper import die_with_parent

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS = shutil.which("prometheus")
DASHBOARD = json.loads((ROOT / "packaging/grafana/maintd.json").read_text())
ALERTS = yaml.safe_load((ROOT / "packaging/prometheus/alerts.yml").read_text())
BLOCKER = """groups:
  - name: maintd-e2e
    interval: 1s
    rules:
      - alert: MaintenanceBlocker
        expr: vector(time()) < {until}
"""
# What each panel must show while one Reboot is held by the gate and a Freeze waits for its lead time
# (label subsets one returned series must have; None: any series with a number).
WHILE_HELD: dict[str, dict[str, str] | None] = {
    "In rotation": None,
    "Aggregated health (0 Ok, 1 Warning, 2 Error)": None,
    "Next maintenance in": {"event_type": "Reboot"},
    "Next preparation in (held by lead time or window)": {"event_type": "Freeze"},
    "Seconds since the last successful poll": None,
    "Events in the document": {"event_type": "Reboot", "scope": "self"},
    "IMDS requests by code": {"endpoint": "scheduledevents", "code": "200"},
    "IMDS request duration p99": None,
    "Handler runs by outcome (1h)": {"handler": "prepare", "outcome": "ok"},
    "Handler duration p95": {"handler": "prepare"},
    "Leading events": {"event_type": "Reboot"},
    "Approval held by a gate": {"gate": "prometheus"},
    "Profile in force": {"profile": "default"},
    "Peer readiness requests": None,
    "Event notice (NotBefore - first seen) p50": {"event_type": "Reboot"},
    "State write failures": None,
}
# ...and once the gate let the approval go.
AFTER_APPROVAL: dict[str, dict[str, str]] = {"Approvals (1h)": {"outcome": "sent"}}


def panel_queries(instance: str) -> dict[str, list[str]]:
    """Each panel's expressions with the dashboard's template variables filled in."""
    return {p["title"]: [t["expr"].replace("$instance", instance) for t in p["targets"]]
            for p in DASHBOARD["panels"]}


class Prometheus:
    """Debian's `prometheus` on 127.0.0.1 scraping one maintd every second, with the shipped alert rules."""

    def __init__(self, workdir: Path, target: str) -> None:
        shutil.copy(ROOT / "packaging/prometheus/alerts.yml", workdir / "alerts.yml")
        self.blocker = workdir / "blocker.yml"
        self.blocker.write_text(BLOCKER.format(until=time.time() + 3600))  # fires until `lift`
        (workdir / "prometheus.yml").write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": ["alerts.yml", "blocker.yml"],
            "scrape_configs": [{"job_name": "maintd", "static_configs": [{"targets": [target]}]}]}))
        self.url = f"http://127.0.0.1:{free_port()}"
        self.proc = subprocess.Popen([PROMETHEUS, f"--config.file={workdir / 'prometheus.yml'}",
                                      f"--storage.tsdb.path={workdir / 'tsdb'}",
                                      f"--web.listen-address={self.url.removeprefix('http://')}"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                     preexec_fn=die_with_parent)
        self.http = http()

    def query(self, expr: str) -> list[dict[str, Any]]:
        """The instant vector `expr` returns now; AssertionError naming the expression when Prometheus refuses it."""
        answer = self.http.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=5).json()
        assert answer["status"] == "success", f"{expr}: {answer.get('error')}"
        return answer["data"]["result"] if answer["data"]["resultType"] == "vector" else []

    def shows(self, exprs: list[str], labels: dict[str, str] | None) -> bool:
        """Whether one of `exprs` returns a series with `labels` and a number (not NaN)."""
        return any(all(s["metric"].get(k) == v for k, v in (labels or {}).items())
                   and not math.isnan(float(s["value"][1]))
                   for expr in exprs for s in self.query(expr))

    def lift(self) -> None:
        """Stop the blocker firing: its rule rewritten to fire never, the rules reloaded (SIGHUP)."""
        self.blocker.write_text(BLOCKER.format(until=0))
        self.proc.send_signal(signal.SIGHUP)

    def up(self) -> bool:
        try:
            return bool(self.query('up{job="maintd"} == 1'))
        except Exception:
            if self.proc.poll() is not None:
                raise AssertionError("prometheus exited: " + self.proc.stderr.read()[-2000:]) from None
            return False

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


@pytest.mark.skipif(PROMETHEUS is None, reason="Debian's prometheus package is not installed (.ci/run installs it)")
def test_every_panel_and_alert_query_parses_and_shows_the_situation_it_is_for(start_emulator, start_agent, tmp_path):
    """A held Reboot (gate), a Freeze waiting for its lead time, then the approval: every dashboard and alert
    expression parses, and each panel returns series in the situation it is for ("No data" is a bug)."""
    port = free_port()
    prom = Prometheus(tmp_path, f"127.0.0.1:{port}")
    try:
        emu = start_emulator(["vm-1"], "--started-duration", "1")
        hook = {"name": "prepare", "type": "exec", "phases": ["scheduled"], "command": [sys.executable, "-c", "pass"]}
        agent = start_agent(emu, "vm-1", {
            "handlers": [hook], "prepare": {"lead_time_by_type": {"Freeze": "30m"}},
            "profiles": [{"name": "default", "approval": "auto",
                          "rules": [{"event_types": ["Freeze"], "approval": "never"}]}],
            "gates": {"prometheus": {"url": prom.url, "alerts": ["MaintenanceBlocker"]}}}, port=port)
        wait_until(prom.up, 30, "Prometheus to scrape maintd")
        queries = panel_queries(f"127.0.0.1:{port}")
        instance_query = next(v["query"] for v in DASHBOARD["templating"]["list"] if v["name"] == "instance")
        assert instance_query == "label_values(maintd_build_info, instance)"
        assert prom.query("group by (instance) (maintd_build_info)")[0]["metric"]["instance"] == f"127.0.0.1:{port}"
        for rule in (r for group in ALERTS["groups"] for r in group["rules"]):
            prom.query(rule["expr"])  # parses
        for exprs in queries.values():
            for expr in exprs:
                prom.query(expr)
        assert set(queries) == set(WHILE_HELD) | set(AFTER_APPROVAL), "every panel has its situation here"

        # the gate holds only an alert Prometheus has evaluated as firing: the event comes after that
        wait_until(lambda: prom.query('ALERTS{alertname="MaintenanceBlocker",alertstate="firing"}'), 30,
                   "the blocker to fire")
        eid = emu.add_event(event_type="Reboot", resources=["vm-1"], notice=600)
        emu.add_event(event_type="Freeze", resources=["vm-1"], notice=3600)
        agent.wait_log("approval.held", event_id=eid, timeout=30)
        for title, labels in WHILE_HELD.items():
            wait_until(lambda: prom.shows(queries[title], labels), 20, f"panel {title!r} to show {labels or 'data'}")
        wait_until(lambda: prom.query("ALERTS{alertname='MaintdMaintenanceScheduled'}"), 20,
                   "MaintdMaintenanceScheduled to fire for a Reboot 10 minutes away")

        prom.lift()  # held for as long as the checks above took (a fixed end raced them on a loaded host)
        agent.wait_log("approval.sent", event_id=eid, timeout=60)
        for title, labels in AFTER_APPROVAL.items():
            wait_until(lambda: prom.shows(queries[title], labels), 20, f"panel {title!r} to show {labels}")
    finally:
        prom.stop()
