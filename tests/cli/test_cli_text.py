"""What `maintd status`, `events`, `events ID`, `events --history`, `fleet` and `health` print for people: the
daemon's real answers (captured from `maintd run` with the emulator, peer and store backends: tests/fixtures/cli)
read as text, never as Python reprs; `--json` is the daemon's answer unchanged.

Each command runs in-process against a real HTTP server on 127.0.0.1 that answers what the fixtures hold.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.cli import commands as cli
from agent.cli.clitext import duration, fit, relative, section, table, text, tidy, when
from agent.http.routes import ApiServer
from agent.telemetry.metrics import Metrics
from tests.e2e.harness import free_port
from tests.http.test_server import FakeBackend

FIXTURES = Path(__file__).parent.parent / "fixtures" / "cli"
REPR = re.compile(r"\bNone\b|\bTrue\b|\bFalse\b|\[|\{'|'\}|\]")
"""What a Python repr leaves in text: None, True, False, a list's brackets, a dict's quotes and braces."""


def load(name: str) -> Any:
    return json.loads((FIXTURES / name).read_text())


def assert_text(out: str) -> None:
    """Human text: no Python repr anywhere (the EventIds, names and URLs hold none of these)."""
    found = [line for line in out.splitlines() if REPR.search(line)]
    assert not found, "Python reprs in the text form:\n" + "\n".join(found)


class Answers(FakeBackend):
    """A daemon's API answering recorded answers."""

    def __init__(self) -> None:
        super().__init__()
        self.answers: dict[str, Any] = {}

    def status(self) -> dict[str, Any]:
        return self.answers["status"]

    def events(self) -> list[dict[str, Any]]:
        return self.answers["events"]

    def event(self, event_id: str) -> dict[str, Any] | None:
        return self.answers.get(f"event {event_id}")

    def fleet(self) -> dict[str, Any]:
        return self.answers["fleet"]

    def health(self) -> dict[str, Any]:
        return self.answers["health"]


@pytest.fixture
def daemon() -> Iterator[tuple[Answers, str]]:
    backend = Answers()
    srv = ApiServer(f"127.0.0.1:{free_port()}", backend, Metrics())
    srv.serve_in_background()
    yield backend, srv.url
    srv.close()


@pytest.fixture
def run(daemon, capsys, write_config, monkeypatch) -> Callable[..., tuple[int, str]]:
    """`maintd <args> --url <the server>` in this process: its exit status and what it printed."""
    monkeypatch.setenv("MAINTD_CONFIG", str(write_config("{}\n")))

    def maintd(*args: str) -> tuple[int, str]:
        code = cli.main([*args, "--url", daemon[1]])
        return code, capsys.readouterr().out
    return maintd


def shown(run: Callable[..., tuple[int, str]], *args: str) -> str:
    """What `maintd ARGS` printed, once it exited 0 with no repr in it."""
    code, out = run(*args)
    assert code == 0
    assert_text(out)
    return out


SCENES = ["preparing", "approved", "after"]
"""Snapshots of one web-1 daemon: a 3-VM Reboot, a single-VM Freeze and another VM's Redeploy while preparing
(a hook running, one failed with on_failure: continue), once the Freeze was approved and Started, and after it."""


def serve(backend: Answers, scene: str) -> None:
    backend.answers = {"status": load(f"{scene}_status.json"), "events": load(f"{scene}_events.json"),
                       "fleet": load(f"{scene}_fleet.json"), "health": load(f"{scene}_health.json")}
    for e in backend.answers["events"]:
        path = FIXTURES / f"{scene}_event_{'single' if len(e['Resources']) == 1 else 'multi'}.json"
        if e["Resources"] != ["web-3"] and path.exists():
            backend.answers[f"event {e['EventId']}"] = json.loads(path.read_text())


@pytest.mark.parametrize("scene", SCENES)
def test_status_reads_as_text(daemon, run, scene):
    """`maintd status` on the peer backend: grouped sections, `-` for none, yes/no, times with Z; no repr."""
    serve(daemon[0], scene)
    out = shown(run, "status")
    assert "identity=" not in out and "restart_needed" not in out and "dry_run" not in out
    assert re.search(r"^  dry run +no$", out, re.M) and re.search(r"^  restart needed +-$", out, re.M)
    assert all(section_ in out for section_ in ("Daemon", "Rotation", "IMDS", "Events", "State", "Coordination"))


def test_status_says_a_single_vm_event_has_no_peers(daemon, run):
    """The Freeze names only web-1: its peers section says so instead of a bare header."""
    serve(daemon[0], "preparing")
    single = next(e["EventId"] for e in daemon[0].answers["events"] if e["Resources"] == ["web-1"])
    _, out = run("status")
    after = out.split(f"Peers of {single}", 1)[1].splitlines()
    assert after[1].strip() == "none: the event names only this VM"


