"""`exec`: run an operator's hook or checkpoint command for a phase.

The command is a list run without a shell; the event reaches it only through `MAINTD_*`
environment variables and JSON on stdin, so event text (a Description such as
`$(touch pwned); rm -rf ~`) is never interpreted. The hook gets a minimal environment (PATH, LANG,
HOME/USER/LOGNAME of the account it runs as, the event, then `env`), never maintd's own: no
`NOTIFY_SOCKET`, no proxy settings, no secrets that happen to be in maintd's environment.

It runs in its own session, so a timeout reaches the whole process tree. The handler's `timeout`
is the longest the tree may live, kill included: SIGTERM goes to the process group `kill_grace`
before the budget ends (at most half of the budget), SIGKILL when it ends. That keeps the run
inside the runner's budget, which in the scheduled phase ends before NotBefore. A stop of maintd
kills the hook the same way. When the event leaves the document (canceled or over) the hook is
cut too: SIGTERM at once, SIGKILL `cancel_grace` later; `cancel_grace: wait` lets it run to its
end instead. NUL bytes, which no environment value can hold, are dropped from the values. Output
(stdout and stderr merged) is read on a thread and bounded: only the last `OUTPUT_KEEP` bytes are
kept, the rest is counted.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import IO, Any, cast

from agent.errors import ConfigValueError
from agent.handlers.base import CANCELED, FAILED, OK, TIMED_OUT, Context, Handler, Result
from agent.model.config_schema import duration, list_of, mapping_of, opt, optional, text
from agent.telemetry import logs
from agent.trust.pathtrust import first_problem

OUTPUT_KEEP = 64 * 1024
"""Bytes of a hook's output kept (the tail); the rest is counted, not stored."""
LOG_LINES = 20
LOG_CHARS = 4000
ENV_VALUE_MAX = 32 * 1024
"""Longest environment value passed (Linux refuses one over 128 KiB); the full event is on stdin."""
BASE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
POLL = 0.1
"""How often a waiting run looks at maintd's stop flag."""
REAP = 1.0
"""Seconds allowed, after the hook exited or was killed, for its exit status and the last output."""
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _env(value: Any) -> dict[str, str]:
    env = mapping_of(text(allow_empty=True))(value)
    for name in env:
        if not _ENV_NAME.match(name):
            raise ConfigValueError(name, "not a valid environment variable name (letters, digits, _)")
        if name.startswith("MAINTD_"):
            raise ConfigValueError(name, "MAINTD_* variables carry the event and cannot be set here")
    return cast(dict[str, str], env)


def _duration_or_wait(value: Any) -> float | None:
    """A grace in seconds, or `wait` (None): never cut the hook when its event goes."""
    return None if value == "wait" else duration(0, 300)(value)


@dataclass(frozen=True)
class ExecOptions:
    command: tuple[str, ...] = opt(list_of(text(), min_len=1),
                                   doc='program and arguments, e.g. ["/usr/local/bin/ckpt", "--fast"]; '
                                       "no shell unless you write [/bin/sh, -c, ...]")
    user: str | None = opt(optional(text(r"^[a-z_][a-z0-9_.-]*\$?$", "a user name")), None,
                           "run as this user (maintd must run as root)")
    cwd: str | None = opt(optional(text(r"^/", "an absolute path")), None, "working directory (default /)")
    env: dict[str, str] = opt(_env, {}, "extra environment variables")
    kill_grace: float = opt(duration(0, 300), 5.0,
                            "on timeout, seconds between SIGTERM and SIGKILL to the hook's process group; "
                            "both fall within timeout (the grace is at most half of it)")
    cancel_grace: float | None = opt(_duration_or_wait, 5.0,
                                     "when the event leaves the document, seconds between SIGTERM and SIGKILL "
                                     "to the hook's process group; wait: let the hook run to its end")

    def validate(self) -> None:
        problem = program_problem(self.command[0], self.cwd)
        if problem:
            raise ConfigValueError("command", problem)


def program_problem(program: str, cwd: str | None) -> str | None:
    """Why the hook's program (looked up on the hooks' PATH when it has no slash, under `cwd` when relative) could
    be replaced by someone other than root or maintd's user (`agent.trust.pathtrust`); None when it cannot, or when it
    is not there (it then fails to start)."""
    found = os.path.join(cwd or "/", program) if "/" in program else shutil.which(program, path=BASE_PATH)
    problem = first_problem(found) if found else None
    return problem and f"{problem} (another user could replace the hook {found}, which runs with maintd's rights)"


class _Tail:
    """Reads a pipe to its end on a thread, keeping the last OUTPUT_KEEP bytes."""

    def __init__(self, pipe: IO[bytes]) -> None:
        self.pipe = pipe
        self.data = bytearray()
        self.dropped = 0
        self.thread = threading.Thread(target=self._read, name="hook-output", daemon=True)
        self.thread.start()

    def _read(self) -> None:
        with self.pipe:
            while chunk := self.pipe.read1(65536):  # type: ignore[attr-defined]
                self.data += chunk
                if len(self.data) > OUTPUT_KEEP:
                    self.dropped += len(self.data) - OUTPUT_KEEP
                    del self.data[:-OUTPUT_KEEP]

    def text(self) -> str:
        return bytes(self.data).decode("utf-8", "replace")


def _feed(pipe: IO[bytes], payload: bytes) -> None:
    """Write stdin on a thread: a hook that never reads stdin must not block maintd."""
    try:
        pipe.write(payload)
    except OSError:  # BrokenPipeError: the hook exited or closed stdin without reading it all
        pass
    finally:
        try:
            pipe.close()
        except OSError:
            pass


