"""The `exec` handler with real subprocesses: the env/stdin contract, inert event text, process-tree
kills inside the budget, bounded output, failures an operator can read."""

from __future__ import annotations

import json
import os
import pwd
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace

import pytest

from agent.clock import SystemClock
from agent.config.config import loads
from agent.errors import ConfigError
from agent.handlers.base import CANCELED, FAILED, OK, TIMED_OUT, Context
from agent.handlers.exec import ENV_VALUE_MAX, OUTPUT_KEEP
from agent.handlers.registry import instantiate
from agent.model.events import Event

PY = sys.executable
HOSTILE = "$(touch pwned); rm -rf ~ `touch pwned2` && echo ${HOME} \"quoted\" 'single'\nsecond line"
NOT_BEFORE = datetime(2026, 11, 22, 14, 5, tzinfo=UTC)
EVENT_ID = "A1B2C3D4-0000-4000-8000-000000000001"


def exec_handler(yaml_item: str):
    """An exec handler built from one `handlers:` entry, through the real config parser."""
    cfg = loads(f"handlers:\n  - {yaml_item}\n")
    services = SimpleNamespace(clock=SystemClock())
    return instantiate(cfg.handlers, services)[0]


def context(phase="scheduled", timeout=10.0, description="Host server is undergoing maintenance.",
            cancel: threading.Event | None = None, stopping: threading.Event | None = None) -> Context:
    e = Event(event_id=EVENT_ID, event_type="Reboot", status="Started" if phase == "started" else "Scheduled",
              resources=("vm-3", "vm-4"), not_before=NOT_BEFORE if phase == "scheduled" else None,
              description=description, source="Platform", duration_seconds=-1)
    return Context(event=e, phase=phase, vm_name="vm-3", names_self=True, timeout=timeout, deadline=e.not_before,
                   dry_run=False, clock=SystemClock(), cancel=cancel or threading.Event(),
                   stopping=stopping or threading.Event(), outcome="completed" if phase == "completed" else None)


def script(tmp_path: Path, body: str, name: str = "hook.py") -> str:
    """A Python hook written to a file (no quoting games in YAML); returns its path."""
    path = tmp_path / name
    path.write_text(body)
    return str(path)


