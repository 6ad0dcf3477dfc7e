"""`maintd watch` under a real terminal: tmux (80x24) runs it against a real `maintd run` and the emulator; the
pane shows the event, its handler and the approval as they happen, and Ctrl-C ends it with status 0 and the
terminal given back (alternate screen left, cursor shown, typed keys echoed again)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.harness import CLEAN_ENV, wait_until

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]


def tmux_binary() -> str:
    found = shutil.which("tmux")
    if found:
        return found
    if os.environ.get("MAINTD_CI") == "1":
        pytest.fail("CI must run the terminal test: tmux is not installed (.ci/run installs it)")
    pytest.skip("tmux is not installed (apt-get install tmux)")


class Tmux:
    """A tmux server of its own (its own socket), one 80x24 pane."""

    def __init__(self, socket: Path) -> None:
        self.argv = [tmux_binary(), "-S", str(socket)]

    def __call__(self, *args: str) -> str:
        return subprocess.run([*self.argv, *args], capture_output=True, text=True, check=True, timeout=10,
                              env=CLEAN_ENV).stdout

    def screen(self) -> str:
        return self("capture-pane", "-p", "-t", "w")

    def pane(self, fmt: str) -> str:
        return self("display-message", "-p", "-t", "w", fmt).strip()


def test_watch_shows_the_event_live_and_ctrl_c_gives_the_terminal_back(start_emulator, start_agent, tmp_path):
    emu = start_emulator(["vm-1"])
    agent = start_agent(emu, "vm-1", {"handlers": [
        {"name": "checkpoint", "type": "exec", "phases": ["scheduled"], "command": ["sleep", "4"]}]})
    tmux = Tmux(tmp_path / "tmux.sock")
    # bash waits for watch, then says how it ended and how the terminal was left (echo and canonical input back on)
    command = (f"{sys.executable} -m agent watch --config {agent.config_path}; echo \"watch exited $?\"; "
               "stty -a | tr ' ' '\\n' | grep -x -e '-*echo' -e '-*icanon' | tr '\\n' ' '; echo '(end)'; exec sleep 60")
    tmux("new-session", "-d", "-s", "w", "-x", "80", "-y", "24", "-c", str(ROOT), "bash", "-c", command)
    try:
        wait_until(lambda: "in rotation" in tmux.screen(), 30, "the view: " + tmux.screen())
        assert tmux.pane("#{alternate_on}") == "1"
        eid = emu.add_event(event_type="Reboot", resources=["vm-1"], notice=300)
        wait_until(lambda: f"Reboot {eid[:8]}  Scheduled" in (s := tmux.screen()) and "checkpoint running" in s,
                   30, "the event and its running hook on the view: " + tmux.screen())
        wait_until(lambda: "approval  sent by vm-1" in tmux.screen(), 60, "the approval: " + tmux.screen())
        shown = tmux.screen()
        assert "checkpoint ok" in shown and all(len(line) < 80 for line in shown.splitlines()), shown
        tmux("send-keys", "-t", "w", "C-c")
        wait_until(lambda: "(end)" in tmux.screen(), 20, "watch to exit on Ctrl-C: " + tmux.screen())
        after = tmux.screen()
        assert "watch exited 0" in after and "icanon echo" in after and "-echo" not in after, after
        assert tmux.pane("#{alternate_on}") == "0" and tmux.pane("#{cursor_flag}") == "1", "the screen and cursor back"
    finally:
        subprocess.run([*tmux.argv, "kill-server"], capture_output=True, timeout=10)
