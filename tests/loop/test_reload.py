"""SIGHUP: every key of `Config` (found through `dataclasses.fields`, section by section) is either applied
to the running part that reads it or named as needing a restart (`reload.restart_needed`, `maintd
status`); an identity change reaches every part; a refused file keeps the running config."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import yaml

from agent.config.config import Config
from agent.health.health_store import HealthState
from agent.imds.imds_client import PollResult
from agent.loop import wiring
from agent.loop.daemon import Daemon
from agent.model.events import Document
from agent.model.identity import Identity
from agent.systemd import Notifier
from tests.imds_server import wait_for


class CountingImds:
    """Stands in for the IMDS client: an empty document, and the (fake) time of every poll."""

    made: list[CountingImds] = []
    next_timeout = 1.0

    def __init__(self, config: Any, clock: Any, *_: Any) -> None:
        self.endpoint = config.imds.endpoint
        self.settings = config.imds
        self.clock = clock
        self.polls: list[float] = []
        self.closed = False
        CountingImds.made.append(self)

    def close(self) -> None:
        self.closed = True

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
        """Reload the base config with `extra`'s sections merged over it."""
        merged: dict[str, Any] = {"identity": {"name": "vm1"}, "state": {"dir": str(tmp_path)}}
        for key, value in (yaml.safe_load(extra) or {}).items():
            merged[key] = {**merged[key], **value} if isinstance(value, dict) and key in merged else value
        write_config(yaml.safe_dump(merged))
        assert d.reload(), "the new file was refused"
        return d

    from agent.config.config import load
    d = Daemon(load(str(path)), clock, boot_id="b", notifier=Notifier({}), config_path=str(path))
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


def test_a_refused_file_keeps_the_running_config(agent, write_config, tmp_path):
    agent.reload_with("dry_run: true\n")
    write_config(BASE.format(dir=tmp_path) + "imds: {poll_interval: banana}\n")
    assert agent.reload() is False
    assert agent.api.status()["dry_run"] is True
    assert agent.health.snapshot()  # the refusal is reported


def config_keys(cls: type = Config, prefix: str = "") -> Iterator[str]:
    """Every key of the config file, dotted, from the dataclasses themselves (sections recursively)."""
    for f in dataclasses.fields(cls):
        if "parse" not in f.metadata:
            continue
        if dataclasses.is_dataclass(f.default):
            yield from config_keys(type(f.default), f"{prefix}{f.name}.")
        else:
            yield prefix + f.name


def newest(d: Any) -> CountingImds:
    """The IMDS client in force."""
    assert d.parts.imds is CountingImds.made[-1]
    return CountingImds.made[-1]


