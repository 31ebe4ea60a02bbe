"""Worker process side (installed as ``apsup.workers``): launching through a preloaded
forkserver, timeouts, termination and confirmed exits (``pool``), the child bootstrap
(``child``) and the exit-code contract (``exit_codes``)."""

from apsup.workers.child import WorkerTerminated
from apsup.workers.exit_codes import ExitCode
from apsup.workers.pool import ForkServerStuck, WorkerExit, WorkerHandle, WorkerPool, WorkerState

__all__ = [
    "ExitCode",
    "ForkServerStuck",
    "WorkerExit",
    "WorkerHandle",
    "WorkerPool",
    "WorkerState",
    "WorkerTerminated",
]
