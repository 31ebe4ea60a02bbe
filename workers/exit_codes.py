"""Worker exit codes: the only channel from a Worker back to the Supervisor.

The Supervisor never receives results from a Worker (RFC §6): durable progress lives in the
database. The exit code only tells it which backoff rule applies (RFC §7), so it stays small:

====  ==========================  ==============================================================
code  name                        Supervisor reaction
====  ==========================  ==============================================================
0     SUCCESS                     release capacity, clear the failure count (acknowledged in the db)
1     PROCESSOR_FAILURE           ordinary failure: exponential backoff
2     BAD_CONTEXT                 payload/context unreadable or target not importable: backoff
3     PROGRESS_CONFLICT           processor's own CAS lost a race: fixed short redispatch delay
4     STALE_TERM                  the dispatching term is gone: control event, no failure counted
5     TERMINATED                  stopped gracefully by the first SIGTERM (timeout or shutdown)
6     STORAGE_FULL                the database could not write: disk full     } infrastructure:
7     STORAGE_READ_ONLY           the database could not write: read-only     } short fixed retry,
8     STORAGE_IO                  the database could not write: I/O error     } no backoff growth
9     RETURNED_UNACKNOWLEDGED     the processor returned without acknowledging: the Supervisor
                                  acknowledges for it, fenced by the dispatching term (contexts
                                  with ``host_acknowledges``), then classifies as for 0
143   FORCED_EXIT                 second SIGTERM during graceful cleanup: ``os._exit(143)``
255   STATUS_LOST                 gone, status lost with the forkserver: the intent row decides
-15   KILLED_SIGTERM              SIGTERM hit before the child installed its handler
-9    KILLED_SIGKILL              killed after the grace period (or by the OOM killer)
====  ==========================  ==============================================================

Codes 3-9 mean what the table says only when the wrapper vouched for them: it writes the code
it exits with on the launch's hold pipe, a descriptor the processor is never given
(``WorkerExit.vouched``). A processor's own ``sys.exit(N)`` or ``os._exit(N)`` is a failure
whatever N is, and exit 0 counts only with the durable acknowledgment
(``apsup.supervisor.exits``).

Negative values follow ``multiprocess``/``subprocess``: ``-N`` means "killed by signal N"; any
such value is reported, the two above are just the ones the pool itself sends. Targets may only
return 0..127 (see ``apsup.workers.child``) so that 128+N and 255 keep their conventional
meanings; 255 is what ``multiprocess`` fabricates when the forkserver dies, which the pool never
takes as an exit: it adopts the Worker and confirms its real exit itself. 255 is reported only
for a Worker that is confirmed gone (reaped by the forkserver before it died) but whose status
was lost with it; the Supervisor then classifies it from the durable intent row alone.
"""

from __future__ import annotations

import signal
from enum import IntEnum

#: Largest exit code a target may return; larger values are reported as PROCESSOR_FAILURE.
MAX_TARGET_EXIT_CODE = 127


class ExitCode(IntEnum):
    """Exit codes of a Worker child; see the module docstring for the Supervisor's reaction."""

    SUCCESS = 0
    PROCESSOR_FAILURE = 1
    BAD_CONTEXT = 2
    PROGRESS_CONFLICT = 3
    STALE_TERM = 4
    TERMINATED = 5
    STORAGE_FULL = 6
    STORAGE_READ_ONLY = 7
    STORAGE_IO = 8
    RETURNED_UNACKNOWLEDGED = 9
    #: The earlier name of 9 (it named a request, not what happened); kept as an alias.
    ACKNOWLEDGE = 9
    FORCED_EXIT = 128 + signal.SIGTERM
    STATUS_LOST = 255
    KILLED_SIGTERM = -signal.SIGTERM
    KILLED_SIGKILL = -signal.SIGKILL


def describe(exitcode: int) -> str:
    """A short, log-safe name for an exit code (``ExitCode`` name, ``SIGSEGV``, or ``exit 7``)."""
    try:
        return ExitCode(exitcode).name
    except ValueError:
        pass
    if exitcode < 0:
        try:
            return signal.Signals(-exitcode).name
        except ValueError:
            return f"signal {-exitcode}"
    return f"exit {exitcode}"


#: Storage-level failure kinds (``apsup.store.storage``) by exit code, and back.
STORAGE_EXITS: dict[int, str] = {
    ExitCode.STORAGE_FULL: "full",
    ExitCode.STORAGE_READ_ONLY: "read_only",
    ExitCode.STORAGE_IO: "io",
}
STORAGE_EXIT_CODES: dict[str, ExitCode] = {
    kind: ExitCode(code) for code, kind in STORAGE_EXITS.items()
}
