"""Children of the test run die with it: a run killed by a signal runs no fixture's teardown, and a server it
started (Azurite, Alertmanager, Prometheus, a maintd) must not outlive it. `die_with_parent` is a Popen
`preexec_fn`: the kernel sends the child SIGKILL when the thread that started it ends, so use it only for
children started on the test's main thread (fixtures and tests are)."""

from __future__ import annotations

import ctypes
import signal

_LIBC = ctypes.CDLL(None, use_errno=True)
PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
