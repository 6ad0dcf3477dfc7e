"""The `pacemaker` handler's one edge: the cluster's own tools, run with explicit argument lists.

`crm_node -n` (this node's name), `crm_mon -1 --output-as=xml` (nodes and resources),
`cibadmin --query/--create/--modify/--delete` (maintd's lock and claims in `crm_config`) and
`crm_attribute --lifetime reboot` (standby). Never a shell, never crmsh (whose `node standby` pings
the name first and does nothing, exit 0, when it does not resolve). What a command line carries is
built by `pacemaker_state` from node names, safe event ids and numbers only.

A command is run by a `Run` (argv, timeout) -> `Done`; tests hand a fake one.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from dataclasses import dataclass

from agent.handlers.pacemaker_state import (
    Claim,
    Claims,
    ClusterView,
    Lock,
    claim_xml,
    claim_xpath,
    lock_xml,
    lock_xpath,
    parse_claims,
    parse_mon,
)

EXISTS = 108
"""cibadmin's exit status when `--create` meets an element of the same id (pcmk CRM_EX_EXISTS: 'File exists')."""
COMMAND_TIMEOUT = 15.0


@dataclass(frozen=True)
class Done:
    code: int
    out: str = ""
    err: str = ""


Run = Callable[[list[str], float], Done]


class CommandError(Exception):
    """A cluster command failed or could not run; `command` is the tool's name (a metric label)."""

    def __init__(self, command: str, detail: str) -> None:
        super().__init__(f"{command}: {detail}")
        self.command = command


ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C"}


def run_command(argv: list[str], timeout: float) -> Done:
    """Run one tool: no shell, a fixed PATH and locale, its output captured, killed at `timeout`."""
    env = dict(ENV)
    for key in ("CIB_file", "CIB_shadow"):  # an operator's shadow CIB would be what we change: never inherit it
        env.pop(key, None)
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env, stdin=subprocess.DEVNULL,
                              check=False, errors="replace")
    except FileNotFoundError:
        return Done(127, "", f"{argv[0]} is not installed (install pacemaker-cli-utils)")
    except subprocess.TimeoutExpired:
        return Done(124, "", f"no answer within {timeout:g}s")
    except OSError as exc:
        return Done(126, "", os.strerror(exc.errno or 0) or str(exc))
    return Done(done.returncode, done.stdout, done.stderr)


class Cluster:
    """The cluster's tools as the handler uses them."""

    def __init__(self, run: Run = run_command, timeout: float = COMMAND_TIMEOUT) -> None:
        self._run = run
        self.timeout = timeout

    def _call(self, argv: list[str], ok: tuple[int, ...] = (0,)) -> Done:
        done = self._run(argv, self.timeout)
        if done.code not in ok:
            detail = (done.err or done.out).strip().splitlines()
            raise CommandError(argv[0], f"exit {done.code}: {detail[-1][:300] if detail else 'no output'}")
        return done

    def node_name(self) -> str:
        return self._call(["crm_node", "-n"]).out.strip()

    def view(self) -> ClusterView:
        try:
            return parse_mon(self._call(["crm_mon", "-1", "--output-as=xml"]).out)
        except ValueError as exc:
            raise CommandError("crm_mon", str(exc)) from None

    def claims(self) -> Claims:
        try:
            return parse_claims(self._call(["cibadmin", "--query", "--scope", "crm_config"]).out)
        except ValueError as exc:
            raise CommandError("cibadmin", str(exc)) from None

    def create(self, xml: str) -> bool:
        """Create an element in crm_config; False when one of its id exists (someone else won)."""
        return self._call(["cibadmin", "--create", "--scope", "crm_config", "--xml-text", xml],
                          ok=(0, EXISTS)).code == 0

    def take_lock(self, lock: Lock) -> bool:
        return self.create(lock_xml(lock))

    def drop_lock(self, lock: Lock) -> None:
        """Delete this lock, only if it is still this one."""
        self._call(["cibadmin", "--delete", "--xpath", lock_xpath(lock)])

    def put_claim(self, claim: Claim) -> bool:
        return self.create(claim_xml(claim))

    def renew_claim(self, claim: Claim) -> None:
        self._call(["cibadmin", "--replace", "--scope", "crm_config", "--xml-text", claim_xml(claim)])

    def drop_claim(self, claim: Claim) -> None:
        """Delete this claim, only if it was not renewed or made again since it was read."""
        self._call(["cibadmin", "--delete", "--xpath", claim_xpath(claim)])

    def standby(self, node: str, on: bool) -> None:
        """Standby for this boot of the node (the status section: gone when the node leaves the cluster)."""
        base = ["crm_attribute", "--node", node, "--name", "standby", "--lifetime", "reboot"]
        self._call(base + (["--update", "on"] if on else ["--delete"]))