def alive(pid: int) -> bool:
    """Running (a zombie waiting for a reaper counts as gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return not any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
    except FileNotFoundError:
        return False


# --- the contract ----------------------------------------------------------------------------

def test_the_hook_gets_the_event_in_env_and_stdin_and_nothing_of_maintds_environment(tmp_path, monkeypatch):
    """Every MAINTD_* variable, the stdin JSON, the operator's env and cwd; maintd's own env stays home."""
    monkeypatch.setenv("AZURE_CLIENT_SECRET", "do-not-leak")
    monkeypatch.setenv("NOTIFY_SOCKET", "/run/systemd/notify")
    out = tmp_path / "seen.json"
    hook = script(tmp_path, "import json, os, sys\n"
                            "json.dump({'env': dict(os.environ), 'stdin': json.load(sys.stdin), 'cwd': os.getcwd(),"
                            " 'argv': sys.argv[1:]}, open(os.environ['OUT'], 'w'))\n")
    h = exec_handler(f'{{name: hook, type: exec, phases: [scheduled], command: ["{PY}", "{hook}", "--fast"], '
                     f'cwd: "{tmp_path}", env: {{OUT: "{out}", TEAM: sre}}}}')
    result = h.run(context())
    assert (result.outcome, result.exit_code) == (OK, 0), result
    seen = json.loads(out.read_text())
    env = seen["env"]
    assert {k: v for k, v in env.items() if k.startswith("MAINTD_")} == {
        "MAINTD_EVENT_ID": EVENT_ID,
        "MAINTD_EVENT_TYPE": "Reboot",
        "MAINTD_EVENT_STATUS": "Scheduled",
        "MAINTD_NOT_BEFORE": "2026-11-22T14:05:00Z",
        "MAINTD_RESOURCES": "vm-3,vm-4",
        "MAINTD_PHASE": "scheduled",
        "MAINTD_VM_NAME": "vm-3",
        "MAINTD_DURATION_SECONDS": "-1",
        "MAINTD_EVENT_SOURCE": "Platform",
        "MAINTD_DESCRIPTION": "Host server is undergoing maintenance.",
        "MAINTD_LIVE_MIGRATION": "0",
        "MAINTD_NAMES_THIS_VM": "1",
        "MAINTD_OUTCOME": "",
        "MAINTD_TIMEOUT_SECONDS": "10",
        "MAINTD_ATTEMPT": "1",
    }
    assert seen["stdin"] == {"phase": "scheduled", "vm_name": "vm-3", "names_this_vm": True, "outcome": None,
                             "dry_run": False, "event": {
                                 "EventId": EVENT_ID, "EventType": "Reboot", "ResourceType": "VirtualMachine",
                                 "Resources": ["vm-3", "vm-4"], "EventStatus": "Scheduled",
                                 "NotBefore": "2026-11-22T14:05:00Z",
                                 "Description": "Host server is undergoing maintenance.", "EventSource": "Platform",
                                 "DurationInSeconds": -1, "LiveMigration": False}}
    assert seen["cwd"] == str(tmp_path) and seen["argv"] == ["--fast"]
    assert env["TEAM"] == "sre"
    me = pwd.getpwuid(os.getuid())
    assert env["HOME"] == me.pw_dir and env["USER"] == me.pw_name and env["PATH"].startswith("/usr/local/sbin")
    assert "LANG" in env
    assert "AZURE_CLIENT_SECRET" not in env and "NOTIFY_SOCKET" not in env, "maintd's own environment leaked"
    assert set(env) - {"OUT", "TEAM"} <= {"PATH", "LANG", "HOME", "USER", "LOGNAME"} | {
        k for k in env if k.startswith("MAINTD_")} | {"LC_CTYPE", "PWD"}, sorted(env)


def test_completed_phase_tells_the_outcome(tmp_path):
    """In `completed`, MAINTD_OUTCOME says whether the maintenance happened; NotBefore is empty once started."""
    out = tmp_path / "env.json"
    hook = script(tmp_path, "import json, os; json.dump(dict(os.environ), open(os.environ['OUT'], 'w'))\n")
    h = exec_handler(f'{{name: hook, type: exec, phases: [completed], command: ["{PY}", "{hook}"], '
                     f'env: {{OUT: "{out}"}}}}')
    assert h.run(context(phase="completed")).outcome == OK
    env = json.loads(out.read_text())
    assert (env["MAINTD_PHASE"], env["MAINTD_OUTCOME"]) == ("completed", "completed")


def test_hostile_event_text_stays_inert_even_in_an_operators_shell_script(tmp_path):
    """A Description full of shell syntax reaches a `/bin/sh -c` hook as data: nothing runs, the text is verbatim."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "keep").write_text("still here")
    h = exec_handler(f'{{name: hook, type: exec, phases: [scheduled], cwd: "{tmp_path}", env: {{HOME: "{home}"}}, '
                     'command: [/bin/sh, -c, \'printf "%s" "$MAINTD_DESCRIPTION" > described; cat > stdin.json\']}')
    result = h.run(context(description=HOSTILE))
    assert result.outcome == OK, result
    assert (tmp_path / "described").read_text() == HOSTILE
    assert json.loads((tmp_path / "stdin.json").read_text())["event"]["Description"] == HOSTILE
    assert not (tmp_path / "pwned").exists() and not (tmp_path / "pwned2").exists()
    assert (home / "keep").read_text() == "still here"


def test_a_huge_description_is_cut_in_the_environment_but_whole_on_stdin(tmp_path):
    """Linux refuses an environment value over 128 KiB; the hook still starts and stdin has every byte."""
    out = tmp_path / "seen.json"
    hook = script(tmp_path, "import json, os, sys\n"
                            "json.dump({'env': os.environ['MAINTD_DESCRIPTION'], 'stdin': json.load(sys.stdin)},"
                            " open(os.environ['OUT'], 'w'))\n")
    h = exec_handler(f'{{name: hook, type: exec, phases: [scheduled], command: ["{PY}", "{hook}"], '
                     f'env: {{OUT: "{out}"}}}}')
    big = "é" * 200_000
    assert h.run(context(description=big)).outcome == OK
    seen = json.loads(out.read_text())
    assert len(seen["env"]) == ENV_VALUE_MAX and seen["env"].endswith(" [truncated]")
    assert seen["stdin"]["event"]["Description"] == big


