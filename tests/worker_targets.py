"""Child targets for tests/test_worker_processes.py (run inside real Worker processes).

Preloaded into the forkserver by the tests: ``IMPORTED_IN_PID`` records the pid that imported
this module, which must be the forkserver's, not each Worker's.
Payloads are orjson objects; ``path`` names a marker file the test reads back.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import sys
import time
from typing import Any

import orjson

from apsup.errors import ContextError, ProgressConflict, StaleTermError

IMPORTED_IN_PID = os.getpid()


def _args(payload: bytes) -> dict[str, Any]:
    value = orjson.loads(payload)
    assert isinstance(value, dict)
    return value


def _write(path: str, text: str) -> None:
    """Append one line; O_APPEND keeps lines from concurrent Workers whole."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.write(fd, (text + "\n").encode())
    finally:
        os.close(fd)


def ok(payload: bytes) -> int:
    return 0


def payload_digest(payload: bytes) -> int:
    """Payload: a report path, a newline, then any bytes: append their length and SHA-256."""
    import hashlib

    path, _, data = payload.partition(b"\n")
    _write(path.decode(), f"{len(data)} {hashlib.sha256(data).hexdigest()}")
    return 0


def report_gc_freeze(payload: bytes) -> int:
    """Write this Worker's frozen-object count (inherited from the forkserver), its pid, its
    thread count and whether an event loop is set (both inherited from the forkserver's warm-up,
    which must leave neither)."""
    import asyncio
    import gc
    import threading

    loop_set = asyncio.get_event_loop_policy()._local._loop is not None  # type: ignore[attr-defined]
    _write(
        payload.decode(),
        f"{gc.get_freeze_count()} {os.getpid()} {threading.active_count()} {int(loop_set)}",
    )
    return 0


def exit_with(payload: bytes) -> int:
    return int(_args(payload)["code"])


def return_value(payload: bytes) -> Any:
    return _args(payload)["value"]


def sys_exit(payload: bytes) -> int:
    sys.exit(int(_args(payload)["code"]))


def raise_error(payload: bytes) -> int:
    raise RuntimeError(f"processing failed for {_args(payload)['secret']}")


def raise_stale(payload: bytes) -> int:
    raise StaleTermError("term moved on")


def raise_conflict(payload: bytes) -> int:
    raise ProgressConflict("cursor moved")


def raise_context(payload: bytes) -> int:
    raise ContextError(f"bad context {payload!r}")


def report_import(payload: bytes) -> int:
    _write(_args(payload)["path"], f"{IMPORTED_IN_PID} {os.getpid()} {os.getppid()}")
    return 0


def report_identity(payload: bytes) -> int:
    _write(
        _args(payload)["path"],
        f"{os.getpid()} {os.getpgid(0)} {os.getsid(0)} {random.random()!r}",
    )
    return 0


def sleep_with_finally(payload: bytes) -> int:
    """Sleeps; a graceful SIGTERM must still run the ``finally`` (recorded in the file)."""
    args = _args(payload)
    _write(args["path"], "started")
    try:
        time.sleep(args["seconds"])
    finally:
        _write(args["path"], "finally")
    return 0


def sleep_then_finish(payload: bytes) -> int:
    args = _args(payload)
    _write(args["path"], "started")
    time.sleep(args["seconds"])
    _write(args["path"], "done")
    return 0


def ignore_sigterm(payload: bytes) -> int:
    args = _args(payload)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _write(args["path"], "started")
    time.sleep(args["seconds"])
    return 0


def slow_cleanup(payload: bytes) -> int:
    """Its cleanup blocks: only a second SIGTERM (or SIGKILL) ends it."""
    args = _args(payload)
    _write(args["path"], "started")
    try:
        time.sleep(args["seconds"])
    finally:
        _write(args["path"], "cleanup")
        time.sleep(args["seconds"])
    return 0


