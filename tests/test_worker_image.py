"""The forkserver ``build_host`` starts prepares its memory for forking (``apsup.workers.warm``).

It runs the async Worker's event-loop machinery once (closing every loop, starting no thread),
its preloaded objects are frozen out of the garbage collector (a Worker's collections never walk
them) and its heap is trimmed and collapsed into huge pages where the kernel allows. The host
process imports the same module and must do none of it: a frozen host would never collect the
garbage cycles it creates later. Workers forked from the prepared image still run and
acknowledge as before.

The image holds what Workers use and not what only the host does (the pool and
``multiprocess``, the Prometheus client and HTTP server, and the async engine unless a family is
``async def``), and its C heap has no free chunk left for a Worker's ``malloc`` to copy.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import orjson
import pytest
from multiprocess.connection import wait

from apsup.store import migrate, worker_preload
from apsup.supervisor.launcher import WARM_MODULE, _start_pool, build_host
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


HOST_ONLY = [
    "multiprocess",
    "apsup.workers.pool",
    "apsup.workers.launches",
    "apsup.workers.processes",
    "prometheus_client",
    "http.server",
]
ASYNC_ENGINE = ["apsup.store.async_engine", "aiosqlite"]


def _image_modules(db_url: str, tmp_path: Path, preload: list[str], names: list[str]) -> set[str]:
    report = tmp_path / "modules.txt"
    pool = _start_pool([*preload, TARGETS, WARM_MODULE], db_url, grace_seconds=5.0)
    try:
        payload = orjson.dumps({"path": str(report), "modules": names})
        pool.launch("w1", f"{TARGETS}:report_modules", payload, 60)
        while len(pool):
            wait(pool.sentinels(), 5.0)
            for ex in pool.poll():
                assert ex.exitcode == ExitCode.SUCCESS, ex.reason
    finally:
        pool.close()
    return set(report.read_text().split()) - {"-"}


@pytest.mark.backends("sqlite")
def test_the_worker_image_leaves_host_only_modules_out(db_url: str, tmp_path: Path) -> None:
    preload = [TARGET.split(":", 1)[0], *worker_preload(db_url, asynchronous=False)]
    found = _image_modules(db_url, tmp_path, preload, HOST_ONLY + ASYNC_ENGINE)
    assert not found, f"the Worker image imports {sorted(found)}"


@pytest.mark.backends("sqlite")
def test_the_async_engine_is_preloaded_only_for_an_async_family(db_url: str) -> None:
    from tests.processor_families import probe_async, probe_sync

    migrate(db_url)
    for families, expected in (([probe_sync], False), ([probe_sync, probe_async], True)):
        bundle = build_host(db_url, families, shutdown_grace=2.0)
        try:
            preloaded = "apsup.store.async_engine" in bundle.pool.preload
        finally:
            bundle.close()
        assert preloaded is expected, [f.name for f in families]


FRAGMENTED_HEAP = textwrap.dedent(
    """
    import ctypes
    from apsup.workers import warm

    libc = ctypes.CDLL(None)
    mallinfo2 = libc.mallinfo2
    mallinfo2.restype = warm._MallInfo2
    # Blocks over 512 bytes come from malloc; freeing every other one leaves free chunks all
    # over the heap, as the zygote's imports and warm-up do.
    blocks = [bytes(600 + (i % 7) * 200) for i in range(4000)]
    del blocks[::2]
    before = mallinfo2().ordblks
    taken = warm._take_free_chunks(libc)
    after = mallinfo2().ordblks
    print(before, taken, after)
    """
)


def test_the_zygote_takes_the_heaps_free_chunks() -> None:
    if not sys.platform.startswith("linux"):
        pytest.skip("glibc's malloc only")
    out = subprocess.run(
        [sys.executable, "-c", FRAGMENTED_HEAP], capture_output=True, text=True, check=True
    )
    before, taken, after = (int(x) for x in out.stdout.split())
    assert before >= 1000, "the test did not fragment the heap"
    assert taken >= before // 2
    assert after <= before // 10, f"{after} of {before} free chunks left"
