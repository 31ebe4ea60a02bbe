"""Warm the Workers' database engine once, in the forkserver.

Every Worker would otherwise build an engine, initialise the dialect and compile the same few
statements (duplicate check, Lease lock, acknowledgment): 15-25 ms per launch on a 2-core
machine, more than the launch itself. Imported as a forkserver preload, this module opens the
backend for the URL the host hands over, runs those statements once (the write ones in a
transaction that is rolled back and touches no row), then closes every connection: children
inherit a ready engine with its compiled-statement cache, its initialised dialect and an empty
pool, so no connection ever crosses a fork. The host hands the URL over in a private (0600)
file named by an environment variable, never in the environment itself (which
``/proc/<pid>/environ`` would keep showing); the file is removed as soon as it is read.

Imported last, it then prepares the forkserver's memory for forking (:func:`prepare_image`):
each Worker's life costs the kernel a page-table copy of the forkserver (fork), a page copy for
every page the Worker writes (copy-on-write), and the unmapping at exit; on 2 cores these
outweigh the Worker's own Python.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import sys
from typing import Any

from apsup.context import backend_for
from apsup.store import backend_kind, intents, open_backend
from apsup.store.leases import Term, read_lease

ENV = "APSUP_WORKER_WARM_URL"
#: Seconds the warm-up's write probe waits for the database's write lock (then skipped).
WRITE_PROBE_WAIT = 0.5
_PROBE = "\x1fapsup-warm"


def _answers(url: str) -> bool:
    """Whether the database answers within the host's time limits. The Workers' own engine has
    none: on a half-open network its handshake would wait for ever and the forkserver (and with
    it the host's startup) would hang instead of just starting cold."""
    probe = open_backend(url, control=True)
    try:
        with probe.read():
            return True
    except Exception:
        return False
    finally:
        probe.dispose()


def warm(url: str) -> None:
    if backend_kind(url) != "sqlite" and not _answers(url):
        return
    backend: Any = backend_for(url)
    with backend.read() as conn:
        intents.get(conn, _PROBE, _PROBE)
    # The write probe must not wait out a Worker's lock wait (SQLite: 30 s) behind another
    # process's write lock: the host's startup waits for the forkserver, silently. Warming is
    # an optimisation; a busy database is warmed by the first Workers instead.
    busy = getattr(backend, "busy_timeout", None)
    if busy is not None:
        backend.busy_timeout = min(busy, WRITE_PROBE_WAIT)
    try:
        _warm_writes(backend)
    finally:
        if busy is not None:
            backend.busy_timeout = busy
    # No connection survives into a forked Worker. ``pool.dispose()`` closes the pooled
    # connections but keeps the pool itself, unlike ``engine.dispose()`` which replaces it: a
    # new pool runs the engine's first-connect work again (dialect initialisation, on SQLite
    # ``PRAGMA journal_mode=WAL``) in every Worker, for facts the forkserver already
    # established on this database.
    backend.engine.pool.dispose()


def _warm_writes(backend: Any) -> None:
    with contextlib.suppress(Exception), backend.engine.connect() as conn:
        txn = conn.begin()
        try:
            read_lease(conn, _PROBE, for_update=True)
            with contextlib.suppress(Exception):
                backend.check_term(conn, Term(_PROBE, _PROBE, 1))
            with contextlib.suppress(Exception):
                intents.acknowledge(conn, _PROBE, _PROBE, 1, 1)
            with contextlib.suppress(Exception):
                intents.mark_clean(conn, _PROBE, _PROBE, 1, 1)
        finally:
            txn.rollback()


async def _nothing() -> None:
    return None


def warm_event_loop(rounds: int = 20) -> None:
    """Run the async Worker's machinery (a new loop, a task, the wrapper's closing coroutine) a
    few times, then close every loop: an ``async def`` processor's Worker then starts from code
    CPython 3.11 has already specialised (its first runs write into the code objects: a copied
    page each in every Worker), so each async invocation copies fewer pages and spends less CPU.
    Nothing survives: each loop is closed (its selector and self-pipe with it) and no executor
    thread is ever started, so the forkserver still has no loop and no thread to fork."""
    import asyncio

    from apsup.workers.invoke import _run_async

    for _ in range(rounds):
        loop = asyncio.new_event_loop()
        try:
            asyncio.set_event_loop(loop)
            loop.run_until_complete(loop.create_task(_run_async(_nothing())))
        finally:
            asyncio.set_event_loop(None)
            loop.close()


# madvise(2): collapse the range into transparent huge pages now (Linux >= 6.1).
_MADV_COLLAPSE = 25
_HUGE = 2 << 20


def prepare_image() -> None:
    """Make the forkserver cheap to fork: every Worker is a fork of this image.

    - ``gc.freeze()`` (after a collection): the preloaded objects leave the collector's
      generations, so a Worker's collections never walk them (walking writes to every object's
      header: a copied page each).
    - ``malloc_trim(0)``: free heap pages go back to the kernel; a Worker allocating there gets
      a zero page instead of a copy, and there are fewer page-table entries to copy per fork.
    - :func:`_take_free_chunks`: the C heap's free chunks are taken by this process for good,
      so a Worker's ``malloc`` (SQLite's, and Python's for blocks over 512 bytes) is served
      from the heap's top, contiguously, instead of from free chunks scattered over the
      inherited heap: each of those cost the Worker a copied page (and unlinking it from its
      bin, one or two more). Opening SQLite in a Worker touched 480 pages, 170 after it.
    - :func:`_collapse_heap`: the anonymous heap becomes 2 MB pages, so fork copies one entry
      per 2 MB instead of 512 and exit unmaps as few. A Worker writing to one splits only its
      own mapping and copies the 4 KB page it writes, as before.

    Each step only changes how memory is laid out, never what a Worker sees; where one is not
    available (not glibc, an older kernel, huge pages disabled) it is skipped.
    """
    gc.collect()
    gc.freeze()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return
    with contextlib.suppress(AttributeError):
        libc.malloc_trim(0)
    with contextlib.suppress(AttributeError, OSError, ValueError):
        _take_free_chunks(libc)
    with contextlib.suppress(AttributeError, OSError, ValueError):
        _collapse_heap(libc)


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
            "fordblks", "keepcost",
        )
    ]  # fmt: skip