def spawn_grandchild(payload: bytes) -> int:
    """Forks a grandchild that ignores SIGTERM and would outlive the Worker by far."""
    args = _args(payload)
    if args.get("child_ignores_sigterm"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    pid = os.fork()
    if pid == 0:  # grandchild
        try:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            _write(args["path"], f"grandchild {os.getpid()}")
            time.sleep(120)
        finally:
            os._exit(0)
    _write(args["path"], "child ready")
    time.sleep(args["seconds"])
    return 0


def hard_exit(payload: bytes) -> int:
    """Bypasses the bootstrap's exit-code rules, like a crashing C extension would."""
    os._exit(int(_args(payload)["code"]))


# --- async twins (``a_<name>``): the same behaviour as ``async def`` targets ---------------------
# They await where the sync ones block, so a SIGTERM finds them suspended in the event loop.


async def a_ok(payload: bytes) -> int:
    await asyncio.sleep(0)
    return 0


async def a_exit_with(payload: bytes) -> int:
    await asyncio.sleep(0)
    return int(_args(payload)["code"])


async def a_return_value(payload: bytes) -> Any:
    await asyncio.sleep(0)
    return _args(payload)["value"]


async def a_sys_exit(payload: bytes) -> int:
    await asyncio.sleep(0)
    sys.exit(int(_args(payload)["code"]))


async def a_raise_error(payload: bytes) -> int:
    await asyncio.sleep(0)
    raise RuntimeError(f"processing failed for {_args(payload)['secret']}")


async def a_raise_stale(payload: bytes) -> int:
    await asyncio.sleep(0)
    raise StaleTermError("term moved on")


async def a_raise_conflict(payload: bytes) -> int:
    await asyncio.sleep(0)
    raise ProgressConflict("cursor moved")


async def a_raise_context(payload: bytes) -> int:
    await asyncio.sleep(0)
    raise ContextError(f"bad context {payload!r}")


async def a_report_identity(payload: bytes) -> int:
    await asyncio.sleep(0)
    return report_identity(payload)


async def a_sleep_with_finally(payload: bytes) -> int:
    args = _args(payload)
    _write(args["path"], "started")
    try:
        await asyncio.sleep(args["seconds"])
    finally:
        _write(args["path"], "finally")
    return 0


async def a_sleep_then_finish(payload: bytes) -> int:
    args = _args(payload)
    _write(args["path"], "started")
    await asyncio.sleep(args["seconds"])
    _write(args["path"], "done")
    return 0


async def a_ignore_sigterm(payload: bytes) -> int:
    args = _args(payload)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _write(args["path"], "started")
    await asyncio.sleep(args["seconds"])
    return 0


async def a_slow_cleanup(payload: bytes) -> int:
    args = _args(payload)
    _write(args["path"], "started")
    try:
        await asyncio.sleep(args["seconds"])
    finally:
        _write(args["path"], "cleanup")
        await asyncio.sleep(args["seconds"])
    return 0


async def a_blocking_sleep_with_finally(payload: bytes) -> int:
    """Blocks the loop (sync code inside a coroutine): SIGTERM interrupts it right there."""
    args = _args(payload)
    _write(args["path"], "started")
    try:
        time.sleep(args["seconds"])
    finally:
        _write(args["path"], "finally")
    return 0


async def a_spawn_grandchild(payload: bytes) -> int:
    await asyncio.sleep(0)
    return spawn_grandchild(payload)


async def a_swallow_cancel(payload: bytes) -> int:
    """Swallows the cancellation a first SIGTERM causes and returns 0 as if it had finished."""
    args = _args(payload)
    _write(args["path"], "started")
    try:
        await asyncio.sleep(args["seconds"])
    except asyncio.CancelledError:
        _write(args["path"], "swallowed")
    return 0


def loop_state(payload: bytes) -> int:
    """Records whether this Worker inherited an event loop from the forkserver (it must not)."""
    from apsup.workers import child

    policy_loop = getattr(asyncio.get_event_loop_policy(), "_local", None)
    inherited = child._loop is not None or getattr(policy_loop, "_loop", None) is not None
    _write(_args(payload)["path"], f"inherited={inherited}")
    return 0


def report_fork(payload: bytes) -> int:
    """Write how the zygote forked this Worker and that the interpreter works after it: the
    fork kind, a draw from ``random`` (reseeded per Worker), a thread started and joined, and
    what the preloaded at-fork probe module (if any) saw run in this process."""
    import threading

    from apsup.workers import fork

    box: list[int] = []
    thread = threading.Thread(target=lambda: box.append(threading.get_ident()))
    thread.start()
    thread.join(10)
    probe = sys.modules.get("apsup_test_fork_probe")
    hook_ran = getattr(probe, "ran_in_child", None)
    _write(
        _args(payload)["path"],
        f"{fork.forked_lean} {random.random()!r} {len(box)} {hook_ran} {os.getpid()}",
    )
    return 0


def report_modules(payload: bytes) -> int:
    """Write which of the payload's module names this Worker has imported (inherited from the
    zygote's image: this target imports nothing)."""
    args = _args(payload)
    present = [name for name in args["modules"] if name in sys.modules]
    _write(args["path"], " ".join(present) or "-")
    return 0
