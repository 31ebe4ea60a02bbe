"""What every benchmark does with the processes and servers it starts: nothing outlives it.

A benchmark that is stopped (SIGTERM from ``timeout``, Ctrl-C) or fails must not leave a host,
its zygote, a publisher or a private database server running. ``stop_on_signals`` turns SIGTERM
and SIGINT into ``SystemExit`` so that every ``finally`` and ``with`` below ``main`` runs; each
child started through ``child_group`` leads its own process group, which is stopped whole
(SIGTERM, then SIGKILL after a grace) when the block ends, however it ends.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any


class PhaseFailed(SystemExit):
    """A phase did not complete within its bound: exit 1 with one line saying which."""

    def __init__(self, message: str) -> None:
        print(f"benchmark failed: {message}", file=sys.stderr, flush=True)
        super().__init__(1)


def _stop(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def stop_on_signals() -> None:
    """SIGTERM and SIGINT end the benchmark through its cleanup, not around it."""
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def stop_group(proc: subprocess.Popen[Any], grace: float = 20.0) -> None:
    """SIGTERM ``proc``'s process group, SIGKILL it after ``grace``; reap ``proc``."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(grace)
    # Whatever is left of the group (a zygote, Workers) goes too.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(10)


@contextlib.contextmanager
def child_group(
    args: Sequence[str], grace: float = 20.0, **kwargs: Any
) -> Iterator[subprocess.Popen[Any]]:
    """``Popen(args)`` as the leader of a new process group, stopped whole on exit."""
    proc = subprocess.Popen(list(args), start_new_session=True, **kwargs)
    try:
        yield proc
    finally:
        stop_group(proc, grace)