def _wait(proc: subprocess.Popen[bytes], seconds: float, cancel: threading.Event | None = None) -> bool:
    """Wait up to `seconds` for the hook to exit; False when it is still running (time is up, or `cancel` is set)."""
    end = time.monotonic() + seconds
    while True:
        left = end - time.monotonic()
        if left <= 0 or (cancel is not None and cancel.is_set()):
            return proc.poll() is not None
        try:
            proc.wait(min(POLL, left) if cancel is not None else left)
            return True
        except subprocess.TimeoutExpired:
            continue


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _kill_group(proc: subprocess.Popen[bytes], grace: float) -> bool:
    """SIGTERM the hook's process group, then after `grace` SIGKILL whatever is left of it; True when
    the hook had exited on SIGTERM."""
    _signal_group(proc.pid, signal.SIGTERM)
    obeyed = _wait(proc, grace)
    _signal_group(proc.pid, signal.SIGKILL)  # children may outlive a leader that obeyed SIGTERM
    _wait(proc, REAP)
    return obeyed


def _account(name: str | None) -> pwd.struct_passwd | None:
    """The account the hook runs as: `name`, or maintd's own (None when it has no passwd entry)."""
    if name is not None:
        return pwd.getpwnam(name)
    try:
        return pwd.getpwuid(os.getuid())
    except KeyError:
        return None


class ExecHandler(Handler):
    type_name = "exec"
    Options = ExecOptions

    def environment(self, ctx: Context, account: pwd.struct_passwd | None) -> dict[str, str]:
        """The hook's whole environment: a minimal base, the event, then the operator's `env`."""
        base = {"PATH": BASE_PATH, "LANG": os.environ.get("LANG", "C.UTF-8"),
                "HOME": account.pw_dir if account else "/"}
        if account:
            base.update(USER=account.pw_name, LOGNAME=account.pw_name)
        event = {k: v if len(v) <= ENV_VALUE_MAX else v[:ENV_VALUE_MAX - 12] + " [truncated]"
                 for k, v in ctx.environment().items()}
        return {k: v.replace("\0", "") for k, v in {**base, **event, **self.options.env}.items()}

    def _start(self, ctx: Context, account: pwd.struct_passwd | None) -> subprocess.Popen[bytes]:
        o = self.options
        ids: dict[str, Any] = {}
        if o.user is not None and account is not None and account.pw_uid != os.geteuid():
            ids = {"user": account.pw_uid, "group": account.pw_gid,
                   "extra_groups": os.getgrouplist(account.pw_name, account.pw_gid)}
        return subprocess.Popen(
            list(o.command), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            cwd=o.cwd or "/", env=self.environment(ctx, account), start_new_session=True, close_fds=True, **ids)

    def _run(self, ctx: Context) -> Result:
        o = self.options
        try:
            account = _account(o.user)
        except KeyError:
            return Result(FAILED, f"no such user {o.user!r}")
        problem = program_problem(o.command[0], o.cwd)
        if problem:
            return Result(FAILED, f"refused to start {o.command[0]}: {problem}")
        try:
            proc = self._start(ctx, account)
        except PermissionError as exc:
            hint = " (running as another user needs maintd to run as root)" if o.user and os.geteuid() else ""
            return Result(FAILED, f"cannot start {o.command[0]}: {exc.strerror}: {exc.filename or o.command[0]}{hint}")
        except FileNotFoundError as exc:
            missing = exc.filename or o.command[0]
            return Result(FAILED, f"cannot start {o.command[0]}: no such file or directory: {missing}")
        except (OSError, subprocess.SubprocessError, ValueError) as exc:
            return Result(FAILED, f"cannot start {o.command[0]}: {exc}")
        assert proc.stdin is not None and proc.stdout is not None
        threading.Thread(target=_feed, args=(proc.stdin, ctx.payload_json()), name="hook-input", daemon=True).start()
        tail = _Tail(proc.stdout)
        grace = min(o.kill_grace, ctx.timeout / 2)
        finished = _wait(proc, ctx.timeout - grace, ctx.stopping if o.cancel_grace is None else ctx.cancel)
        cut = not finished and ctx.event_gone and o.cancel_grace is not None
        kill_after = o.cancel_grace if cut and o.cancel_grace is not None else grace
        obeyed = not finished and _kill_group(proc, kill_after)
        tail.thread.join(REAP)
        output = tail.text()
        if output or tail.dropped:
            logs.get("exec").info("hook.output", handler=self.spec.name, event_id=ctx.event.event_id, phase=ctx.phase,
                                  lines="\n".join(output.splitlines()[-LOG_LINES:])[-LOG_CHARS:],
                                  truncated_bytes=tail.dropped)
        code = proc.returncode
        if cut:
            how = "it exited on SIGTERM" if obeyed else f"SIGKILL followed {round(kill_after, 1):g}s later"
            return Result(CANCELED, f"the event left the document: the hook's process group got SIGTERM; {how}",
                          exit_code=code, output=output)
        if not finished and ctx.stopping.is_set():
            return Result(FAILED, "interrupted: maintd is stopping; the hook's process group was killed",
                          exit_code=code, output=output)
        if not finished:
            return Result(TIMED_OUT, f"timed out after {round(ctx.timeout, 1):g}s: its process group got SIGTERM, "
                                     f"then SIGKILL {round(grace, 1):g}s later", exit_code=code, output=output)
        if code != 0:
            status = f"killed by signal {-code}" if code < 0 else f"exit status {code}"
            return Result(FAILED, status, exit_code=code, output=output)
        return Result(OK, "exit status 0", exit_code=0, output=output)

    def scheduled(self, ctx: Context) -> Result:
        return self._run(ctx)

    def started(self, ctx: Context) -> Result:
        return self._run(ctx)

    def completed(self, ctx: Context) -> Result:
        return self._run(ctx)