def test_status_lists_not_ready_reasons_and_drains_one_per_line(daemon, run):
    serve(daemon[0], "preparing")
    _, out = run("status")
    assert "checkpoint is running (attempt 1 of 3, since 2026-11-27T00:17:49Z)" in out, "instants cut to seconds"
    assert re.search(r"^  drains +event:\S+  since 2026-11-27T00:17:38Z: Reboot", out, re.M)


def test_status_with_every_optional_field_filled_reads_as_text(daemon, run):
    """identity learnt, restart needed, a peers file with a problem, a write error, a drain by hand, a field this CLI
    does not know (shown, as text)."""
    body = load("approved_status.json")
    body["coordination"].update(identity={"name": "web-1", "computer_name": "web000001", "scale_set": "web"},
                                peers_file="/etc/maintd/peers.yaml", peers_file_problem="line 2: not a URL")
    body.update(restart_needed=["server.listen", "imds.endpoint"], dry_run=True,
                profile_next_change="2026-11-28T02:00:00Z",
                state={"dir": "/var/lib/maintd", "unsaved_changes": True, "write_error": "No space left on device"},
                silence={"id": "5f2c", "ends_at": "2026-11-27T01:00:00+00:00", "urls": ["http://am-0:9093"]})
    body["drains"]["manual"] = {"reason": "kernel update", "since": "2026-11-27T00:10:00.5Z"}
    daemon[0].answers = {"status": body}
    out = shown(run, "status")
    assert "computer name web000001" in out and "server.listen, imds.endpoint (changed by a reload" in out
    assert re.search(r"^  silence.ends_at +2026-11-27T01:00:00Z$", out, re.M), out


SILENCE = {"state": "keeping", "summary": "silence 5f2c, 9a1e until 2026-11-27T01:00:00Z on 2 of 2 Alertmanagers",
           "silences": {"http://am-0:9093": {"id": "5f2c", "ends_at": "2026-11-27T01:00:00Z"},
                        "http://am-1:9093": {"id": "9a1e", "ends_at": "2026-11-27T01:00:00Z"}}}
"""An `alertmanager` handler's note on an event, as the daemon keeps it (`note:<handler>` among its records)."""


def test_status_shows_the_alertmanager_silence_under_its_own_heading_not_other(daemon, run):
    """An event's silence (the `alertmanager` handler's note) reads under "Handler notes", by event: never under
    "Other", the section for fields this CLI has no words for."""
    body = load("approved_status.json")
    body["notes"] = {"E1": "silence: " + SILENCE["summary"]}
    daemon[0].answers = {"status": body}
    out = shown(run, "status")
    assert "Other" not in out
    assert re.search(r"^Handler notes\n  E1 +silence: silence 5f2c, 9a1e until 2026-11-27T01:00:00Z on 2 of 2 "
                     r"Alertmanagers$", out, re.M), out
    body["notes"] = {}
    assert "Handler notes" not in shown(run, "status")


def test_an_event_shows_its_silence_per_alertmanager_under_handler_notes(daemon, run):
    """`maintd events ID`: the silence's summary, then each replica's silence id and end, under "Handler notes"
    (not dumped as a record)."""
    serve(daemon[0], "approved")
    key = next(k for k, v in daemon[0].answers.items() if k.startswith("event ") and v["Resources"] == ["web-1"])
    daemon[0].answers[key]["results"]["note:silence"] = SILENCE
    out = shown(run, "events", key.split()[1])
    assert "note:silence" not in out and "Other" not in out
    notes = out.split("Handler notes\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert [line.split() for line in notes] == [
        ["silence", *SILENCE["summary"].split(), "(keeping)"],
        ["http://am-0:9093:", "silence", "5f2c", "until", "2026-11-27T01:00:00Z"],
        ["http://am-1:9093:", "silence", "9a1e", "until", "2026-11-27T01:00:00Z"]]


def test_status_on_the_store_backend(daemon, run):
    daemon[0].answers = {"status": load("store_status.json")}
    out = shown(run, "status")
    assert "Coordination (backend azure_blob)" in out and re.search(r"last answer +ok, 1.3s ago", out)


@pytest.mark.parametrize("scene", SCENES)
def test_events_table_and_each_event_read_as_text(daemon, run, scene):
    serve(daemon[0], scene)
    shown(run, "events")
    for key in [k for k in daemon[0].answers if k.startswith("event ")]:
        out = shown(run, "events", key.split()[1])
        assert "Handlers" in out and "Approval" in out