Check = Callable[[Any], Any]
APPLIED: dict[str, tuple[str, Check]] = {
    # the IMDS client is rebuilt with the new section (and the old one closed); the loop and report read the rest
    "imds.endpoint": ("imds: {endpoint: 'http://127.0.0.1:9'}", lambda d: newest(d).endpoint == "http://127.0.0.1:9"),
    "imds.api_version": ("imds: {api_version: '2019-08-01'}", lambda d: newest(d).settings.api_version == "2019-08-01"),
    "imds.poll_interval": ("imds: {poll_interval: 5s}", lambda d: d.coordinator.poll_interval == 5.0
                           and d.cadence.next_poll - d.clock.monotonic() <= 5.0),
    "imds.timeout": ("imds: {timeout: 3s}", lambda d: newest(d).settings.timeout == 3.0),
    "imds.first_timeout": ("imds: {first_timeout: 30s}", lambda d: newest(d).settings.first_timeout == 30.0),
    "imds.max_backoff": ("imds: {max_backoff: 20s}", lambda d: d.view.config.imds.max_backoff == 20.0),
    "imds.warn_after_failures": ("imds: {warn_after_failures: 7}",
                                 lambda d: d.view.config.imds.warn_after_failures == 7),
    "imds.stale_after": ("imds: {stale_after: 2m}", lambda d: d.view.config.imds.stale_after == 120.0),
    "imds.compute_api_version": ("imds: {compute_api_version: '2020-09-01'}",
                                 lambda d: newest(d).settings.compute_api_version == "2020-09-01"),
    "identity.name": ("identity: {name: vm2}", lambda d: d.api.status()["vm_name"] == "vm2"
                      and d.parts.services.settings.vm_name == "vm2"),
    "state.retention": ("state: {retention: 2h}", lambda d: d.store.retention == 7200.0),
    "state.journal_max_bytes": ("state: {journal_max_bytes: 8192}", lambda d: d.store.journal_max_bytes == 8192),
    "state.journal_keep": ("state: {journal_keep: 2}", lambda d: d.store.journal_keep == 2),
    "log.format": ("log: {format: json}", lambda d: d.config.log.format == "json"),
    "log.level": ("log: {level: debug}", lambda d: d.config.log.level == "debug"),
    "probe.lb_timeout": ("probe: {lb_timeout: 60s}", lambda d: d.parts.services.settings.lb_timeout == 60.0),
    "probe.lb_interval": ("probe: {lb_interval: 20s}", lambda d: d.config.probe.lb_interval == 20.0),
    "probe.drain_grace": ("probe: {drain_grace: 25s}", lambda d: d.parts.services.settings.drain_grace == 25.0),
    "probe.drain_on_stop": ("probe: {drain_on_stop: always}", lambda d: d.parts.config.probe.drain_on_stop == "always"),
    "probe.fail_on": ("probe: {fail_on: ['*', '!app']}", lambda d: d.health.set("app", "db", HealthState.ERROR, "x")
                      or d.api.probe()[0] is True),
    "health.consider_warning_as_error": ("health: {consider_warning_as_error: true}",
                                         lambda d: d.coordinator.warning_as_error is True),
    "coordination.peer_url": ("coordination: {peer_url: 'http://{name}:9999'}",
                              lambda d: d.coordinator.backend.peers.address("vm-7").url == "http://vm-7:9999"),
    "coordination.peers": ("coordination: {peers: {vm-7: 'http://10.0.0.7:8088'}}",
                           lambda d: d.coordinator.backend.peers.address("vm-7").url == "http://10.0.0.7:8088"),
    "coordination.peers_file": ("coordination: {peers_file: /nonexistent/peers.yaml}",
                                lambda d: d.coordinator.settings.peers_file == "/nonexistent/peers.yaml"),
    "coordination.token_file": ("coordination: {token_file: /nonexistent/token}",
                                lambda d: d.parts.config.coordination.token_file == "/nonexistent/token"),
    "coordination.unreachable_peers": ("coordination: {unreachable_peers: ignore}",
                                       lambda d: d.coordinator.settings.unreachable_peers == "ignore"),
    "coordination.peer_timeout": ("coordination: {peer_timeout: 5m}",
                                  lambda d: d.coordinator.settings.peer_timeout == 300),
    "coordination.takeover_after": ("coordination: {takeover_after: 5m}",
                                    lambda d: d.coordinator.settings.takeover_after == 300.0),
    "coordination.request_timeout": ("coordination: {request_timeout: 1s}", lambda d: d.tick() is not None
                                     and d.coordinator.backend.peers.client.timeout == 1.0),
    "coordination.peer_recheck_max": ("coordination: {peer_recheck_max: 30s}",
                                      lambda d: d.coordinator.settings.peer_recheck_max == 30.0),
    "coordination.approval_retry_for": ("coordination: {approval_retry_for: 2m}",
                                        lambda d: d.coordinator.settings.approval_retry_for == 120.0),
    "handlers": ("handlers:\n  - {name: note, type: exec, phases: [scheduled], command: [/bin/true]}",
                 lambda d: [h.spec.name for h in d.runner.handlers] == ["note"]),
    "profiles": ("profiles:\n  - {name: freeze, approval: never}", lambda d: d.api.status()["profile"] == "freeze"),
    "health_rules": ("health_rules:\n  - {name: load, metric: load1, time_grain: 1m, statistic: average, "
                     "time_window: 5m, time_aggregation: average, operator: '>', threshold: 1000, state: Error}",
                     lambda d: "load" in d.rules.states),
    "gates.fleet": ("gates: {fleet: {max_percent_unhealthy: 10}}", lambda d: d.coordinator.gates.fleet is not None),
    "gates.prometheus": ("gates: {prometheus: {url: 'http://127.0.0.1:9090', alerts: [NodeDown]}}",
                         lambda d: d.coordinator.gates.prometheus is not None),
    "prepare.lead_time": ("prepare: {lead_time: 10m}", lambda d: d.preparation.prepare.lead_time == 600.0),
    "prepare.lead_time_by_type": ("prepare: {lead_time_by_type: {Reboot: 5m}}",
                                  lambda d: d.preparation.prepare.lead_time_by_type == {"Reboot": 300.0}),
    "dry_run": ("dry_run: true", lambda d: d.api.status()["dry_run"] is True and d.runner.dry_run is True),
}
RESTART: dict[str, str] = {
    "state.dir": "state: {dir: /var/lib/maintd-elsewhere}",
    "server.listen": "server: {listen: '127.0.0.1:18099'}",
    "server.token_file": "server: {token_file: /etc/maintd/token}",
    "server.max_body_bytes": "server: {max_body_bytes: 2048}",
    "server.read_timeout": "server: {read_timeout: 9s}",
    "server.max_connections_per_client": "server: {max_connections_per_client: 7}",
    "server.max_connections": "server: {max_connections: 99}",
    "server.require_token_on_loopback": "server: {require_token_on_loopback: false}",
    "server.unix_socket": "server: {unix_socket: /run/maintd-test.sock}",
    "server.unix_socket_group": "server: {unix_socket: /run/maintd-test.sock, unix_socket_group: adm}",
    "probe.path": "probe: {path: /lb}",
    "probe.mode": "probe: {mode: tcp, listen: '127.0.0.1:18098'}",
    "probe.listen": "probe: {listen: '127.0.0.1:18098'}",
    "coordination.max_concurrency": "coordination: {max_concurrency: 4}",
    "coordination.backend": "coordination: {backend: azure_blob,\n"
                            "  azure_blob: {account_url: 'https://acct.blob.core.windows.net'}}",
    "coordination.azure_blob": "coordination: {azure_blob: {account_url: 'https://acct.blob.core.windows.net'}}",
    "coordination.budget": "coordination: {backend: azure_blob,\n"
                           "  azure_blob: {account_url: 'https://acct.blob.core.windows.net'}, budget: {group: web}}",
}


