"""Secret files (bearer tokens): read safely, refused when others could read them, problems told once.

A token file is re-read when it changes (a rotated token needs no restart): one `os.stat` per use,
a read only when the file's identity, size, mtime or ctime moved, or while it is refused (the fix
may be to a directory above it). What a security-minded operator
of a fleet expects, and what this does:

- **Fail closed.** A configured token file that is missing, empty, unreadable, a directory, not
  UTF-8, holds spaces or control characters, or is readable by others never means "no token
  needed": `read()` answers `REFUSED`, an empty token that matches no caller's (what the token
  guards refuses every remote caller; loopback clients keep what the server grants them) and
  that no client sends (peers are sent no token, never a placeholder they could replay). A file
  that is not configured is `None`, as before.
- **Others must not read it.** Readable by others, or writable by group or others: refused.
  Readable by its group only when that group is maintd's own (`root:maintd 0640`, the usual way to
  hand a secret to a service user).
- **Others must not choose it.** Owned by someone other than root or maintd's user, or in a
  directory another user could change (`agent.trust.pathtrust`, as for the config): refused, since whoever
  writes the server token may drain and approve.
- **Told once.** A problem is logged once (`secret.unusable`, error, with the fix) and shown as the
  health report `config/<key>` (Error) until it is fixed (`secret.usable`); never an exception.
"""

from __future__ import annotations

import errno
import os
import re
import stat
import threading
from collections.abc import Callable

from agent.telemetry import logs
from agent.trust.pathtrust import component_problem, first_problem, trusted_uids

MAX_SECRET_BYTES = 64 * 1024
_TOKEN = re.compile(r"[\x21-\x7e]+")  # visible ASCII: what an HTTP header value can carry as is

Signature = tuple[int, ...]

REFUSED = ""
"""What `SecretFiles.read` answers for a configured token file it refuses: no token. `token_ok` matches no
caller against it and the peer client sends no `Authorization` with it (both treat an empty token as none)."""


def signature(path: str) -> Signature:
    """What changes when the file is replaced, rewritten or chmod-ed (an errno when it cannot be stat-ed)."""
    try:
        st = os.stat(path)
    except OSError as exc:
        return (-(exc.errno or errno.EIO),)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def read_token(path: str) -> tuple[str | None, str | None]:
    """(token, None) or (None, the problem and its fix) for the secret file at `path`."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None, "does not exist; create it (mode 600) or unset the key"
    except PermissionError:
        return None, f"cannot be read by maintd's user (uid {os.geteuid()}); fix its owner or group"
    except OSError as exc:
        return None, f"cannot be read: {exc.strerror or exc}"
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None, "is not a regular file"
        uids = trusted_uids()
        problem = mode_problem(path, st) or component_problem(path, st, uids) or first_problem(path, uids)
        if problem:
            return None, problem
        raw = os.read(fd, MAX_SECRET_BYTES + 1)
    except OSError as exc:
        return None, f"cannot be read: {exc.strerror or exc}"
    finally:
        os.close(fd)
    if len(raw) > MAX_SECRET_BYTES:
        return None, f"is larger than {MAX_SECRET_BYTES} bytes; a token is one line"
    try:
        value = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        return None, "is not UTF-8 text; write the token as one line of text"
    if not value:
        return None, "is empty; write the token into it"
    if not _TOKEN.fullmatch(value):
        return None, "holds spaces or control characters inside the token; write it as one line"
    return value, None


def mode_problem(path: str, st: os.stat_result) -> str | None:
    """Why the file's mode lets the wrong users read or change it (None when it does not)."""
    mode = stat.S_IMODE(st.st_mode)
    if st.st_mode & (stat.S_IROTH | stat.S_IWOTH | stat.S_IWGRP):
        return f"can be read or changed by other users (mode {mode:o}); fix: chmod 600 {path}"
    if st.st_mode & stat.S_IRGRP and st.st_gid != os.getegid():
        return (f"is readable by group {st.st_gid}, which is not maintd's (gid {os.getegid()}); "
                f"fix: chmod 600 {path}, or chgrp it to maintd's group")
    return None


ProblemReport = Callable[[str, "str | None"], None]
"""Told a config key and what is wrong with its file, or None once it is usable again (the daemon
turns this into the `config/<key>` Error health report)."""


class SecretFiles:
    """The token files named in the config, by config key; thread-safe (HTTP threads read them)."""

    def __init__(self, report: ProblemReport) -> None:
        self.report = report
        self.log = logs.get("secrets")
        self._lock = threading.Lock()
        # key: path, signature, value, problem
        self._seen: dict[str, tuple[str, Signature, str | None, str | None]] = {}

    def read(self, key: str, path: str | None) -> str | None:
        """The token for config `key` (None when unset; `REFUSED` when the file is unusable)."""
        with self._lock:
            seen = self._seen.get(key)
            if not path:
                if seen is not None:
                    del self._seen[key]
                    self.report(key, None)
                return None
            sig = signature(path)
            if seen is None or seen[:2] != (path, sig) or seen[3]:  # refused: read again (the fix may be above it)
                value, problem = read_token(path)
                self._tell(key, path, problem, seen[3] if seen else None)
                seen = self._seen[key] = (path, sig, value, problem)
            return REFUSED if seen[3] else seen[2]

    def _tell(self, key: str, path: str, problem: str | None, before: str | None) -> None:
        if problem and problem != before:
            self.log.error("secret.unusable", key=key, path=path, problem=problem,
                           effect="refused: callers that need this token are turned away until it is fixed")
            self.report(key, f"{path} {problem}")
        elif before and not problem:
            self.log.info("secret.usable", key=key, path=path)
            self.report(key, None)
