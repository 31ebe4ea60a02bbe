"""``--app`` module for the launch-fault tests (``tests/faults/test_launch_faults.py``).

One family whose processor appends ``start``/``end`` lines (with its pid and a monotonic time)
to the file named by ``APSUP_TEST_MARKS`` and sleeps ``APSUP_TEST_SLEEP`` seconds between
them. Imported by the forkserver as a preload, it brings ``tests.forkserver_faults`` with it
(so faults can be armed inside the forkserver), and sleeps ``APSUP_TEST_SLOW_IMPORT`` seconds at
import there (a slow preload: the window a signal during startup lands in).
"""

from __future__ import annotations

import os
import time

import tests.forkserver_faults as _faults
from apsup.context import ExecutionContext
from apsup.registry import default_registry, family

if _faults._in_forkserver():
    time.sleep(float(os.environ.get("APSUP_TEST_SLOW_IMPORT", "0") or 0))


def _mark(what: str, scope_id: str) -> None:
    path = os.environ.get("APSUP_TEST_MARKS")
    if not path:
        return
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.write(fd, f"{what} {scope_id} {os.getpid()} {time.monotonic():.6f}\n".encode())
    finally:
        os.close(fd)


if "fork-fault" not in default_registry:

    @family("fork-fault", max_workers=4, timeout=60, registry=default_registry)
    def fork_fault(scope_id: str, ctx: ExecutionContext) -> None:
        _mark("start", scope_id)
        time.sleep(float(os.environ.get("APSUP_TEST_SLEEP", "0") or 0))
        _mark("end", scope_id)
