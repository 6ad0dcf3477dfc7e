"""`maintd check-config` warns, at file:line:column, when a profile approves events early that no handler
prepares for (issue 35): such an event is approved as soon as it is announced, the VM unprepared. The config
is still accepted (exit 0): approving unprepared can be a choice, but never a surprise."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from agent.config import config

SHIPPED = Path(__file__).resolve().parents[2] / "config" / "maintd.yaml"
STATE = "state: {{dir: {}}}\n"


def check_config(path: Path) -> tuple[int, list[str]]:
    """Exit status and the warning lines `maintd check-config` printed."""
    done = subprocess.run([sys.executable, "-m", "agent", "check-config", str(path)], capture_output=True,
                          text=True, timeout=60)
    return done.returncode, [line for line in done.stderr.splitlines() if ": warning: " in line]


def test_the_shipped_config_approves_nothing_early_and_check_config_says_nothing(write_config, tmp_path):
    shipped = config.load(SHIPPED, check_perms=False)
    assert [(p.name, p.approval) for p in shipped.profiles] == [("default", "never")]
    assert shipped.handlers == ()
    code, warnings = check_config(write_config(SHIPPED.read_text().replace("/var/lib/maintd", str(tmp_path))))
    assert (code, warnings) == (0, [])


def test_turning_approval_on_without_a_handler_is_warned_at_its_line(write_config, tmp_path):
    """What an operator gets who sets `approval: auto` in the shipped file and uncomments no handler."""
    text = SHIPPED.read_text().replace("/var/lib/maintd", str(tmp_path)).replace("approval: never", "approval: auto")
    line = next(n for n, t in enumerate(text.splitlines(), 1) if t.strip() == "approval: auto")
    path = write_config(text)
    code, warnings = check_config(path)
    assert code == 0
    assert warnings == [
        f"{path}:{line}:5: profiles[0].approval: warning: profile 'default' approves Freeze, Reboot, Redeploy, "
        "Preempt, Terminate early (approval: auto), and no handler prepares for them (phases: [scheduled]): such "
        "an event is approved as soon as it is announced, before its NotBefore, with nothing drained or saved. "
        "Fix: add a scheduled handler for them, or set approval: never to only observe (the event then starts at "
        "its NotBefore)"]


def test_uncommenting_the_shipped_handlers_and_turning_approval_on_is_not_warned(write_config, tmp_path):
    text = SHIPPED.read_text().replace("/var/lib/maintd", str(tmp_path)).replace("approval: never", "approval: auto")
    handlers = text[text.index("# handlers:"):text.index("\n\n", text.index("# handlers:"))]
    text = text.replace(handlers, "\n".join(line.replace("# ", "", 1) for line in handlers.splitlines()))
    text = text.replace("/usr/local/bin/checkpoint", "/bin/true")
    assert len(config.loads(text).handlers) == 2
    assert check_config(write_config(text)) == (0, [])


def test_a_file_without_profiles_gets_the_built_in_auto_profile_and_the_warning(write_config, tmp_path):
    """The code's default is unchanged (approval: auto, as documented), and check-config names it."""
    path = write_config(STATE.format(tmp_path))
    assert [(p.name, p.approval) for p in config.load(path).profiles] == [("default", "auto")]
    code, warnings = check_config(path)
    assert code == 0 and len(warnings) == 1
    assert warnings[0].startswith(f"{path}:1:1: profiles: warning: the built-in profile 'default' (no profiles:) "
                                  "approves Freeze, Reboot, Redeploy, Preempt, Terminate early")


@pytest.mark.parametrize("body,expected", [
    # a drain for some types: the others are named, at the profile's approval
    ("handlers:\n  - {name: drain, type: drain, phases: [scheduled, completed], event_types: [Reboot, Redeploy]}\n"
     "profiles:\n  - {name: default, approval: auto}\n",
     [(5, "profiles[0].approval", "profile 'default' approves Freeze, Preempt, Terminate early")]),
    # a handler that runs only after the start prepares nothing
    ("handlers:\n  - {name: note, type: exec, phases: [completed], command: [/bin/true]}\n"
     "profiles:\n  - {name: default, approval: auto}\n",
     [(5, "profiles[0].approval", "profile 'default' approves Freeze, Reboot, Redeploy, Preempt, Terminate")]),
    # a rule that approves Freeze early in a window that otherwise never approves; the profile lists no handler
    ("handlers:\n  - {name: drain, type: drain, phases: [scheduled, completed]}\n"
     "profiles:\n"
     "  - name: nights\n    approval: never\n    handlers: []\n"
     "    recurrence: {frequency: day, schedule: {hours: [1], minutes: [0]}}\n"
     "    rules:\n      - {event_types: [Freeze], approval: auto}\n"
     "  - {name: default, approval: auto}\n",
     [(10, "profiles[0].rules[0].approval", "profile 'nights' approves Freeze early (approval: auto), and no "
                                            "handler of the profile's handlers prepares for it")]),
    # `immediate` says it does not wait for preparation, `never` and `manual` do not approve on their own
    ("profiles:\n  - name: default\n    approval: never\n    rules:\n"
     "      - {event_sources: [User], approval: immediate}\n      - {event_types: [Freeze], approval: manual}\n",
     []),
])
def test_early_approval_of_unprepared_event_types_is_warned(write_config, tmp_path, body, expected):
    path = write_config(STATE.format(tmp_path) + body)
    code, warnings = check_config(path)
    assert code == 0
    assert len(warnings) == len(expected), warnings
    for warning, (line, key, words) in zip(warnings, expected, strict=True):
        assert warning.startswith(f"{path}:{line}:") and f": {key}: warning: {words}" in warning, warning
