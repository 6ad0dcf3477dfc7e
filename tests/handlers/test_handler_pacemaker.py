"""The `pacemaker` handler against a fake cluster (its command runner): standby only when min_online
holds, ready once the node is empty, holds with a Warning, an Error for an event naming every node or a
resource that cannot leave, the node brought back after the event, a restart that does not standby again,
and never a shell nor event text on a command line. The real cluster: tests/cluster/."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest

from agent.config.config import loads
from agent.errors import ConfigError
from agent.handlers.base import CANCELED, FAILED, OK, Context, HandlerSpec, Services, Settings
from agent.handlers.pacemaker import PacemakerHandler, PacemakerOptions
from agent.handlers.pacemaker_cli import Cluster
from agent.handlers.pacemaker_state import parse_mon
from agent.health.health_store import HealthState, HealthStore
from agent.health.rotation import Rotation
from agent.model.events import Event
from agent.model.tracker import Tracked
from agent.state.state_store import Store
from agent.telemetry.metrics import Metrics
from tests.handlers.pacemaker_fake import FakeCluster, FakeResource

DESCRIPTION = "$(touch /tmp/pwned); `id` ; rm -rf / # maintenance"


def services(tmp_path: Any, clock: Any) -> Services:
    store = Store(tmp_path, clock)
    health = HealthStore(clock)
    return Services(clock=clock, store=store, metrics=Metrics(), rotation=Rotation(store, health, ["*"]),
                    health=health, settings=Settings(vm_name="node-a"))


def handler(svc: Services, fake: FakeCluster, **options: Any) -> PacemakerHandler:
    opts = PacemakerOptions(**{"move_timeout": 30.0, **options})
    spec = HandlerSpec(name="cluster", type="pacemaker", phases=("scheduled", "completed"), options=opts)
    return PacemakerHandler(spec, svc, Cluster(fake))


def event(clock: Any, resources: tuple[str, ...] = ("node-a",), eid: str = "E1", minutes: float = 10) -> Event:
    return Event(eid, "Reboot", "Scheduled", resources, not_before=clock.now() + timedelta(minutes=minutes),
                 description=DESCRIPTION)


def run(h: PacemakerHandler, clock: Any, e: Event, phase: str = "scheduled", cancel: threading.Event | None = None,
        outcome: str | None = None, attempt: int = 1) -> Any:
    left = (e.not_before - clock.now()).total_seconds() - 5 if e.not_before else 60.0
    ctx = Context(event=e, phase=phase, vm_name="node-a", names_self=True, timeout=min(3600.0, left),
                  deadline=e.not_before, dry_run=False, clock=clock, cancel=cancel or threading.Event(),
                  settings=h.services.settings, outcome=outcome, attempt=attempt)
    return h.run(ctx)


def report(svc: Services, prop: str) -> Any:
    return next((e.report for e in svc.health.snapshot() if e.report.source_id == "pacemaker"
                 and e.report.property == prop), None)


def track(svc: Services, clock: Any, e: Event) -> None:
    """The event as the loop records it once seen in the document."""
    svc.store.apply({e.event_id: Tracked(e, True, clock.now(), "boot-1", False)}, [])


def test_the_node_goes_into_standby_and_is_ready_once_its_resources_have_moved(tmp_path, clock, logs):
    fake = FakeCluster()
    svc = services(tmp_path, clock)
    result = run(handler(svc, fake), clock, event(clock))
    assert result.outcome == OK, result
    assert fake.nodes["node-a"].standby and fake.resources["dummy"].on == "node-b"
    assert "dummy to node-b" in result.detail
    assert fake.claim("node-a").startswith("E1 ") and fake.lock is None  # the claim stays, the lock is released
    assert [e["event"] for e in logs if e["event"].startswith("pacemaker.")] == ["pacemaker.standby", "pacemaker.moved"]
    assert "resources here: none" in report(svc, "cluster/node").description


def test_no_shell_and_no_event_text_ever_reach_a_command_line(tmp_path, clock):
    fake = FakeCluster()
    svc = services(tmp_path, clock)
    h = handler(svc, fake)
    run(h, clock, event(clock))
    run(h, clock, event(clock), phase="completed")
    assert {c[0] for c in fake.commands} <= {"crm_node", "crm_mon", "cibadmin", "crm_attribute"}
    assert not any("touch" in a or "`" in a or "$(" in a for c in fake.commands for a in c)


def test_an_event_id_that_is_not_a_plain_id_is_hashed_before_it_reaches_the_cib(tmp_path, clock):
    fake = FakeCluster()
    run(handler(services(tmp_path, clock), fake), clock, event(clock, eid='E1" onload="x'))
    claim = fake.claim("node-a")
    assert claim is not None and claim.startswith("sha256-") and '"' not in claim


def test_it_holds_while_the_other_node_is_in_standby_then_goes_once_it_is_back(tmp_path, clock, logs):
    fake = FakeCluster()
    fake.nodes["node-b"].standby_forever = True
    svc = services(tmp_path, clock)
    done: dict[str, Any] = {}

    def back_after_a_while(*_: Any) -> None:
        if fake.commands.count(["crm_mon", "-1", "--output-as=xml"]) == 10:
            assert report(svc, "cluster/hold").state == HealthState.WARNING
            assert not fake.nodes["node-a"].standby
            fake.nodes["node-b"].standby_forever = False
    runner = fake.__call__

    def watched(argv: list[str], timeout: float) -> Any:
        back_after_a_while()
        return runner(argv, timeout)
    h = PacemakerHandler(handler(svc, fake).spec, svc, Cluster(watched))
    done["result"] = run(h, clock, event(clock))
    assert done["result"].outcome == OK
    holds = [e for e in logs if e["event"] == "pacemaker.hold"]
    assert len(holds) == 1 and "node-b in standby" in holds[0]["reason"] and "min_online 1" in holds[0]["reason"]
    assert report(svc, "cluster/hold") is None
    assert fake.standbys("node-a") == 1


def test_held_until_notbefore_it_never_standbys_and_says_the_platform_goes_ahead(tmp_path, clock):
    fake = FakeCluster()
    fake.nodes["node-b"].online = False
    svc = services(tmp_path, clock)
    result = run(handler(svc, fake), clock, event(clock, minutes=2))
    assert result.outcome == FAILED and "the platform goes ahead at NotBefore" in result.detail
    assert "node-b offline" in result.detail
    assert fake.standbys("node-a") == 0 and fake.claim("node-a") is None and fake.lock is None
    assert report(svc, "cluster/hold").state == HealthState.WARNING
    assert not any(c[:2] == ["cibadmin", "--create"] for c in fake.commands), "a hold writes nothing to the CIB"


def test_a_node_another_maintd_is_taking_out_does_not_count_as_online(tmp_path, clock):
    fake = FakeCluster()
    fake.config["maintd-claim-node-b"] = f"E9 {clock.now().timestamp() + 3600:.0f}"
    result = run(handler(services(tmp_path, clock), fake), clock, event(clock, minutes=1))
    assert result.outcome == FAILED and "node-b being taken out by maintd for event E9" in result.detail
    assert fake.standbys("node-a") == 0


def test_min_online_zero_lets_the_last_node_go(tmp_path, clock):
    fake = FakeCluster()
    fake.nodes["node-b"].online = False
    result = run(handler(services(tmp_path, clock), fake, min_online=0), clock, event(clock))
    assert result.outcome == OK and fake.nodes["node-a"].standby


def test_an_event_naming_every_node_is_an_error_and_nothing_goes_into_standby(tmp_path, clock):
    fake = FakeCluster()
    svc = services(tmp_path, clock)
    result = run(handler(svc, fake), clock, event(clock, ("NODE-A", "node-b")))
    assert result.outcome == FAILED and "takes the whole cluster down" in result.detail
    assert fake.standbys("node-a") == fake.standbys("node-b") == 0
    assert report(svc, "cluster/event").state == HealthState.ERROR
    assert svc.metrics.pacemaker_errors.labels("cluster", "whole_cluster")._value.get() == 1


def test_a_pinned_resource_is_an_error_naming_it_and_the_node_comes_back(tmp_path, clock):
    fake = FakeCluster(resources={"dummy": FakeResource("node-a", pinned="node-a")})
    svc = services(tmp_path, clock)
    t0 = clock.monotonic()
    result = run(handler(svc, fake, move_timeout=20.0), clock, event(clock))
    assert result.outcome == FAILED and "resource dummy cannot leave node-a" in result.detail
    assert 20 <= clock.monotonic() - t0 < 22
    assert not fake.nodes["node-a"].standby and fake.claim("node-a") is None
    assert "dummy" in report(svc, "cluster/event").description


def test_a_failed_stop_is_an_error_at_once(tmp_path, clock):
    fake = FakeCluster(resources={"dummy": FakeResource("node-a", stop_fails=True)})
    t0 = clock.monotonic()
    result = run(handler(services(tmp_path, clock), fake), clock, event(clock))
    assert result.outcome == FAILED and "dummy" in result.detail and "stop failed" in result.detail
    assert clock.monotonic() - t0 < 2


def test_move_timeout_is_capped_by_notbefore(tmp_path, clock):
    fake = FakeCluster(resources={"dummy": FakeResource("node-a", pinned="node-a")})
    t0 = clock.monotonic()
    result = run(handler(services(tmp_path, clock), fake, move_timeout=600.0), clock, event(clock, minutes=1))
    assert result.outcome == FAILED and clock.monotonic() - t0 < 60


def test_another_nodes_lock_is_waited_for_and_a_stale_one_swept(tmp_path, clock, logs):
    fake = FakeCluster()
    fake.config["maintd-lock"] = f"node-b abcd {clock.now().timestamp() + 5:.0f}"
    result = run(handler(services(tmp_path, clock), fake), clock, event(clock))
    assert result.outcome == OK
    assert [e["holder"] for e in logs if e["event"] == "pacemaker.stale_lock"] == ["node-b"]


def test_a_rerun_after_a_crash_mid_move_does_not_standby_again(tmp_path, clock, logs):
    fake = FakeCluster()
    svc = services(tmp_path, clock)
    e = event(clock)
    assert run(handler(svc, fake), clock, e).outcome == OK
    again = run(handler(svc, fake), clock, e, attempt=2)  # a new maintd (restart), the same cluster
    assert again.outcome == OK and fake.standbys("node-a") == 1
    assert [x["event"] for x in logs if x["event"] == "pacemaker.resumed"] == ["pacemaker.resumed"]


def test_completed_brings_the_node_back_and_releases_the_claim(tmp_path, clock):
    fake = FakeCluster()
    svc = services(tmp_path, clock)
    h = handler(svc, fake)
    e = event(clock)
    run(h, clock, e)
    result = run(h, clock, e, phase="completed", outcome=CANCELED)
    assert result.outcome == OK and "back" in result.detail and "canceled" in result.detail
    assert not fake.nodes["node-a"].standby and fake.claim("node-a") is None


def test_completed_for_an_event_it_held_for_changes_nothing(tmp_path, clock):
    fake = FakeCluster()
    fake.nodes["node-b"].standby_forever = True
    svc = services(tmp_path, clock)
    h = handler(svc, fake)
    gone = threading.Event()
    gone.set()
    e = event(clock)
    assert run(h, clock, e, cancel=gone).outcome == CANCELED
    assert run(h, clock, e, phase="completed").outcome == OK
    assert fake.standbys("node-a") == 0 and fake.nodes["node-b"].standby_forever
    assert not any(c[0] == "crm_attribute" for c in fake.commands)


def test_after_a_reboot_the_keeper_brings_the_node_back_when_the_event_is_gone(tmp_path, clock, logs):
    fake = FakeCluster()
    svc = services(tmp_path, clock)
    run(handler(svc, fake), clock, event(clock))  # E1 was never tracked by this store: it is gone
    handler(svc, fake).keep()
    assert not fake.nodes["node-a"].standby and fake.claim("node-a") is None
    assert any(x["event"] == "pacemaker.event_gone" for x in logs)


def test_the_keeper_keeps_a_claim_whose_event_is_still_there(tmp_path, clock):
    fake = FakeCluster()
    svc = services(tmp_path, clock)
    e = event(clock)
    track(svc, clock, e)
    h = handler(svc, fake)
    run(h, clock, e)
    h.keep()
    assert fake.nodes["node-a"].standby and fake.claim("node-a") is not None


def test_the_keeper_clears_another_nodes_lapsed_claim_and_standby(tmp_path, clock, logs):
    fake = FakeCluster()
    fake.nodes["node-b"].standby = True
    fake.config["maintd-claim-node-b"] = f"E7 {clock.now().timestamp() - 1:.0f}"
    svc = services(tmp_path, clock)
    handler(svc, fake).keep()
    assert not fake.nodes["node-b"].standby and fake.claim("node-b") is None
    assert any(x["event"] == "pacemaker.lapsed_claim" and x["node"] == "node-b" for x in logs)
    assert svc.metrics.pacemaker_online.labels("cluster")._value.get() == 1


def test_a_broken_cluster_tool_is_an_error_with_a_metric(tmp_path, clock):
    fake = FakeCluster(fail={"crm_mon": 102})
    svc = services(tmp_path, clock)
    result = run(handler(svc, fake), clock, event(clock))
    assert result.outcome == FAILED and "crm_mon" in result.detail
    assert svc.metrics.pacemaker_command_failures.labels("cluster", "crm_mon")._value.get() == 1
    assert fake.lock is None


def test_the_config_takes_the_contract_keys(tmp_path):
    cfg = loads("handlers:\n  - name: cluster\n    type: pacemaker\n    phases: [scheduled, completed]\n")
    opts = cfg.handlers[0].options
    assert (opts.node, opts.min_online, opts.move_timeout) == ("auto", 1, 600.0)
    with pytest.raises(ConfigError):
        loads("handlers:\n  - name: c\n    type: pacemaker\n    phases: [scheduled]\n    node: 'a b;rm'\n")


def test_crm_mon_xml_of_groups_and_clones():
    view = parse_mon("""<pacemaker-result><summary><current_dc present="true" name="n1"/></summary><nodes>
      <node name="n1" id="1" online="true" standby="false" type="member"/>
      <node name="n2" id="2" online="false" standby="false" type="member"/>
      <node name="r1" id="r1" online="true" standby="false" type="remote"/></nodes><resources>
      <group id="g" number_resources="1"><resource id="ip" role="Started" active="true"><node name="n1" id="1"/>
      </resource></group><clone id="health-clone"><resource id="health" role="Started" active="true">
      <node name="n1" id="1"/></resource><resource id="health" role="Stopped" active="false"/></clone>
      </resources></pacemaker-result>""")
    assert set(view.nodes) == {"n1", "n2"} and view.dc == "n1"
    assert view.on("n1") == ("ip", "health")
    assert [r.clone for r in view.resources] == [None, "health-clone", "health-clone"]


def test_maintd_status_shows_the_node_in_its_cluster():
    from agent.cli.cliviews import status_text
    text = status_text({"version": "0", "vm_name": "node-a", "cluster": {
        "cluster/node": "Ok: node-a: online, in standby; resources here: none; other nodes online: node-b",
        "cluster/hold": "Warning: event E1: holding, not in standby"}})
    lines = text.splitlines()
    at = lines.index("Cluster")
    assert "cluster/node" in lines[at + 1] and "in standby; resources here: none" in lines[at + 1]
    assert "Other" not in lines


def test_a_claim_with_a_node_name_maintd_would_not_accept_is_ignored():
    from agent.handlers.pacemaker_state import parse_claims
    claims = parse_claims('<crm_config><cluster_property_set id="maintd-claim--rf x"><nvpair id="a" name="a" '
                          'value="E1 100"/></cluster_property_set><cluster_property_set id="maintd-claim-node-b">'
                          '<nvpair id="b" name="b" value="E2 200"/></cluster_property_set></crm_config>')
    assert list(claims.by_node) == ["node-b"] and claims.by_node["node-b"].expires == 200