def _take_free_chunks(libc: ctypes.CDLL) -> int:
    """Allocate, and never free, every free chunk of the main heap (glibc >= 2.33); returns
    how many were taken.

    For each request size, largest first, ``malloc`` returns free chunks (best fit, splitting
    larger ones) until it has to carve from the heap's top: that last block is given back
    unless it is tcache-sized (freed, it would wait in the tcache for a Worker to take), and
    the next, smaller size goes on. What is taken stays in this process's heap: Workers
    inherit it and never touch it. Only the main heap is considered (the range ``mallinfo2``
    reports below the break): the zygote runs no other thread, so there is no other arena.
    """
    mallinfo2 = libc.mallinfo2
    mallinfo2.restype = _MallInfo2
    malloc, free, sbrk = libc.malloc, libc.free, libc.sbrk
    malloc.restype, malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    free.restype, free.argtypes = None, [ctypes.c_void_p]
    sbrk.restype, sbrk.argtypes = ctypes.c_void_p, [ctypes.c_ssize_t]
    # Request sizes whose chunk sizes cover every tcache/small bin (a request of n bytes
    # takes a chunk of n + 8 rounded up to 16), then halving up to 64 KB for the large bins.
    sizes = [1 << k for k in range(16, 11, -1)] + [c - 8 for c in range(2048, 31, -16)]
    taken = 0
    for size in sizes:
        info = mallinfo2()
        brk = sbrk(0)
        if not brk or info.arena == 0:
            return taken
        top, bottom = brk - info.keepcost, brk - info.arena
        while True:
            block = malloc(size)
            if not block:
                return taken
            if bottom <= block < top:
                taken += 1  # a free chunk: keep it
                continue
            if size > 1032:  # from the top (or mmap): merges back on free
                free(block)
            break
    return taken


def _kernel_at_least(major: int, minor: int) -> bool:
    try:
        found = tuple(int(x) for x in os.uname().release.split("-")[0].split(".")[:2])
    except ValueError:
        return False
    return found >= (major, minor)


def _collapse_heap(libc: ctypes.CDLL) -> None:
    """``MADV_COLLAPSE`` every 2 MB-aligned stretch of the anonymous heap (Python's arenas and
    the C heap). Only on Linux >= 5.8: older kernels copy a whole 2 MB page when a Worker
    writes to it instead of splitting it."""
    if not sys.platform.startswith("linux") or not _kernel_at_least(5, 8):
        return
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    with open("/proc/self/maps", encoding="ascii") as maps:
        lines = maps.readlines()
    for line in lines:
        fields = line.split()
        name = fields[5] if len(fields) > 5 else ""
        if fields[1] != "rw-p" or name not in ("", "[heap]"):
            continue  # files, shared memory, the stack, read-only memory
        low, high = (int(x, 16) for x in fields[0].split("-"))
        start, end = (low + _HUGE - 1) & ~(_HUGE - 1), high & ~(_HUGE - 1)
        if end > start:  # fails harmlessly (EINVAL) where MADV_COLLAPSE is unknown
            madvise(start, end - start, _MADV_COLLAPSE)


def _take_url(path: str) -> str | None:
    if not path:
        return None
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read().strip() or None
    except OSError:
        return None
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)


# Only in the forkserver ``build_host`` starts (the variable names the URL file): the host
# imports this module too, for ``ENV``, and must keep collecting its garbage.
_path = os.environ.pop(ENV, None)
if _path is not None:
    _url = _take_url(_path)
    if _url:
        with contextlib.suppress(Exception):  # a cold engine is slower, never wrong
            warm(_url)
    with contextlib.suppress(Exception):  # a cold event loop is slower, never wrong
        warm_event_loop()
    with contextlib.suppress(Exception):  # an unprepared image is slower, never wrong
        prepare_image()
