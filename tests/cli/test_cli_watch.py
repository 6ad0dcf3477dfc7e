"""`maintd watch` as a view: every scene of a real daemon's answers fits 80 columns, reads as text, shows each
event's handlers, approval and peers (or store); the loop redraws until Ctrl-C and gives the terminal back.
Under a real terminal: tests/e2e/test_watch_e2e.py."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest

from agent.cli import cliwatch
from agent.model.timefmt import parse_iso
from tests.cli.test_cli_text import assert_text

FIXTURES = Path(__file__).parent.parent / "fixtures" / "cli"
NOW = parse_iso("2026-11-27T00:18:05Z")


def answers(scene: str) -> tuple[Any, Any, Any]:
    return tuple(json.loads((FIXTURES / f"{scene}_{what}.json").read_text())
                 for what in ("status", "events", "fleet"))  # type: ignore[return-value]


@pytest.mark.parametrize("scene", ["preparing", "approved", "after", "store"])
def test_every_line_fits_80_columns_and_reads_as_text(scene):
    lines = cliwatch._frame(cliwatch.screen(*answers(scene), NOW), 80, 50)
    assert all(len(line) < 80 for line in lines), [line for line in lines if len(line) >= 80]
    assert_text("\n".join(lines))


def test_the_view_shows_rotation_each_event_its_handlers_the_approval_and_the_peers():
    shown = "\n".join(cliwatch.screen(*answers("approved"), NOW))
    assert "rotation  OUT of rotation: event:A5670B9F, event:521B128F" in shown
    assert "Reboot A5670B9F  Scheduled  not before 2026-11-27T00:27:38Z (in 9m33s)" in shown
    assert "handlers  drain ok 11s | flaky failed 0s | checkpoint ok 15s" in shown
    assert "approval  sent by web-1 at 2026-11-27T00:18:04Z" in shown
    assert "peers     web-2 ready | web-3 not seen" in shown and "none: the event names only this VM" in shown
    assert "names web-3, not this VM" in shown
    store = "\n".join(cliwatch.screen(*answers("store"), NOW))
    assert "coord     store, last answer ok 1.3s ago" in store and "store     app_2 ready | app_3 not seen" in store


def test_a_short_terminal_shows_what_fits_and_says_how_much_is_left_out():
    lines = cliwatch._frame(cliwatch.screen(*answers("preparing"), NOW), 40, 8)
    assert len(lines) == 8 and lines[-1].startswith("... 11 more lines") and all(len(x) < 40 for x in lines)


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_redraws_each_second_until_ctrl_c_then_gives_the_terminal_back():
    """Three views, a failed fetch shown on the view (the last answers kept), then Ctrl-C: exit 0, the screen and the
    cursor restored."""
    fetched = iter([answers("preparing"), answers("approved"), SystemExit("maintd: cannot reach the daemon at x"),
                    KeyboardInterrupt()])
    slept: list[float] = []

    def fetch() -> tuple[Any, Any, Any]:
        got = next(fetched)
        if isinstance(got, BaseException):
            raise got
        return got

    out = Tty()
    assert cliwatch.run(fetch, out, sleep=slept.append) == 0
    text = out.getvalue()
    assert text.startswith(cliwatch.ENTER) and text.endswith(cliwatch.LEAVE)
    assert text.count("\x1b[H") == 3 and len(slept) == 3
    assert "PROBLEM   cannot reach the daemon at x" in text.rsplit("\x1b[H", 1)[1]


def test_not_a_terminal_prints_the_view_once():
    out = io.StringIO()
    assert cliwatch.run(lambda: answers("store"), out) == 0
    assert "\x1b" not in out.getvalue() and "Reboot 8750C748" in out.getvalue()