def test_a_hook_that_never_reads_stdin_does_not_block():
    """A megabyte of event JSON and a hook that ignores stdin: the run still ends at once."""
    h = exec_handler("{name: quiet, type: exec, phases: [scheduled], command: [/bin/true]}")
    t0 = time.monotonic()
    assert h.run(context(description="x" * 1_000_000)).outcome == OK
    assert time.monotonic() - t0 < 5


@pytest.mark.skipif(os.geteuid() != 0, reason="switching users needs root")
def test_user_runs_the_hook_under_that_account_with_its_home():
    """`user: nobody` runs the hook with nobody's uid, gid, HOME and USER."""
    h = exec_handler("{name: as-nobody, type: exec, phases: [scheduled], user: nobody, "
                     "command: [/bin/sh, -c, 'id -u; id -g; echo $HOME; echo $USER']}")
    result = h.run(context())
    nobody = pwd.getpwnam("nobody")
    assert result.outcome == OK, result
    assert result.output.split() == [str(nobody.pw_uid), str(nobody.pw_gid), nobody.pw_dir, "nobody"]


# --- failures ----------------------------------------------------------------------------------

def test_a_non_zero_exit_fails_with_the_code_and_the_output(tmp_path):
    """Exit status 3 is `failed`, exit_code 3, and the hook's last words are in the result."""
    h = exec_handler(f'{{name: bad, type: exec, phases: [scheduled], '
                     f'command: ["{PY}", "-c", "import sys; print(\'disk full\'); sys.exit(3)"]}}')
    result = h.run(context())
    assert (result.outcome, result.exit_code, result.detail) == (FAILED, 3, "exit status 3")
    assert result.output == "disk full\n"


@pytest.mark.parametrize("command, says", [
    ('[/no/such/hook, --now]', "no such file or directory: /no/such/hook"),
    ('[no-such-program-anywhere]', "no such file or directory: no-such-program-anywhere"),
])
def test_a_missing_program_fails_with_a_clear_detail(command, says):
    """A command that does not exist is a failed run naming it, not a crash."""
    h = exec_handler(f"{{name: gone, type: exec, phases: [scheduled], command: {command}}}")
    result = h.run(context())
    assert result.outcome == FAILED and result.exit_code is None
    assert says in result.detail


def test_a_program_without_execute_permission_fails_with_a_clear_detail(tmp_path):
    """A hook file that is not executable: `Permission denied` and its path."""
    hook = tmp_path / "ckpt.sh"
    hook.write_text("#!/bin/sh\nexit 0\n")
    hook.chmod(0o644)
    h = exec_handler(f'{{name: noexec, type: exec, phases: [scheduled], command: ["{hook}"]}}')
    result = h.run(context())
    assert result.outcome == FAILED and "Permission denied" in result.detail and str(hook) in result.detail


def test_a_missing_user_or_cwd_fails_at_run_time():
    """`user` and `cwd` are only format-checked in the config; their absence is a failed run that says so."""
    h = exec_handler("{name: h, type: exec, phases: [scheduled], user: no-such-user-here, command: [/bin/true]}")
    assert h.run(context()).detail == "no such user 'no-such-user-here'"
    h = exec_handler("{name: h, type: exec, phases: [scheduled], cwd: /no/such/dir, command: [/bin/true]}")
    result = h.run(context())
    assert result.outcome == FAILED and "/no/such/dir" in result.detail


# --- time and output bounds ----------------------------------------------------------------------