def test_every_config_key_is_either_applied_by_a_reload_or_named_as_needing_a_restart():
    """The table of keys here and the daemon's RESTART_KEYS cover `Config` exactly: a new key needs a case."""
    keys = set(config_keys())
    assert set(RESTART) == set(wiring.RESTART_KEYS), "RESTART_KEYS and this test disagree"
    assert not set(APPLIED) & set(RESTART)
    assert keys == set(APPLIED) | set(RESTART), f"no reload case for {sorted(keys - set(APPLIED) - set(RESTART))}"


@pytest.mark.parametrize("key", sorted(APPLIED))
def test_a_reloaded_key_reaches_the_part_that_reads_it(agent, key):
    """Each applied key, changed in the file, is in force in its part after the reload (and nothing waits)."""
    snippet, reached = APPLIED[key]
    agent.reload_with(snippet + "\n")
    agent.tick()
    assert reached(agent), f"{key} did not reach its part"
    assert agent.api.status()["restart_needed"] == []


@pytest.mark.parametrize("key", sorted(RESTART))
def test_a_key_that_needs_a_restart_keeps_its_value_and_is_named(agent, key, logs):
    """Each restart-only key, changed in the file, keeps its running value, is logged as
    `reload.restart_needed` and listed by `maintd status` until the restart."""
    running = wiring.value_at(agent.config, key)
    agent.reload_with(RESTART[key] + "\n")
    assert wiring.value_at(agent.config, key) == running
    named = [e["keys"] for e in logs if e["event"] == "reload.restart_needed"]
    assert named and key in named[-1], named
    assert key in agent.api.status()["restart_needed"]


def test_a_reload_replaces_the_imds_client_and_closes_the_old_ones_socket(agent):
    """A changed imds section makes a new client; the old one's kept poll socket is closed."""
    old = newest(agent)
    agent.reload_with("imds: {timeout: 3s}\n")
    assert newest(agent) is not old and old.closed and not newest(agent).closed


def test_an_identity_change_to_auto_is_learned_off_the_loop_and_reaches_every_part(agent, clock):
    """From a named VM to `auto`: the loop asks IMDS on a thread of its own, then the name reaches the loop,
    the API, the handlers' settings and the coordinator's addressing (computer name, scale set)."""
    agent.reload_with("identity: {name: auto}\n")
    assert agent.vm_name is None and agent.coordinator.backend.peers.directory.identity is None
    wait_for(lambda: polls_during(agent, clock, 1) is not None and agent.vm_name == "vm-auto")
    assert agent.api.status()["vm_name"] == "vm-auto" and agent.parts.services.settings.vm_name == "vm-auto"
    assert agent.coordinator.backend.peers.directory.identity == Identity("vm-auto", "vm-auto", "")
    agent.reload_with("identity: {name: vm3}\n")
    polls_during(agent, clock, 1)  # the identity reaches the coordinator in the next pass's Tick
    assert agent.coordinator.backend.peers.directory.identity is None, \
        "a named VM addresses peers as a fresh start would"
    assert agent.api.status()["vm_name"] == "vm3" and agent.parts.services.settings.vm_name == "vm3"


def test_the_coordination_backend_waits_for_a_restart(agent, logs):
    """Switching to the blob store on reload would mix two protocols within a pending event: the running
    backend stays (peers), the reload says a restart applies it; takeover_after still applies at once."""
    agent.reload_with("coordination: {backend: azure_blob, takeover_after: 30s,\n"
                      "  azure_blob: {account_url: 'https://acct.blob.core.windows.net'}}\n")
    assert agent.config.coordination.backend == "peers" and agent.config.coordination.azure_blob is None
    assert agent.config.coordination.takeover_after == 30
    assert agent.api.status()["coordination"]["backend"] == "peers"
    assert any(e["event"] == "reload.restart_needed" and "coordination.backend" in e["keys"] for e in logs)
