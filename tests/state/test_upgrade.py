"""Upgrade in place: state dirs written by each earlier format are read and carried on; a newer format's
files (a downgrade) are refused, kept aside and never crash maintd."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from agent.model.outcomes import PHASES
from agent.prepare.run_records import RunKey, round_of
from agent.state.journal import JOURNAL_FORMAT, read_journal
from agent.state.state_file import STATE_FORMAT
from agent.state.state_store import Store
from tests.e2e.harness import wait_until
from tests.fixtures.make_state_dirs import EVENT_ID, HOOKS, as_of_now

FIXTURES = Path(__file__).parent.parent / "fixtures"
EARLIER = sorted(FIXTURES.glob("state-format-*/*"))
RECORD = ("import os\n"
          "open(os.environ['OUT'], 'a').write(os.environ['HOOK'] + ':' + os.environ['MAINTD_ATTEMPT'] + '\\n')\n")


def test_new_files_say_their_format(tmp_path, clock):
    """state.json carries `format` (no old `version`), each journal file opens with a format header readers skip."""
    store = Store(tmp_path, clock)
    store.record("E1", "approval", {"status": "sent"}, journal="approval.sent")
    data = json.loads((tmp_path / "state.json").read_text())
    assert data["format"] == STATE_FORMAT and "version" not in data
    first = json.loads((tmp_path / "journal.jsonl").read_text().splitlines()[0])
    assert first == {"kind": "journal.format", "format": JOURNAL_FORMAT}
    assert [e["kind"] for e in read_journal(tmp_path)] == ["approval.sent"]


def test_a_state_file_of_a_newer_format_is_kept_aside_and_maintd_starts_fresh(tmp_path, clock):
    """A downgrade: state.json from a newer maintd is moved aside byte for byte with a message naming both formats."""
    newer = json.dumps({"format": STATE_FORMAT + 1, "events": {"E1": "a shape this maintd cannot know"}})
    (tmp_path / "state.json").write_text(newer)
    store = Store(tmp_path, clock)
    report = store.load()
    assert report.newer_format and store.event_records() == {}
    assert f"format {STATE_FORMAT + 1}, newer than the {STATE_FORMAT}" in report.problem
    assert Path(report.moved_aside).read_text() == newer
    assert Path(report.moved_aside).name.startswith(f"state.json.format-{STATE_FORMAT + 1}-")


def test_a_journal_of_a_newer_format_is_kept_aside_and_never_appended_to(tmp_path, clock):
    """A newer maintd's journal files are neither read back, appended to nor rotated away; a new journal starts."""
    newer = json.dumps({"kind": "journal.format", "format": JOURNAL_FORMAT + 1}) + "\n" + '{"kind":"x.future"}\n'
    (tmp_path / "journal.jsonl").write_text(newer)
    (tmp_path / "journal.jsonl.1").write_text(newer)
    assert list(read_journal(tmp_path)) == [], "a reader skips them even before maintd starts"
    store = Store(tmp_path, clock)
    report = store.load()
    assert len(report.journal_aside) == 2 and all(Path(p).read_text() == newer for p in report.journal_aside)
    store.journal("approval.manual", event_id="E1")
    assert [e["kind"] for e in read_journal(tmp_path)] == ["approval.manual"]


@pytest.mark.parametrize("fixture", EARLIER, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_an_earlier_formats_runs_are_the_first_round_of_their_event(fixture, tmp_path, clock):
    """Rounds (an event prepared again after its budget place was lost) changed no key and no format: an earlier
    format's run records are read as the first round, at the keys the runner looks them up by; a later round's key
    is one an earlier maintd's parser reads as no run at all (a downgrade skips it, never crashes)."""
    shutil.copytree(fixture, tmp_path / "state")
    store = Store(tmp_path / "state", clock)
    store.load()
    results = store.results(EVENT_ID)
    runs = {k: RunKey.parse(k) for k in results if k.startswith("handler:")}
    assert runs and all(r is not None and r.round == 1 and str(r) == k for k, r in runs.items())
    assert round_of(results) == 1
    later = str(RunKey("second", "scheduled", 2))
    assert later == "handler:second:scheduled#2" and later.rpartition(":")[2] not in PHASES


@pytest.mark.e2e
@pytest.mark.parametrize("fixture", EARLIER, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_an_earlier_formats_state_dir_is_carried_on(fixture, start_emulator, start_agent, tmp_path):
    """The new maintd on a state dir an earlier one left mid-preparation: what finished never reruns, the hook
    that was running reruns as attempt 2, the rest runs, one approval; old journal lines still read back."""
    out = tmp_path / "runs"
    emu = start_emulator(["vm-1"])
    emu.add_event(event_type="Reboot", resources=["vm-1"], notice=3600, event_id=EVENT_ID)
    shutil.copytree(fixture, tmp_path / "vm-1" / "state")
    as_of_now(tmp_path / "vm-1" / "state")
    hooks = [{"name": name, "type": "exec", "phases": ["scheduled"], "command": [sys.executable, "-c", RECORD],
              "env": {"OUT": str(out), "HOOK": name}} for name in HOOKS]
    agent = start_agent(emu, "vm-1", {"handlers": hooks})
    agent.wait_log("approval.sent", event_id=EVENT_ID)
    assert out.read_text().split() == ["second:2", "third:1"], "first had finished; second was running"
    assert len(emu.approvals("vm-1")) == 1
    wait_until(lambda: agent.state().get("format") == STATE_FORMAT, 10, "the state file rewritten in this format")
    kinds = [e["kind"] for e in read_journal(agent.workdir / "state")]
    assert kinds[0] == "event.appeared" and {"handler.interrupted", "approval.sent"} <= set(kinds)


from tests.e2e.conftest import start_agent, start_emulator  # noqa: F401,E402 - the same process fixtures
