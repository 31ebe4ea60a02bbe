"""The host's side of one launch: the zygote's answers on its pipes.

The zygote (``apsup.workers.zygote``) answers each launch on the launch's *status pipe*: the
forked pid, later the exit status; the Worker itself writes its pid into the *hold pipe* and
keeps it open for life. Reading these, and only these, tells the pool (``apsup.workers.pool``)
that a Worker runs or has exited; the pool keeps the accounting. Also here: why a zygote did
not start (:func:`preload_problem`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

from apsup.observability.logging import redact
from apsup.workers.fds import read_signed, readable
from apsup.workers.handles import FORKSERVER_EOF_EXITCODE, WorkerHandle
from apsup.workers.processes import close_pidfd, open_pidfd, signal_group


def complete(h: WorkerHandle) -> bool | None:
    """Read a launching Worker's pid (its sentinel is readable): it is running from now on.

    If the forkserver closed the pipe without a pid (it died, maybe right after the fork),
    the Worker may still run: its own pid comes on the hold pipe. False if that pipe is at
    EOF without one (no Worker of this launch runs), None while neither has arrived yet
    (the sentinel is the hold pipe from now on)."""
    if not h.orphan:
        try:
            pid = read_signed(h.sentinel)
        except (OSError, EOFError):
            h.orphan = True
            if h.hold is None or not readable([h.hold], 0):
                return None if h.hold is not None else False
    if h.orphan:
        try:
            if h.hold is None:
                raise EOFError("no hold pipe")
            pid = read_signed(h.hold)
        except (OSError, EOFError):
            return False  # every holder is gone and none wrote a pid: nothing runs
        # Its forkserver is gone: only our own waitpid (as subreaper) can confirm it.
        h._status = FORKSERVER_EOF_EXITCODE
    started = time.monotonic()
    h.pid, h.state, h.started, h.deadline = pid, "running", started, started + h.timeout
    h._popen.pid = pid
    open_pidfd(h)
    if readable([h.sentinel], 0):
        # Its exit status is there already (or the forkserver is gone): read it now. A real
        # status means the forkserver reaped it, maybe before the pidfd was opened, so that
        # pidfd could name a process that reused the number: drop it.
        h._status = read_status(h)
        if h._status != FORKSERVER_EOF_EXITCODE:
            close_pidfd(h)
            h.reaped = True
    if h.terminated and h._status in (None, FORKSERVER_EOF_EXITCODE):
        signal_group(h, signal.SIGTERM)  # a stop requested while it was launching
        h.state, h.term_sent_at = "terminating", started
    return True


def read_status(h: WorkerHandle) -> int:
    """The exit status the forkserver wrote (its sentinel is readable); 255 at EOF."""
    try:
        return int(read_signed(h.sentinel))
    except (OSError, EOFError):
        return FORKSERVER_EOF_EXITCODE


def close_hold(h: WorkerHandle) -> None:
    if h.hold is not None:
        with contextlib.suppress(OSError):
            os.close(h.hold)
        h.hold = None


def preload_problem(modules: list[str], timeout: float) -> str | None:
    """Import ``modules`` in a fresh interpreter, as the forkserver does (default ``sys.path`` +
    ``PYTHONPATH`` + working directory); the last line of its error, or None if they import.
    Without the warm-up's URL file (``apsup.workers.warm`` would take it)."""
    from apsup.workers.warm import ENV as WARM_ENV

    env = {k: v for k, v in os.environ.items() if k != WARM_ENV}
    code = "import importlib, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)\n"
    try:
        done = subprocess.run(
            [sys.executable, "-c", code, *modules],
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return f"the imports did not finish within {timeout:g}s"
    except OSError:
        return None  # cannot tell (no fork for this either): transient
    if done.returncode == 0 or done.returncode < 0:
        return None  # imported, or the check itself was killed by a signal: not the modules
    lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
    return redact(lines[-1])[:300] if lines else f"exit status {done.returncode}"
