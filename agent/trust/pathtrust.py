"""Paths maintd trusts, checked the way sshd's StrictModes checks `~/.ssh`: the file and every directory
above it must be owned by root or maintd's user, and writable by no one else. Used for the config file,
each hook's program and the state dir: whoever could replace any of them runs code, or forges state, as
maintd.

Who is trusted (`trusted_uids`): root, the user maintd runs as, and the `maintd` account when there is one
(a unit may run as it with `User=maintd`), so root's `check-config` judges a path as the daemon would. The
account is looked up only for a path owned by neither of the first two: where it does not exist, the failed
lookup loads the system's NSS modules (libnss_systemd: about 0.5 MB resident for the life of the process).

`first_problem` walks down from `/` one component at a time with `lstat`; a symbolic link is followed by
walking its target the same way, so every directory that could redirect the path is checked (at most
`MAX_LINKS` links). A component is refused when:

- its owner is not trusted;
- it is writable by group or others, except a directory with the sticky bit (`/tmp`) above the last
  component: there others may add names but may not rename or remove what a trusted user owns, so the
  next component (its owner, its mode) decides. sshd refuses `/tmp` outright; maintd's tests, its demo
  and a `mktemp -d` tree live under it.

A path that does not exist yet is judged by the directories above it that do. A name still missing in a
sticky directory could be created by anyone first: each use checks again (a hook before every run, and
`maintd run` creates a missing state dir itself, exclusively, before checking it), so what another user
made is refused by its owner. A directory this user may not look into ends the walk without a verdict:
a user's `maintd status` reads the config too, and root, who runs maintd, sees every component. `..` is
taken where the kernel takes it: after the link before it is followed.
"""

from __future__ import annotations

import os
import pwd
import stat

MAX_LINKS = 40
"""Symbolic links followed in one path (Linux's own limit)."""
SERVICE_USER = "maintd"
"""The account the packaged unit may run as (`User=maintd`)."""


class TrustedUids:
    """root, the user this process runs as, and the `maintd` account when it exists (looked up once, and only
    when asked about another uid)."""

    def __init__(self) -> None:
        self._sure = frozenset({0, os.geteuid()})
        self._service: int | None = None
        self._looked = False

    def __contains__(self, uid: object) -> bool:
        if uid in self._sure:
            return True
        if not self._looked:
            self._looked = True
            try:
                self._service = pwd.getpwnam(SERVICE_USER).pw_uid
            except KeyError:
                pass
        return self._service is not None and uid == self._service


def trusted_uids() -> TrustedUids:
    """Who may own a trusted path (see `TrustedUids`)."""
    return TrustedUids()


def owner(uid: int) -> str:
    """`uid N (name)`, or `uid N` when it has no passwd entry."""
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def component_problem(name: str, st: os.stat_result, uids: TrustedUids, last: bool = True) -> str | None:
    """Why one component (`name`, its `lstat`) lets someone else change the path; None when it does not."""
    if st.st_uid not in uids:
        return f"{name} is owned by {owner(st.st_uid)}, neither root nor maintd's user; fix: chown root {name}"
    if stat.S_ISLNK(st.st_mode) or not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return None
    if stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX and not last:
        return None
    return (f"{name} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o}); "
            f"fix: chmod go-w {name}")


def first_problem(path: str | os.PathLike[str], uids: TrustedUids | None = None) -> str | None:
    """The first component of `path` that someone other than root or maintd's user could change, and the fix;
    None when there is none."""
    uids = trusted_uids() if uids is None else uids
    absolute = os.path.join(os.getcwd(), path)  # not normpath: `link/..` must go where the kernel goes
    todo = [p for p in reversed(absolute.split("/")) if p]
    current, links = "/", 0
    problem = component_problem("/", os.lstat("/"), uids, last=not todo)
    while todo and problem is None:
        name = todo.pop()
        if name in (".", ".."):
            current = os.path.dirname(current) if name == ".." else current
            continue
        candidate = os.path.join(current, name)
        try:
            st = os.lstat(candidate)
        except (FileNotFoundError, PermissionError):  # missing: checked again when used; hidden: not ours to judge
            return None
        except OSError as exc:
            return f"{candidate} cannot be checked: {exc.strerror or exc}"
        problem = component_problem(candidate, st, uids, last=not todo)
        if stat.S_ISLNK(st.st_mode):
            links += 1
            if links > MAX_LINKS:
                return f"{path}: more than {MAX_LINKS} symbolic links"
            target = os.readlink(candidate)
            todo.extend(p for p in reversed(target.split("/")) if p)
            current = "/" if target.startswith("/") else current
            continue
        current = candidate
    return problem