def test_a_timeout_kills_the_whole_process_tree_within_the_budget(tmp_path):
    """A hook that ignores SIGTERM and leaves a `sleep 60` grandchild: both are gone when the run returns,
    and the run returns at its timeout, not a grace later."""
    pids = tmp_path / "pids"
    hook = script(tmp_path, "import os, signal, subprocess, sys, time\n"
                            "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                            "child = subprocess.Popen(['sleep', '60'])\n"
                            f"open({str(pids)!r}, 'w').write(f'{{os.getpid()}} {{child.pid}}')\n"
                            "print('started', flush=True)\n"
                            "time.sleep(60)\n")
    h = exec_handler(f'{{name: slow, type: exec, phases: [scheduled], kill_grace: 5s, command: ["{PY}", "{hook}"]}}')
    t0 = time.monotonic()
    result = h.run(context(timeout=3.0))  # room for the hook to start on a loaded host (1 s was a race)
    elapsed = time.monotonic() - t0
    assert result.outcome == TIMED_OUT and result.exit_code == -9
    assert "timed out after 3s" in result.detail and result.output == "started\n"
    assert elapsed < 3.0 + 3.0, f"the run took {elapsed:.1f}s; the runner abandons it at timeout + 5s"
    leader, grandchild = map(int, pids.read_text().split())
    gone_by = time.monotonic() + 2  # SIGKILL is delivered, not instant: give the kernel a moment to reap
    while (alive(leader) or alive(grandchild)) and time.monotonic() < gone_by:
        time.sleep(0.02)
    assert not alive(leader) and not alive(grandchild), "part of the hook's process tree survived"


def test_a_timeout_sends_sigterm_first_so_a_hook_can_clean_up(tmp_path):
    """SIGTERM reaches the hook before SIGKILL: a hook that traps it can say so and exit."""
    hook = script(tmp_path, "import signal, sys, time\n"
                            "def bye(*_):\n"
                            "    print('cleaning up after SIGTERM', flush=True)\n"
                            "    sys.exit(0)\n"
                            "signal.signal(signal.SIGTERM, bye)\n"
                            "print('ready', flush=True)\n"
                            "time.sleep(60)\n")
    h = exec_handler(f'{{name: polite, type: exec, phases: [scheduled], kill_grace: 400ms, '
                     f'command: ["{PY}", "{hook}"]}}')
    result = h.run(context(timeout=3.0))  # room for the hook to trap SIGTERM on a loaded host (1 s was a race)
    assert result.outcome == TIMED_OUT
    assert result.output == "ready\ncleaning up after SIGTERM\n"


def set_event() -> threading.Event:
    flag = threading.Event()
    flag.set()
    return flag


def test_stopping_maintd_kills_a_running_hook(tmp_path):
    """When maintd stops (ctx.stopping), a running hook's group is killed and the run ends as interrupted."""
    h = exec_handler("{name: long, type: exec, phases: [scheduled], kill_grace: 200ms, command: [sleep, '60']}")
    t0 = time.monotonic()
    result = h.run(context(timeout=60.0, cancel=set_event(), stopping=set_event()))
    assert result.outcome == FAILED and result.detail.startswith("interrupted")
    assert time.monotonic() - t0 < 3


def test_a_hook_is_cut_when_its_event_leaves_the_document(tmp_path):
    """The event is gone (ctx.cancel without a stop): SIGTERM at once, the run is canceled and says so."""
    out, trapping = tmp_path / "got", tmp_path / "trapping"
    hook = script(tmp_path, "import os, signal, sys, time\n"
                            "signal.signal(signal.SIGTERM, "
                            f"lambda *_: (open({str(out)!r}, 'w').write('TERM'), sys.exit(3)))\n"
                            f"open({str(trapping)!r}, 'w').close()\n"
                            "time.sleep(60)\n")
    h = exec_handler(f'{{name: ckpt, type: exec, phases: [scheduled], command: ["{PY}", "{hook}"]}}')
    cancel, canceled_at = threading.Event(), []

    def cancel_once_trapping() -> None:  # a fixed 0.5 s raced a hook slow to start on a loaded host
        deadline = time.monotonic() + 30
        while not trapping.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        canceled_at.append(time.monotonic())
        cancel.set()

    threading.Thread(target=cancel_once_trapping, daemon=True).start()
    result = h.run(context(timeout=60.0, cancel=cancel))
    assert result.outcome == CANCELED and "left the document" in result.detail and "exited on SIGTERM" in result.detail
    assert out.read_text() == "TERM"
    assert time.monotonic() - canceled_at[0] < 3


def test_cancel_grace_wait_lets_the_hook_finish_when_its_event_goes(tmp_path):
    """cancel_grace: wait keeps today's behaviour: the hook runs to its end although the event is gone."""
    h = exec_handler(f"{{name: ckpt, type: exec, phases: [scheduled], cancel_grace: wait, "
                     f"command: [\"{PY}\", -c, 'import time; time.sleep(0.5)']}}")
    result = h.run(context(timeout=60.0, cancel=set_event()))
    assert (result.outcome, result.exit_code) == (OK, 0)


