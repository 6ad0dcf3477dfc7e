"""Paths around the config, the hooks and the state are checked the way sshd's StrictModes does (issue 28, LOW 7):
the file and every directory above it owned by root or maintd's user and writable by no one else; the first bad
component is named with its fix. Each test builds its own tree under tmp_path, with the owners and modes it needs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from agent.config.config import load
from agent.errors import ConfigError, StateError
from agent.handlers.base import FAILED
from agent.state.state_file import check_dir
from agent.systemd import Notifier
from agent.trust.pathtrust import first_problem
from tests.cli.test_cli import maintd
from tests.handlers.test_handler_exec import context, exec_handler

NOBODY = 65534
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give files to another user")


def _hook(directory: Path, mode: int = 0o755) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    hook = directory / "ckpt"
    hook.write_text("#!/bin/sh\ntouch \"$0.ran\"\n")
    hook.chmod(0o755)
    directory.chmod(mode)
    return hook


def _config(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o600)
    return path


def test_a_hook_in_a_group_writable_directory_fails_check_config_naming_that_directory(tmp_path):
    """The attack: hooks/ is group-writable, so a group member could replace ckpt. check-config names hooks/ with
    `chmod go-w`, at the handler's command key (file:line), and `maintd run` refuses to start (exit 78)."""
    hook = _hook(tmp_path / "hooks", 0o775)
    cfg = _config(tmp_path / "etc" / "maintd.yaml",
                  f"handlers:\n  - name: ckpt\n    type: exec\n    phases: [scheduled]\n    command: ['{hook}']\n")
    done = maintd("check-config", str(cfg))
    assert done.returncode == 1, done.stdout
    assert "maintd.yaml:5" in done.stderr and "command" in done.stderr
    assert f"{tmp_path / 'hooks'} is writable by group or others (mode 775)" in done.stderr
    assert f"chmod go-w {tmp_path / 'hooks'}" in done.stderr
    run = maintd("run", "--config", str(cfg))
    assert run.returncode == 78 and "chmod go-w" in run.stderr


def test_a_hook_made_replaceable_after_start_is_not_run(tmp_path):
    """Loaded while safe, then its directory made group-writable: the next event's run is refused (failed, with
    the component and the fix) and the program never runs."""
    hook = _hook(tmp_path / "hooks")
    handler = exec_handler(f"{{name: ckpt, type: exec, phases: [scheduled], command: ['{hook}']}}")
    (tmp_path / "hooks").chmod(0o777)
    result = handler.scheduled(context())
    assert result.outcome == FAILED and "chmod go-w" in result.detail and str(tmp_path / "hooks") in result.detail
    assert not Path(f"{hook}.ran").exists()


def test_a_reload_onto_a_replaceable_hook_keeps_the_running_config(tmp_path, clock):
    """SIGHUP after the config was changed to name a hook in a world-writable directory: refused, old config kept."""
    from agent.loop.daemon import Daemon

    safe = _hook(tmp_path / "safe")
    unsafe = _hook(tmp_path / "shared", 0o777)
    item = "handlers:\n  - {{name: ckpt, type: exec, phases: [scheduled], command: ['{}']}}\n"
    cfg = _config(tmp_path / "maintd.yaml", f"identity: {{name: vm1}}\nstate: {{dir: {tmp_path / 'state'}}}\n"
                  + item.format(safe))
    d = Daemon(load(cfg), clock, boot_id="b", notifier=Notifier({}), config_path=str(cfg))
    cfg.write_text(f"identity: {{name: vm1}}\nstate: {{dir: {tmp_path / 'state'}}}\n" + item.format(unsafe))
    assert d.reload() is False and d.config.handlers[0].options.command == (str(safe),)


