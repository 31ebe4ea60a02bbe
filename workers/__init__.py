"""Worker process side (installed as ``apsup.workers``): the launcher (``zygote``, a
pre-warmed process that forks one Worker per message), the pool's accounting of capacity,
timeouts, termination and confirmed exits (``pool``, over ``launches``, ``processes`` and
``handles``), the child bootstrap (``child``, ``invoke``) and the exit-code contract
(``exit_codes``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from apsup.workers.child import WorkerTerminated
from apsup.workers.exit_codes import ExitCode

if TYPE_CHECKING:
    from apsup.workers.pool import (
        ForkServerStuck,
        WorkerExit,
        WorkerHandle,
        WorkerPool,
        WorkerState,
    )

_POOL_NAMES = frozenset(
    {"ForkServerStuck", "WorkerExit", "WorkerHandle", "WorkerPool", "WorkerState"}
)


def __getattr__(name: str) -> Any:
    # The pool (host side, with ``multiprocess``) is imported on first use, not by the zygote
    # and its Workers, which import this package for the child bootstrap: less image for every
    # fork to copy page tables of.
    if name in _POOL_NAMES:
        from apsup.workers import pool

        return getattr(pool, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ExitCode",
    "ForkServerStuck",
    "WorkerExit",
    "WorkerHandle",
    "WorkerPool",
    "WorkerState",
    "WorkerTerminated",
]
