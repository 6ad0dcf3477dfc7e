"""`exec`: run an operator's hook or checkpoint command for a phase.

The command is a list run without a shell; the event reaches it only through `MAINTD_*`
environment variables and JSON on stdin, so event text (a Description such as
`$(touch pwned); rm -rf ~`) is never interpreted. The hook gets a minimal environment (PATH, LANG,
HOME of its user, plus `env`), not maintd's own. It runs in its own session so a timeout kills the
whole process tree: SIGTERM to the group, then SIGKILL after `kill_grace`. Output (stdout and
stderr merged) is read on a thread and bounded: only the last `OUTPUT_KEEP` bytes are kept.
"""

from __future__ import annotations

import os
import pwd
import signal
import subprocess
import threading
from dataclasses import dataclass
from typing import IO, Any

from agent import logs
from agent.configschema import duration, list_of, mapping_of, opt, optional, text
from agent.errors import ConfigValueError
from agent.handlers.base import FAILED, OK, TIMED_OUT, Context, Handler, Result

OUTPUT_KEEP = 64 * 1024
"""Bytes of a hook's output kept (the tail); the rest is counted, not stored."""
LOG_LINES = 20
LOG_CHARS = 4000
ENV_VALUE_MAX = 32 * 1024
"""Longest environment value passed (Linux refuses one over 128 KiB); the full event is on stdin."""
BASE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def _command(value: Any) -> tuple[str, ...]:
    items = list_of(text(), min_len=1)(value)
    if not items[0]:
        raise ConfigValueError("", "the program (first item) must not be empty")
    return items


@dataclass(frozen=True)
class ExecOptions:
    command: tuple[str, ...] = opt(_command, doc='program and arguments, e.g. ["/usr/local/bin/ckpt", "--fast"]; '
                                                 "no shell unless you write [/bin/sh, -c, ...]")
    user: str | None = opt(optional(text(r"^[a-z_][a-z0-9_.-]*\$?$", "a user name")), None,
                           "run as this user (maintd must run as root)")
    cwd: str | None = opt(optional(text(r"^/", "an absolute path")), None, "working directory (default /)")
    env: dict[str, str] = opt(mapping_of(text(allow_empty=True)), {}, "extra environment variables")
    kill_grace: float = opt(duration(0, 300), 5.0, "after a timeout, seconds between SIGTERM and SIGKILL")


class _Tail:
    """Reads a pipe to its end on a thread, keeping the last OUTPUT_KEEP bytes."""

    def __init__(self, pipe: IO[bytes]) -> None:
        self.pipe = pipe
        self.data = bytearray()
        self.dropped = 0
        self.thread = threading.Thread(target=self._read, name="hook-output", daemon=True)
        self.thread.start()

    def _read(self) -> None:
        while chunk := self.pipe.read1(65536):  # type: ignore[attr-defined]
            self.data += chunk
            if len(self.data) > OUTPUT_KEEP:
                self.dropped += len(self.data) - OUTPUT_KEEP
                del self.data[:-OUTPUT_KEEP]

    def text(self) -> str:
        return self.data.decode("utf-8", "replace")


def _feed(pipe: IO[bytes], payload: bytes) -> None:
    """Write stdin on a thread: a hook that never reads stdin must not block maintd."""
    try:
        pipe.write(payload)
    except (BrokenPipeError, OSError):
        pass
    finally:
        try:
            pipe.close()
        except OSError:
            pass


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _kill_group(proc: subprocess.Popen[bytes], grace: float) -> None:
    """SIGTERM the hook's process group, then after `grace` SIGKILL whatever is left of it."""
    _signal_group(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        pass
    _signal_group(proc.pid, signal.SIGKILL)  # children may outlive a leader that obeyed SIGTERM
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        pass


class ExecHandler(Handler):
    type_name = "exec"
    Options = ExecOptions

    def environment(self, ctx: Context, account: pwd.struct_passwd | None) -> dict[str, str]:
        """The hook's whole environment: a minimal base, the event, then the operator's `env`."""
        home = account.pw_dir if account else os.environ.get("HOME", "/root")
        base = {"PATH": BASE_PATH, "LANG": os.environ.get("LANG", "C.UTF-8"), "HOME": home}
        if account:
            base.update(USER=account.pw_name, LOGNAME=account.pw_name)
        event = {k: v if len(v) <= ENV_VALUE_MAX else v[:ENV_VALUE_MAX - 14] + " [truncated]"
                 for k, v in ctx.environment().items()}
        return {**base, **event, **self.options.env}

    def _run(self, ctx: Context) -> Result:
        o = self.options
        log = logs.get("exec")
        account = None
        if o.user:
            try:
                account = pwd.getpwnam(o.user)
            except KeyError:
                return Result(FAILED, f"no such user {o.user!r}")
        try:
            proc = subprocess.Popen(
                list(o.command), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                cwd=o.cwd or "/", env=self.environment(ctx, account), start_new_session=True, close_fds=True,
                user=account.pw_uid if account else None, group=account.pw_gid if account else None,
                extra_groups=os.getgrouplist(account.pw_name, account.pw_gid) if account else None)
        except (OSError, subprocess.SubprocessError, ValueError) as exc:
            return Result(FAILED, f"cannot start {o.command[0]}: {exc}")
        assert proc.stdin is not None and proc.stdout is not None
        threading.Thread(target=_feed, args=(proc.stdin, ctx.payload_json()), daemon=True).start()
        tail = _Tail(proc.stdout)
        timed_out = False
        try:
            proc.wait(max(0.0, ctx.timeout))
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc, o.kill_grace)
        tail.thread.join(5)
        output = tail.text()
        if output or tail.dropped:
            log.info("hook.output", handler=self.spec.name, event_id=ctx.event.event_id, phase=ctx.phase,
                     lines="\n".join(output.splitlines()[-LOG_LINES:])[-LOG_CHARS:], truncated_bytes=tail.dropped)
        if timed_out:
            return Result(TIMED_OUT, f"killed after {ctx.timeout:.0f}s (process group: SIGTERM, then SIGKILL)",
                          exit_code=proc.returncode, output=output)
        if proc.returncode != 0:
            return Result(FAILED, f"exit status {proc.returncode}", exit_code=proc.returncode, output=output)
        return Result(OK, "exit status 0", exit_code=0, output=output)

    def scheduled(self, ctx: Context) -> Result:
        return self._run(ctx)

    def started(self, ctx: Context) -> Result:
        return self._run(ctx)

    def completed(self, ctx: Context) -> Result:
        return self._run(ctx)