def test_sticky_shared_directories_are_judged_by_what_lies_below_them(tmp_path):
    """A sticky, world-writable directory (like /tmp) is crossed when the next component is trusted; as the last
    component it is refused."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    (shared / "mine").mkdir(mode=0o700)
    assert first_problem(shared / "mine" / "maintd.yaml") is None
    assert first_problem(shared / "later" / "maintd.yaml") is None  # checked again when it is used
    assert "writable by group or others" in (first_problem(shared) or "")
    assert first_problem(sys.executable) is None


def test_a_symlink_is_judged_through_every_directory_it_passes(tmp_path):
    """A link in a safe directory pointing through a group-writable one is refused at that directory; a loop of
    links is refused, never followed forever."""
    unsafe = tmp_path / "unsafe"
    _config(unsafe / "real.yaml", "{}\n")
    unsafe.chmod(0o770)
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "maintd.yaml").symlink_to(unsafe / "real.yaml")
    assert f"{unsafe} is writable by group" in (first_problem(tmp_path / "etc" / "maintd.yaml") or "")
    (tmp_path / "etc" / "to-unsafe").symlink_to(unsafe / "sub")
    (unsafe / "sub").mkdir()
    assert f"{unsafe} is writable by group" in (first_problem(tmp_path / "etc" / "to-unsafe" / ".." / "real.yaml")
                                                or "")  # `..` after the link: where the kernel goes
    (tmp_path / "etc" / "a").symlink_to("b")
    (tmp_path / "etc" / "b").symlink_to("a")
    assert "symbolic links" in (first_problem(tmp_path / "etc" / "a") or "")


@root_only
def test_a_config_symlink_in_a_directory_another_user_owns_is_refused(tmp_path):
    """The attack: /etc/maintd.yaml -> a directory nobody owns, where the link could be swapped for another YAML
    (owned by root). Refused at load and by check-config, naming the directory nobody owns and `chown root`."""
    theirs = tmp_path / "theirs"
    _config(theirs / "maintd.yaml", "imds: {poll_interval: 2s}\n")
    os.chown(theirs, NOBODY, -1)
    cfg = tmp_path / "maintd.yaml"
    cfg.symlink_to(theirs / "maintd.yaml")
    with pytest.raises(ConfigError, match=f"{theirs} is owned by uid {NOBODY}.*chown root {theirs}"):
        load(cfg)
    done = maintd("check-config", str(cfg))
    assert done.returncode == 1 and f"chown root {theirs}" in done.stderr


@root_only
def test_a_state_dir_another_user_created_is_refused(tmp_path, write_config):
    """The attack: another user made the state dir (0755, their own) and could rename state.json. `maintd run`
    refuses to start, naming the directory and its owner."""
    state = tmp_path / "state"
    state.mkdir(mode=0o755)
    os.chown(state, NOBODY, NOBODY)
    with pytest.raises(StateError, match=f"{state} is owned by uid {NOBODY}"):
        check_dir(state)
    cfg = write_config(f"identity: {{name: vm1}}\nstate: {{dir: {state}}}\n")
    done = maintd("run", "--config", str(cfg))
    assert done.returncode == 78 and f"chown root {state}" in done.stderr
    done = maintd("check-config", str(cfg))
    assert done.returncode == 1 and f"chown root {state}" in done.stderr
    os.chown(state, 0, 0)
    check_dir(state)


def test_maintd_run_creates_a_missing_state_dir_itself(tmp_path):
    """A state dir still missing under a sticky shared directory: `maintd run` makes it (755, its own) before
    judging it, so one another user made first is refused by its owner rather than used."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    check_dir(shared / "state", create=True)
    st = (shared / "state").stat()
    assert st.st_uid == os.geteuid() and st.st_mode & 0o777 == 0o755


@root_only
def test_a_user_who_cannot_look_into_a_directory_gets_no_verdict_root_does(tmp_path):
    """A hook under a directory only root may enter: another user's walk (their `maintd status` reads the config)
    stops there without refusing; root's walk, the daemon's, goes on to the end."""
    private = tmp_path / "private"
    hook = _hook(private / "hooks")
    private.chmod(0o700)
    script = (f"import os; os.setuid({NOBODY}); from agent.trust.pathtrust import first_problem; "
              f"print(first_problem({str(hook)!r}))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=os.getcwd(), timeout=60)
    assert out.stdout.strip() == "None", out.stderr
    (private / "hooks").chmod(0o777)
    assert "chmod go-w" in (first_problem(hook) or "")