def test_an_event_shows_each_handler_run_and_the_approval(daemon, run):
    serve(daemon[0], "approved")
    single = next(k for k, v in daemon[0].answers.items() if k.startswith("event ") and v["Resources"] == ["web-1"])
    _, out = run("events", single.split()[1])
    assert re.search(r"flaky +scheduled +failed +1 +0s +exit status 1 \(on_failure: continue\)", out), out
    assert re.search(r"checkpoint +scheduled +ok +1 +15s", out)
    assert re.search(r"^  status +sent$", out, re.M) and re.search(r"^  at +2026-11-27T00:18:04Z$", out, re.M)
    assert "none: the event names only this VM" in out


def test_an_event_shows_a_run_that_goes_on_in_the_background(daemon, run):
    """A silence still retrying past its first try reads as not holding anything; once it ended, its row says it
    went on in the background."""
    serve(daemon[0], "approved")
    single = next(k for k, v in daemon[0].answers.items() if k.startswith("event ") and v["Resources"] == ["web-1"])
    event = copy.deepcopy(daemon[0].answers[single])
    event["results"]["handler:silence:scheduled"] = {"outcome": "running", "started_at": "2026-11-27T00:17:49Z",
                                                     "attempt": 1, "background": True}
    event["results"]["handler:notify:scheduled"] = {"outcome": "failed", "detail": "503", "duration_seconds": 39.2,
                                                    "on_failure": "continue", "background": True}
    daemon[0].answers[single] = event
    out = shown(run, "events", single.split()[1])
    assert re.search(r"silence +scheduled +running +1 +since 2026-11-27T00:17:49Z +in the background; preparation "
                     r"went on", out), out
    assert re.search(r"notify +scheduled +failed +- +39s +503 \(on_failure: continue\) \(went on in the background\)",
                     out), out


def test_an_event_held_by_a_gate_shows_the_gate(daemon, run):
    serve(daemon[0], "preparing")
    multi = next(k for k, v in daemon[0].answers.items() if k.startswith("event ") and len(v["Resources"]) == 3)
    held = copy.deepcopy(daemon[0].answers[multi])
    held.update(approval_held={"gate": "prometheus", "reason": "alert HighErrorRate is firing"}, acting_leader="web-1",
                readiness_pushed_to="web-1")
    daemon[0].answers[multi] = held
    daemon[0].answers["events"] = [held]
    table_out = shown(run, "events")
    out = shown(run, "events", held["EventId"])
    assert "held: prometheus" in table_out
    assert re.search(r"^  held +prometheus: alert HighErrorRate is firing$", out, re.M)
    assert re.search(r"web-3 +no +ConnectionError +http://web-3:8088 \(via template\) +14s", out)


def test_fleet_reads_as_text_on_both_backends(daemon, run):
    for fleet in (load("preparing_fleet.json"), load("approved_fleet.json"), load("b_fleet.json"),
                  load("store_fleet.json")):
        daemon[0].answers = {"fleet": fleet}
        shown(run, "fleet")
    store = load("store_fleet.json")
    store["events"][0].update(approval={"by": "app_2", "state": "approved", "attempt": 1,
                                        "at": "2026-11-27T00:31:02.120000+00:00"},
                              store_error="503 ServerBusy", problems=["app_9: marker not written by maintd"])
    daemon[0].answers = {"fleet": store}
    out = shown(run, "fleet")
    assert "approval: approved by app_2 at 2026-11-27T00:31:02Z (attempt 1)" in out
    assert "store: 503 ServerBusy" in out and "problem: app_9" in out
    daemon[0].answers = {"fleet": {"vm_name": "web-1", "backend": "peers", "events": []}}
    assert run("fleet")[1].strip() == "no pending event names web-1 (backend peers)"


def test_health_reads_as_text(daemon, run):
    for scene in SCENES:
        daemon[0].answers = {"health": load(f"{scene}_health.json")}
        out = shown(run, "health")
    assert re.search(r"^Warning +handlers/flaky +2026-11-27T00:17:49Z +scheduled run for", out, re.M)


@pytest.mark.parametrize("command", ["status", "events", "fleet", "health"])
def test_json_is_the_daemons_answer_unchanged(daemon, run, command):
    serve(daemon[0], "approved")
    code, out = run(command, "--json")
    assert code == 0
    assert json.loads(out) == daemon[0].answers[command]


