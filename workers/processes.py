"""Process-level primitives of the pool: pidfds, process groups, the subreaper, liveness.

Each one answers a question about a process or signals one, safely against pid reuse (see
:func:`signal_group`); none keeps accounting. The pool (``apsup.workers.pool``) decides when.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import signal
import threading
import time
from collections.abc import Callable

from apsup.workers.handles import WorkerHandle

#: Held while a pidfd is closed, and while another thread signals through pidfds, so that
#: thread never signals through a number the owner just closed (and the kernel reused).
PIDFD_LOCK = threading.Lock()

_PR_SET_CHILD_SUBREAPER = 36
#: ``pidfd_send_signal`` flag (Linux >= 6.9): signal the process group the pidfd's process leads.
_PIDFD_SIGNAL_PROCESS_GROUP = 4
#: Cleared when the kernel refuses that flag; the pool then uses the older rules.
_pidfd_groups = True


def open_pidfd(h: WorkerHandle) -> None:
    """Name the just-forked Worker by a pidfd. ESRCH: it already exited and was reaped (its
    number may be free for reuse from now on)."""
    try:
        h.pidfd = os.pidfd_open(h.pid)
    except ProcessLookupError:
        h.reaped = True
    except (OSError, AttributeError):
        pass  # no pidfds here: the pool signals by number, as before


def close_pidfd(h: WorkerHandle) -> None:
    # Never while another thread signals through it (``WorkerPool.signal_from_thread``).
    with PIDFD_LOCK:
        if h.pidfd is not None:
            with contextlib.suppress(OSError):
                os.close(h.pidfd)
            h.pidfd = None


def _answers_signal_zero(send: Callable[[int, int], None], target: int) -> bool:
    """Signal 0 to ``target``: whether it exists (one we may not signal exists too)."""
    try:
        send(target, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def pid_in_use(pid: int) -> bool:
    return _answers_signal_zero(os.kill, pid)


def become_subreaper() -> bool:
    """Make this process the reaper of its orphaned descendants (Linux >= 3.4), so the Workers
    of a dead forkserver become our children instead of init's. False where unavailable."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def is_alive_child(pid: int | None) -> bool:
    """Whether our direct child ``pid`` has not exited; does not reap it (``WNOWAIT``), so
    the zygote's own ``stop`` can still reap it."""
    if pid is None:
        return False
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None
    except ChildProcessError:
        return False


def group_has_members(pgid: int) -> bool:
    """Whether process group ``pgid`` still has a member (a zombie counts), by signal 0."""
    return _answers_signal_zero(os.killpg, pgid)


def forkserver_died(pid: int | None, settle: float = 1.0) -> bool:
    """After a status pipe hit EOF: did the forkserver die? A dying process closes its files
    before it becomes a zombie, so give it ``settle`` seconds to show as exited; one still
    alive after that wrote a real status of 255."""
    end = time.monotonic() + settle
    while is_alive_child(pid):
        if time.monotonic() >= end:
            return False
        time.sleep(0.005)
    return True


def signal_group(h: WorkerHandle, sig: int, *, group_only: bool = False) -> None:
    """Signal the Worker's process group; before the child's ``setsid`` (the group does not
    exist yet) the Worker alone, unless only the group is wanted.

    Never a recycled group. The forkserver reaps a Worker before its status reaches us, and
    from then on its number is free once its group is empty: a ``killpg`` on that number
    could hit the group of an unrelated process that got the number and called ``setsid``
    (another Worker, say). So the pool signals through the pidfd opened at launch, which
    names the Worker's process itself, not a number:

    - Linux >= 6.9: ``pidfd_send_signal`` with ``PIDFD_SIGNAL_PROCESS_GROUP`` reaches exactly
      the group the Worker created, also after the Worker was reaped while stragglers
      remain, and nothing once that group is gone: exact, no race.
    - Older kernels: ``killpg`` only while the pidfd shows the Worker unreaped (a live or
      zombie process keeps its number), or, once it is reaped, only while no process has
      its number (a number cannot be reused while stragglers keep it as their pgid, so a
      process with that number means our group is gone).
    - Without pidfds: ``killpg`` as long as the exit is unconfirmed; after it, the second
      rule alone.
    """
    global _pidfd_groups
    if h.pid <= 0:
        return  # not forked yet (``"launching"``): no process to signal; 0 is our own group
    fd = h.pidfd
    if fd is not None and _pidfd_groups:
        try:
            signal.pidfd_send_signal(fd, sig, None, _PIDFD_SIGNAL_PROCESS_GROUP)
            return
        except ProcessLookupError:
            pass  # no group (before ``setsid``) or it is empty
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                return
            _pidfd_groups = False  # an older kernel: the rules below
        if _pidfd_groups:
            if not group_only:
                with contextlib.suppress(OSError):
                    signal.pidfd_send_signal(fd, sig)
            return
    reaped = h.reaped
    if fd is not None and not reaped:
        try:
            signal.pidfd_send_signal(fd, 0)
        except ProcessLookupError:
            reaped = True
        except OSError:
            pass
    if reaped and pid_in_use(h.pid):
        return  # the number names another process now: our group is gone
    try:
        os.killpg(h.pid, sig)
        return
    except ProcessLookupError:
        if group_only or reaped:
            return
    except PermissionError:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(h.pid, sig)
