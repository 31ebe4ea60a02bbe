"""Faults injected inside a Worker forkserver, for the launch-path regression tests.

Preloaded by the forkserver (the tests name it in the pool's preload list or import it from a
family module). When ``APSUP_TEST_FORK_FAULTS`` names a folder, this module wraps the
forkserver's fork (``apsup.workers.fork.fork``) in the forkserver process (never in the host:
the host imports it only without the variable, or through a family module whose import happens
before the variable matters). A file in that
folder arms one fault, consumed when it fires:

- ``fail-next-fork``: the next fork raises ``OSError(EAGAIN)`` (a kernel that refuses a fork;
  the forkserver dies of it);
- ``die-after-fork``: the forkserver SIGKILLs itself right after the next fork, before it
  reports the child's pid to the host; the child runs on.
"""

from __future__ import annotations

import errno
import os
import signal

ENV = "APSUP_TEST_FORK_FAULTS"


def _armed(folder: str, name: str) -> bool:
    try:
        os.unlink(os.path.join(folder, name))
    except FileNotFoundError:
        return False
    return True


def install(folder: str) -> None:
    # The zygote forks through ``apsup.workers.fork.fork`` (libc's fork() or os.fork()): the
    # faults wrap that, whichever of the two it uses.
    from apsup.workers import fork as forking

    real_fork = forking.fork

    def fork() -> tuple[int, bool]:
        if _armed(folder, "fail-next-fork"):
            raise OSError(errno.EAGAIN, "injected: fork refused")
        pid, lean = real_fork()
        if pid != 0 and _armed(folder, "die-after-fork"):
            os.kill(os.getpid(), signal.SIGKILL)
        return pid, lean

    forking.fork = fork


def _in_forkserver() -> bool:
    try:
        with open("/proc/self/cmdline", "rb") as fh:
            return b"apsup.workers.zygote" in fh.read()
    except OSError:
        return False


_folder = os.environ.get(ENV)
if _folder and _in_forkserver():
    install(_folder)
