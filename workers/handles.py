"""What the pool knows of each launch: its handle, its status pipe, and the exit it reports.

Plain data shared by the pool's accounting (``apsup.workers.pool``), the host's side of the
launch protocol (``apsup.workers.launches``) and the process primitives that signal a Worker
(``apsup.workers.processes``); no behaviour beyond reading fields.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import Any, Literal

from apsup.errors import ForkServerStuck as ForkServerStuck
from apsup.workers.exit_codes import ExitCode, describe

__all__ = ["ForkServerStuck", "StatusPipe", "WorkerExit", "WorkerHandle", "WorkerState"]

#: ``launching``: sent to the forkserver, pid not reported yet (occupies capacity; see
#: ``WorkerPool.submit``). ``running``: before its deadline. ``terminating``: SIGTERM sent to
#: its group. ``killing``: SIGKILL sent. ``unconfirmed``: no exit status after SIGKILL +
#: ``confirm_seconds``, or the forkserver that would report it is gone; still occupies capacity
#: (RFC §6).
WorkerState = Literal["launching", "running", "terminating", "killing", "unconfirmed"]

#: What a status pipe at EOF reads as (the zygote died).
FORKSERVER_EOF_EXITCODE = 255
#: Exits of a stopped Worker (graceful, second SIGTERM, SIGTERM before its handler, SIGKILL).
STOP_CODES = frozenset(
    {ExitCode.TERMINATED, ExitCode.FORCED_EXIT, ExitCode.KILLED_SIGTERM, ExitCode.KILLED_SIGKILL}
)


@dataclass(frozen=True, slots=True)
class WorkerExit:
    """A confirmed Worker exit (the forkserver's ``waitpid`` status reached us)."""

    worker_id: str
    #: ``ExitCode`` value, or any other exit status; ``-N`` = killed by signal N.
    exitcode: int
    #: Signal number that killed the Worker, ``None`` if it exited by itself.
    signal: int | None
    #: The pool terminated it because its deadline passed.
    timed_out: bool
    #: Seconds from launch to confirmation (monotonic).
    duration: float
    pid: int
    #: Stopped by ``terminate_all`` (shutdown or lease loss) rather than by its deadline.
    terminated: bool = False
    #: The launch failed and no Worker ran (``pid`` 0): the type of the error, e.g.
    #: ``ForkServerStuck``. Only :meth:`WorkerPool.submit` reports launch failures as exits.
    launch_error: str | None = None
    #: The Worker's wrapper vouched for ``exitcode`` on the launch's hold pipe, a descriptor
    #: the processor is never given. Only a vouched code keeps its special meaning (the
    #: host acknowledging for the Worker, a conflict, a stale term, storage trouble): a
    #: processor's own ``sys.exit(N)`` or ``os._exit(N)`` is never vouched for.
    vouched: bool = False

    @property
    def reason(self) -> str:
        """Log-safe outcome, e.g. ``SUCCESS``, ``TERMINATED``, ``KILLED_SIGKILL``, ``SIGSEGV``."""
        if self.launch_error is not None:
            return "LAUNCH_FAILED"
        return describe(self.exitcode)


@dataclass(slots=True, eq=False)
class WorkerHandle:
    """A launched Worker that still occupies capacity (exit not yet confirmed)."""

    worker_id: str
    #: 0 while ``"launching"`` (the forkserver has not reported it yet).
    pid: int
    target: str
    #: ``time.monotonic()`` right after the child's pid arrived (while ``"launching"``: when
    #: the launch was sent); the timeout counts from here.
    started: float
    #: While ``"launching"``: when the forkserver counts as stuck (``ForkServerStuck``).
    deadline: float
    state: WorkerState = "running"
    #: Seconds from the Worker's start to its deadline.
    timeout: float = 0.0
    timed_out: bool = False
    terminated: bool = False
    term_sent_at: float | None = None
    kill_sent_at: float | None = None
    #: The forkserver died: this Worker's exit can never be confirmed (kept until ``close``).
    status_lost: bool = False
    #: The forkserver died and this Worker was reparented to us: we ``waitpid`` it ourselves;
    #: the pidfd (if the kernel has them) becomes readable when it exits.
    adopted: bool = False
    #: A pidfd naming this Worker's process (opened at launch): signals go through it, so they
    #: never reach a process that merely reuses the number (see ``processes.signal_group``).
    pidfd: int | None = None
    #: The Worker's process is known to be reaped: its pid (and pgid) may now name another.
    reaped: bool = False
    #: Read end of the launch's hold pipe. The forked Worker keeps the write end for its whole
    #: life and writes its own pid into it first, so a Worker whose forkserver died before
    #: reporting it is still found (its pid arrives here), and EOF without a pid proves that
    #: no Worker of this launch runs (``apsup.workers.child._report_pid``).
    hold: int | None = None
    #: The forkserver closed this launch's pipe without a pid: the pid is awaited on ``hold``.
    orphan: bool = False
    _popen: Any = field(default=None, repr=False)
    _forkserver_pid: int | None = field(default=None, repr=False)
    #: The status read from the forkserver's pipe (255 at EOF), once read.
    _status: int | None = field(default=None, repr=False)

    @property
    def sentinel(self) -> int:
        """Readable once the forkserver has written this Worker's pid (``"launching"``) or exit
        status (or, adopted, once the Worker has exited)."""
        if self.adopted and self.pidfd is not None:
            return self.pidfd
        if self.orphan and self.hold is not None:
            return self.hold
        return int(self._popen.sentinel)


class StatusPipe:
    """One launch's end of its status pipe: the zygote writes the pid, then the exit status."""

    __slots__ = ("pid", "sentinel")

    def __init__(self, sentinel: int) -> None:
        self.sentinel = sentinel
        self.pid: int | None = None

    def close(self) -> None:
        if self.sentinel >= 0:
            with contextlib.suppress(OSError):
                os.close(self.sentinel)
            self.sentinel = -1
