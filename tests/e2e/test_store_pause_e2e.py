"""End to end, the store backend with a VM paused (SIGSTOP: a frozen VM, a live migration, swapping): real
agents, the emulator, Azurite behind the fault-injecting proxy. The operator's outcome: at most one
StartRequests POST per event, never before every VM's hook has ended."""

from __future__ import annotations

from pathlib import Path

import pytest

import tests.needs_azure  # noqa: F401 - skips this module without the azure extra
from tests.azurite import Azurite, azurite  # noqa: F401 - the fixture
from tests.store_chaos import TAKEOVER, paused_claimer, paused_preparing, start_fleet

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("imds_500", [False, True], ids=["after-claim", "in-retry-backoff"])
def test_a_claimer_paused_for_twice_takeover_after_never_makes_a_second_post(
        start_emulator, start_agent, tmp_path: Path, azurite: Azurite, imds_500: bool) -> None:
    """4 VMs; the VM that claims is paused right after its claim (or, its first POST answered 500 by IMDS,
    inside its retry backoff) and resumed 2 x takeover_after later, when another VM has taken the claim over:
    exactly one POST is accepted, after the last hook, and the woken claimer sends none."""
    fleet = start_fleet(start_emulator, start_agent, tmp_path, azurite, (0.3, 0.5, 0.8, 1.2))
    try:
        result = paused_claimer(fleet, imds_500=imds_500)
    finally:
        fleet.stop()
    assert result.figures["claimer_posts_after_resume"] == 0, result
    assert (result.approvals, result.early) == (1, 0), result


def test_a_vm_paused_while_its_hook_runs_is_waited_for(start_emulator, start_agent, tmp_path: Path,
                                                       azurite: Azurite) -> None:
    """The slowest VM is paused while its 6 s hook runs, for 3 x takeover_after: its hook ends during the
    pause, and the one POST comes only after it resumed and said so (silence is never readiness)."""
    fleet = start_fleet(start_emulator, start_agent, tmp_path, azurite, (0.3, 0.5, 6.0))
    try:
        result = paused_preparing(fleet, 3 * TAKEOVER)
    finally:
        fleet.stop()
    assert (result.approvals, result.early) == (1, 0), result
    assert result.figures["after_resume_s"] >= 0, result