def test_a_nul_byte_in_the_description_does_not_stop_the_hook(tmp_path):
    """IMDS text with NUL (which no environment value can hold) reaches the hook without it."""
    out = tmp_path / "desc"
    hook = script(tmp_path, f"import os\nopen({str(out)!r}, 'w').write(os.environ['MAINTD_DESCRIPTION'])\n")
    h = exec_handler(f'{{name: hook, type: exec, phases: [scheduled], command: ["{PY}", "{hook}"]}}')
    result = h.run(context(description="disk\0maintenance"))
    assert result.outcome == OK, result
    assert out.read_text() == "diskmaintenance"


def test_megabytes_of_output_are_bounded_and_the_tail_is_logged(tmp_path, logs):
    """4 MiB of output: the run finishes, keeps the last 64 KiB, logs the last lines and counts the rest."""
    hook = script(tmp_path, "import sys\n"
                            "for i in range(4096):\n"
                            "    sys.stdout.write(f'{i:06d} ' + 'x' * 1016 + '\\n')\n"
                            "sys.stderr.write('last line on stderr\\n')\n")
    h = exec_handler(f'{{name: chatty, type: exec, phases: [scheduled], command: ["{PY}", "{hook}"]}}')
    result = h.run(context())
    assert result.outcome == OK
    assert len(result.output.encode()) == OUTPUT_KEEP and result.output.endswith("last line on stderr\n")
    logged = [e for e in logs if e["event"] == "hook.output"]
    assert len(logged) == 1
    entry = logged[0]
    assert (entry["handler"], entry["event_id"], entry["phase"]) == ("chatty", EVENT_ID, "scheduled")
    assert entry["truncated_bytes"] == 4096 * 1024 + len("last line on stderr\n") - OUTPUT_KEEP
    lines = entry["lines"].splitlines()
    assert lines[-1] == "last line on stderr" and lines[-2].startswith("004095 ") and len(entry["lines"]) <= 4000


def test_a_silent_hook_logs_no_output(logs):
    """No output, no `hook.output` line."""
    h = exec_handler("{name: quiet, type: exec, phases: [scheduled], command: [/bin/true]}")
    assert h.run(context()).output == ""
    assert not [e for e in logs if e["event"] == "hook.output"]


# --- config --------------------------------------------------------------------------------------

@pytest.mark.parametrize("item, key, says", [
    ("{name: h, type: exec, phases: [scheduled]}", "handlers[0]", "missing required key 'command'"),
    ("{name: h, type: exec, phases: [scheduled], command: []}", "handlers[0].command", "at least 1"),
    ("{name: h, type: exec, phases: [scheduled], command: /bin/true}", "handlers[0].command", "expected a list"),
    ("{name: h, type: exec, phases: [scheduled], command: [/bin/echo, 3]}", "handlers[0].command[1]", "expected text"),
    ("{name: h, type: exec, phases: [scheduled], command: ['']}", "handlers[0].command[0]", "must not be empty"),
    ("{name: h, type: exec, phases: [scheduled], command: [/bin/true], cwd: relative}", "handlers[0].cwd",
     "absolute path"),
    ("{name: h, type: exec, phases: [scheduled], command: [/bin/true], user: 'Bad User'}", "handlers[0].user",
     "a user name"),
    ("{name: h, type: exec, phases: [scheduled], command: [/bin/true], env: {'A-B': x}}", "handlers[0].env.A-B",
     "environment variable name"),
    ("{name: h, type: exec, phases: [scheduled], command: [/bin/true], env: {MAINTD_EVENT_ID: x}}",
     "handlers[0].env.MAINTD_EVENT_ID", "carry the event"),
    ("{name: h, type: exec, phases: [scheduled], command: [/bin/true], kill_grace: 10m}", "handlers[0].kill_grace",
     "too long"),
])
def test_bad_exec_options_are_refused_naming_the_key(item, key, says):
    """Config errors point at the key (and line) with a reason, before anything runs."""
    with pytest.raises(ConfigError) as err:
        loads(f"handlers:\n  - {item}\n", "maintd.yaml")
    assert err.value.key == key and err.value.line == 2
    assert says in err.value.message