def test_history_reads_as_text(write_config, tmp_path, capsys):
    """`events --history` words the journal: fields as key=value, nested ones dotted, no dict repr."""
    state = tmp_path / "state"
    state.mkdir()
    (state / "journal.jsonl").write_text((FIXTURES / "journal.jsonl").read_text())
    cfg = write_config(f"state: {{dir: {state}}}\n")
    assert cli.main(["events", "--history", "--config", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert_text(out)
    assert "window.profile=default" in out and "window={" not in out
    assert 'detail="exit status 1"' in out and "duration_seconds=0s" in out


# --- the formatting ---------------------------------------------------------------------------

def test_durations_read_like_1m30s():
    assert [duration(s) for s in (None, 0, 0.054, 9.96, 11.055, 90, 3725, 90061, -5)] == \
        ["-", "0s", "0.1s", "10s", "11s", "1m30s", "1h2m", "1d1h", "-5s"]


def test_instants_are_utc_with_z_and_whole_seconds():
    assert when("2026-11-27T00:17:14.271663Z") == "2026-11-27T00:17:14Z"
    assert when("2026-11-27T02:17:14+02:00") == "2026-11-27T00:17:14Z"
    assert when(None) == "-" and when("") == "-" and when("not a time") == "not a time"
    assert tidy("since 2026-11-27T00:17:14.271663Z)") == "since 2026-11-27T00:17:14Z)"
    now = when_dt("2026-11-27T00:00:00Z")
    assert relative("2026-11-27T00:01:30Z", now) == "in 1m30s" and relative("2026-11-26T23:59:57Z", now) == "3s ago"


def when_dt(s: str) -> Any:
    from agent.model.timefmt import parse_iso
    return parse_iso(s)


def test_values_read_as_text():
    assert [text(v) for v in (None, "", [], {}, True, False, 0, 1.5, ["a", "b"])] == \
        ["-", "-", "-", "-", "yes", "no", "0", "1.5", "a, b"]
    assert text({"profile": "default", "window": {"start": "2026-11-27T00:17:38.64Z", "end": None}}) == \
        "profile=default, window.start=2026-11-27T00:17:38Z"


def test_sections_and_tables_align_and_lines_are_cut_not_wrapped():
    assert section("T", [("a", "1"), ("long label", ["x", "y"]), ("c", [])]) == \
        ["T", "  a           1", "  long label  x", "              y", "  c           -"]
    assert table(("A", "BB"), [("xxx", "y")]) == ["A    BB", "xxx  y"]
    assert fit("x" * 100, 80) == "x" * 79 + "~" and fit("short", 80) == "short"


def history(cfg: Path, capsys, *args: str) -> list[str]:
    """The EventIds of the entries `maintd events --history --json ARGS` prints."""
    assert cli.main(["events", "--history", "--json", "--config", str(cfg), *args]) == 0
    return [json.loads(line).get("event_id") for line in capsys.readouterr().out.splitlines()]


def test_history_takes_since_type_and_event(write_config, tmp_path, capsys):
    """--since (a span back from now, or an ISO time), --type (the event's type, any case), --event."""
    from datetime import UTC, datetime, timedelta

    from agent.model.timefmt import iso_z

    state = tmp_path / "state"
    state.mkdir()
    now = datetime.now(UTC)
    lines = [{"t": iso_z(now - timedelta(days=9)), "kind": "event.appeared", "event_id": "OLD", "event_type": "Reboot"},
             {"t": iso_z(now - timedelta(hours=3)), "kind": "event.appeared", "event_id": "R", "event_type": "Reboot"},
             {"t": iso_z(now - timedelta(hours=1)), "kind": "event.appeared", "event_id": "F", "event_type": "Freeze"},
             {"t": iso_z(now - timedelta(minutes=50)), "kind": "rotation.drained", "key": "manual", "by": "uid 0"},
             {"t": iso_z(now - timedelta(minutes=30)), "kind": "approval.sent", "event_id": "R", "by": "vm-1"}]
    (state / "journal.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))
    cfg = write_config(f"state: {{dir: {state}}}\n")
    assert history(cfg, capsys, "--since", "7d") == ["R", "F", None, "R"]
    assert history(cfg, capsys, "--since", "2h") == ["F", None, "R"]
    assert history(cfg, capsys, "--since", iso_z(now - timedelta(minutes=40))) == ["R"]
    assert history(cfg, capsys, "--type", "reboot") == ["OLD", "R", "R"]
    assert history(cfg, capsys, "--type", "Reboot", "--since", "7d") == ["R", "R"]
    assert history(cfg, capsys, "--event", "F") == ["F"]
    assert cli.main(["events", "--history", "--type", "Freeze", "--config", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert_text(out)
    assert "event_type=Freeze" in out and "Reboot" not in out
    with pytest.raises(SystemExit) as refused:
        cli.main(["events", "--history", "--since", "last tuesday", "--config", str(cfg)])
    assert refused.value.code == 2 and "neither a span" in capsys.readouterr().err
