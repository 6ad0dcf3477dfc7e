"""SIGHUP: every reloadable key takes effect in the running daemon; server.* and state.dir wait
for a restart; a refused file keeps the running config. One test per reloadable key."""

from __future__ import annotations

from typing import Any

import pytest

from agent.loop import wiring
from agent.model.identity import Identity
from agent.loop.daemon import build
from agent.health.health_store import HealthState
from agent.imds.imds_client import PollResult
from agent.model.events import Document
from agent.systemd import Notifier


class CountingImds:
    """Stands in for the IMDS client: an empty document, and the (fake) time of every poll."""

    made: list["CountingImds"] = []
    next_timeout = 1.0

    def __init__(self, config: Any, clock: Any, *_: Any) -> None:
        self.endpoint = config.imds.endpoint
        self.clock = clock
        self.polls: list[float] = []
        CountingImds.made.append(self)

    def get_document(self) -> PollResult:
        self.polls.append(self.clock.monotonic())
        return PollResult(document=Document(incarnation=1, events=()), unchanged=False, duration=0.0)

    def compute_identity(self) -> Identity:
        return Identity("vm-auto", "vm-auto", "")


BASE = "identity: {{name: vm1}}\nstate: {{dir: {dir}}}\n"


@pytest.fixture
def agent(tmp_path, clock, write_config, monkeypatch):
    CountingImds.made = []
    monkeypatch.setattr(wiring, "make_imds_client", CountingImds)
    path = write_config(BASE.format(dir=tmp_path))

    def reload_with(extra: str) -> Any:
        write_config(BASE.format(dir=tmp_path) + extra)
        assert d.reload(), "the new file was refused"
        return d

    from agent.config.config import load
    d = build(load(str(path)), clock, boot_id="b", notifier=Notifier({}), config_path=str(path))
    d.start()
    d.reload_with = reload_with
    d.api = wiring.make_api(d.parts, lambda: d.view)
    yield d
    d.shutdown()


def polls_during(d, clock, seconds: float) -> list[float]:
    imds = CountingImds.made[-1]
    before = len(imds.polls)
    end = clock.monotonic() + seconds
    while clock.monotonic() < end:
        d.tick()
        d._sleep_until_due()
    return imds.polls[before:]


def test_poll_interval_changes_the_cadence_of_polls_and_of_peer_asks(agent, clock):
    assert len(polls_during(agent, clock, 10)) == pytest.approx(10, abs=1)
    agent.reload_with("imds: {poll_interval: 5s}\n")
    assert len(polls_during(agent, clock, 60)) == pytest.approx(12, abs=1)
    assert agent.coordinator.poll_interval == 5.0, "peers are asked at the new rate too"


def test_imds_endpoint_change_polls_the_new_endpoint(agent, clock):
    agent.reload_with("imds: {endpoint: 'http://127.0.0.1:9'}\n")
    polls_during(agent, clock, 3)
    assert CountingImds.made[-1].endpoint == "http://127.0.0.1:9" and CountingImds.made[-1].polls


def test_identity_name_change_is_the_name_the_api_shows(agent, tmp_path, write_config):
    assert agent.api.status()["vm_name"] == "vm1"
    write_config(f"identity: {{name: vm2}}\nstate: {{dir: {tmp_path}}}\n")
    assert agent.reload()
    agent.tick()
    assert agent.api.status()["vm_name"] == "vm2"


def test_consider_warning_as_error_takes_a_warning_vm_out_of_rotation(agent):
    agent.health.set("app", "db", HealthState.WARNING, "replica lag")
    assert agent.api.probe()[0] is True
    agent.reload_with("health: {consider_warning_as_error: true}\n")
    in_rotation, reason = agent.api.probe()
    assert not in_rotation and "replica lag" in reason


def test_probe_fail_on_decides_which_errors_drain(agent):
    agent.health.set("app", "db", HealthState.ERROR, "down")
    assert agent.api.probe()[0] is False
    agent.reload_with("probe: {fail_on: ['*', '!app']}\n")
    assert agent.api.probe()[0] is True


def test_dry_run_is_shown_and_applied(agent):
    agent.reload_with("dry_run: true\n")
    assert agent.api.status()["dry_run"] is True and agent.runner.dry_run is True


def test_profiles_change_the_profile_in_force(agent):
    agent.reload_with("profiles:\n  - {name: freeze, approval: never}\n")
    assert agent.api.status()["profile"] == "freeze"


def test_handlers_added_by_a_reload_are_the_ones_that_run(agent):
    agent.reload_with("handlers:\n  - {name: note, type: exec, phases: [scheduled], command: [/bin/true]}\n")
    assert [h.spec.name for h in agent.runner.handlers] == ["note"]


def test_health_rules_added_by_a_reload_report(agent):
    agent.reload_with("health_rules:\n  - {name: load, metric: load1, time_grain: 1m, statistic: average, "
                      "time_window: 5m, time_aggregation: average, operator: '>', threshold: 1000, state: Error}\n")
    assert "load" in agent.rules.states


def test_coordination_settings_and_gates_reach_the_coordinator(agent):
    agent.reload_with("coordination: {takeover_after: 5m}\ngates: {fleet: {max_percent_unhealthy: 10}}\n")
    assert agent.coordinator.settings.takeover_after == 300.0
    assert agent.coordinator.gates.fleet is not None


def test_state_retention_applies_to_the_next_prune(agent, tmp_path, write_config):
    write_config(f"identity: {{name: vm1}}\nstate: {{dir: {tmp_path}, retention: 2h}}\n")
    assert agent.reload()
    assert agent.store.retention == 7200.0


def test_server_and_state_dir_wait_for_a_restart_and_say_so(agent, tmp_path, logs):
    listen = agent.config.server.listen
    agent.reload_with("server: {listen: '127.0.0.1:18099'}\n")
    assert agent.config.server.listen == listen
    assert any(e["event"] == "config.needs_restart" for e in logs)


def test_a_refused_file_keeps_the_running_config(agent, write_config, tmp_path):
    agent.reload_with("dry_run: true\n")
    write_config(BASE.format(dir=tmp_path) + "imds: {poll_interval: banana}\n")
    assert agent.reload() is False
    assert agent.api.status()["dry_run"] is True
    assert agent.health.snapshot()  # the refusal is reported


def test_the_coordination_backend_waits_for_a_restart(agent, logs):
    """Switching to the blob store on reload would mix two protocols within a pending event: the running
    backend stays (peers), the reload says a restart applies it; takeover_after still applies at once."""
    agent.reload_with("coordination: {backend: azure_blob, takeover_after: 30s,\n"
                      "  azure_blob: {account_url: 'https://acct.blob.core.windows.net'}}\n")
    assert agent.config.coordination.backend == "peers" and agent.config.coordination.azure_blob is None
    assert agent.config.coordination.takeover_after == 30
    assert agent.api.status()["coordination"]["backend"] == "peers"
    assert any(e["event"] == "config.needs_restart" and "coordination.backend" in e["keys"] for e in logs)
