"""The forkserver ``build_host`` starts prepares its memory for forking (``apsup.workers.warm``).

It runs the async Worker's event-loop machinery once (closing every loop, starting no thread),
its preloaded objects are frozen out of the garbage collector (a Worker's collections never walk
them) and its heap is trimmed and collapsed into huge pages where the kernel allows. The host
process imports the same module and must do none of it: a frozen host would never collect the
garbage cycles it creates later. Workers forked from the prepared image still run and
acknowledge as before.
"""

from __future__ import annotations

import gc
import os
from pathlib import Path

from multiprocess.connection import wait

from apsup.store import worker_preload
from apsup.supervisor.launcher import WARM_MODULE, _start_pool
from apsup.workers import ExitCode
from apsup.workers.invoke import TARGET

TARGETS = "tests.worker_targets"


def test_forkserver_image_is_frozen_and_the_host_is_not(db_url: str, tmp_path: Path) -> None:
    import apsup.workers.warm  # noqa: F401  (the host imports it too, through the launcher)

    assert gc.get_freeze_count() == 0, "the host process froze its own garbage collector"
    report = tmp_path / "freeze.txt"
    modules = [TARGET.split(":", 1)[0], TARGETS, *worker_preload(db_url), WARM_MODULE]
    pool = _start_pool(modules, db_url, grace_seconds=5.0)
    try:
        handle = pool.launch("w1", f"{TARGETS}:report_gc_freeze", str(report).encode(), 60)
        while len(pool):
            wait(pool.sentinels(), 5.0)
            exits = pool.poll()
            if exits:
                assert exits[0].worker_id == handle.worker_id
                assert exits[0].exitcode == ExitCode.SUCCESS, exits[0].reason
    finally:
        pool.close()
    frozen, pid, threads, loop_set = (int(x) for x in report.read_text().split())
    assert pid != os.getpid()
    assert frozen > 1000, "the forkserver did not freeze its preloaded objects"
    # The event-loop warm-up ran and left nothing a fork must not copy.
    assert threads == 1, "the forkserver's warm-up left a thread behind"
    assert loop_set == 0, "the forkserver's warm-up left an event loop set"
    assert gc.get_freeze_count() == 0
