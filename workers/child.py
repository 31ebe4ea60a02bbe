"""Worker child bootstrap: the first code that runs in a freshly forked Worker.

The zygote (``apsup.workers.zygote``) forks this module's :func:`main` with ``(target,
payload)``: a ``"module:function"`` string and opaque bytes (orjson made by the caller), plus
the deadline and the launch's hold pipe. Nothing else crosses the process boundary.

What ``main`` does, in order, and why:

1. ``os.setsid()``: the Worker leads its own process group and session, so the pool's timeout
   kill (``killpg``) also reaches grandchildren, and the terminal's Ctrl-C no longer reaches it.
2. SIGINT is ignored: Ctrl-C in the host's terminal must not kill Workers mid-transaction; the
   host stops them itself, in order.
3. SIGTERM: the first one raises :class:`WorkerTerminated` in the main thread so ``finally``
   blocks and context managers roll back (a coroutine suspended in an ``await`` is cancelled
   instead, with the same outcome); a second one exits at once with 143.
4. The Worker writes its pid into the launch's hold pipe (``_report_pid``), so that the host
   finds it even if the forkserver dies before reporting it.
5. The Worker arms its own deadline (``apsup.workers.deadline``): if it is still running one
   grace period after its timeout, nobody stopped it (the host was killed or hangs), and it
   stops itself the way the host would have, graceful first, then hard.
6. ``random`` is reseeded (all children fork from the same forkserver image).
7. ``target`` is imported and called with ``payload``; its int return is the exit code. An
   ``async def`` target (and an async processor, through :func:`run_coroutine`) runs to
   completion in this process's own event loop, created on first use, never in the forkserver.

Failures are reported on stderr by exception *type* and code location only, never by message:
messages can quote payload contents (scope ids, tokens, user data).
"""

from __future__ import annotations

import _signal
import asyncio
import contextlib
import importlib
import inspect
import os
import random
import signal
import sys
import traceback
from collections.abc import Callable
from types import FrameType
from typing import Any, NoReturn

from apsup.errors import ContextError, ProgressConflict, StaleTermError
from apsup.workers import deadline
from apsup.workers.exit_codes import MAX_TARGET_EXIT_CODE, ExitCode
from apsup.workers.fds import write_signed, write_verdict

Target = Callable[[bytes], Any]


class WorkerTerminated(BaseException):
    """Raised in the Worker's main thread by the first SIGTERM (timeout, shutdown, lease loss).

    A ``BaseException`` (like ``KeyboardInterrupt``) so that a processor's ``except Exception``
    cannot swallow it, while ``finally`` and ``with`` blocks still run and roll back.
    """


# Set once the target has returned: a SIGTERM after that must not turn a finished invocation
# into TERMINATED, so the handler exits with the target's own code instead.
_finished_code: int | None = None
_sigterms = 0
# The Worker's one event loop (created on first use) and the task run_coroutine is driving.
_loop: asyncio.AbstractEventLoop | None = None
_main_task: asyncio.Task[Any] | None = None
_cancelled_by_sigterm = False
#: Whether the last ``run`` produced its code itself (the target returned it, or this module
#: mapped an exception to it) rather than taking it from the target's ``SystemExit``.
_vouched = False
#: The fds the host passed with this Worker's launch (``WorkerPool.submit(fds=...)``), in
#: order; the Supervisor passes the Worker's log streams: records, stdout, stderr
#: (``apsup.observability.worker_logs``). Empty when none were passed.
launch_fds: tuple[int, ...] = ()


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    global _sigterms
    _sigterms += 1
    if _finished_code is not None:
        _exit(_finished_code)
    if _sigterms > 1:
        _exit(ExitCode.FORCED_EXIT)
    if _cancel_main_task():
        return
    raise WorkerTerminated


def _cancel_main_task() -> bool:
    """First SIGTERM while a coroutine runs: cancel it unless its own code is executing.

    While the coroutine awaits, the main thread is inside the event loop's machinery, where an
    exception would escape the loop (or be swallowed by a callback's error handler) instead of
    reaching the coroutine: the task is cancelled instead, so its ``finally`` and ``async with``
    blocks run at the await they are suspended in. While the coroutine's own (blocking) code
    runs, ``WorkerTerminated`` is raised right there, exactly as in a sync processor.
    """
    global _cancelled_by_sigterm
    loop, task = _loop, _main_task
    if loop is None or task is None or task.done():
        return False
    if asyncio.current_task(loop) is task:
        return False
    _cancelled_by_sigterm = True
    loop.call_soon_threadsafe(task.cancel)
    return True


async def _await(awaitable: Any) -> Any:
    return await awaitable


def run_coroutine(awaitable: Any) -> Any:
    """Run ``awaitable`` to completion in this Worker's event loop and return its result.

    One loop per Worker process, created here on first use (the forkserver never has one: a
    loop's self-pipe and any executor thread must not be forked). A first SIGTERM cancels the
    coroutine (see :func:`_cancel_main_task`) and surfaces as ``WorkerTerminated`` even if the
    coroutine swallowed the cancellation: a stopped invocation never counts as a success.
    """
    global _loop, _main_task
    if _main_task is not None:
        raise RuntimeError("run_coroutine() is not reentrant")
    if _loop is None:
        _loop = asyncio.new_event_loop()
        asyncio.set_event_loop(_loop)
    task = _loop.create_task(_await(awaitable))
    _main_task = task
    try:
        result = _loop.run_until_complete(task)
    except asyncio.CancelledError:
        if _cancelled_by_sigterm:
            raise WorkerTerminated from None
        raise
    finally:
        _main_task = None
    if _cancelled_by_sigterm:
        raise WorkerTerminated
    return result


def _exit(code: int) -> NoReturn:
    """Flush and leave now: stray non-daemon threads or atexit hooks of a processor must not
    delay the exit that releases its capacity (the pool would only kill it at the deadline)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a broken stream must not change the exit code
            stream.flush()
    os._exit(code)


def _report(target: str, what: str, exc: BaseException) -> None:
    """One stderr line: exception type and innermost code location, no message, no payload
    (a bare target is no family: nobody decided its messages may be shown; a family's own
    failure line, with its message, comes from ``apsup.workers.invoke``)."""
    where = ""
    frames = traceback.extract_tb(exc.__traceback__)
    if frames:
        last = frames[-1]
        where = f" at {last.filename}:{last.lineno} in {last.name}"
    kind = f"{type(exc).__module__}.{type(exc).__qualname__}"
    with contextlib.suppress(Exception):  # reporting must never change the exit code
        sys.stderr.write(f"apsup worker {os.getpid()}: {target} {what}: {kind}{where}\n")


def resolve(target: str) -> Target:
    """Import ``"package.module:function"`` (dotted attributes allowed after the colon)."""
    module_name, sep, attr_path = target.partition(":")
    if not sep or not module_name or not attr_path:
        raise ValueError("target must look like 'package.module:function'")
    # Preloaded in the zygote: a dict lookup, not import_module's first run in this process.
    obj: object = sys.modules.get(module_name) or importlib.import_module(module_name)
    for attr in attr_path.split("."):
        obj = getattr(obj, attr)
    if not callable(obj):
        raise TypeError("target is not callable")
    return obj  # type: ignore[return-value]


def run(target: str, payload: bytes) -> int:
    """Resolve and call ``target(payload)``; map its outcome to an exit code. Never raises
    ``Exception``; ``WorkerTerminated`` is mapped too.

    A code taken from a ``SystemExit`` (``sys.exit(N)`` anywhere below the target, the
    processor included) is not vouched for (``_vouched``): the host gives it no meaning but
    "exited with N", so no processor can pass for the wrapper asking to be acknowledged."""
    global _vouched
    _vouched = True
    try:
        fn = resolve(target)
    except WorkerTerminated:
        return ExitCode.TERMINATED
    except Exception as exc:
        _report(target, "could not be resolved", exc)
        return ExitCode.BAD_CONTEXT
    try:
        result = fn(payload)
        # ``async def`` target: run it, never drop it. An int (an ``ExitCode`` too) is the
        # common answer: ``isawaitable`` would walk the ABC registry, cold in a fresh Worker
        # (copied pages and CPU for every ``ExitCode``, which ``isinstance`` answers at once).
        if not isinstance(result, int) and inspect.isawaitable(result):
            result = run_coroutine(result)
    except WorkerTerminated:
        return ExitCode.TERMINATED
    except StaleTermError:
        return ExitCode.STALE_TERM
    except ProgressConflict:
        return ExitCode.PROGRESS_CONFLICT
    except ContextError as exc:
        _report(target, "rejected its context", exc)
        return ExitCode.BAD_CONTEXT
    except SystemExit as exc:
        _vouched = False
        result = exc.code if isinstance(exc.code, int) else ExitCode.PROCESSOR_FAILURE
    except Exception as exc:
        _report(target, "failed", exc)
        return ExitCode.PROCESSOR_FAILURE
    if (
        isinstance(result, bool)
        or not isinstance(result, int)
        or not 0 <= result <= MAX_TARGET_EXIT_CODE
    ):
        with contextlib.suppress(Exception):
            sys.stderr.write(
                f"apsup worker {os.getpid()}: {target} returned {type(result).__name__}, "
                f"not an int exit code in 0..{MAX_TARGET_EXIT_CODE}\n"
            )
        return ExitCode.PROCESSOR_FAILURE
    return int(result)


def main(
    target: str,
    payload: bytes,
    timeout: float | None = None,
    grace: float = 5.0,
    hold_fd: int | None = None,
    extra_fds: tuple[int, ...] = (),
) -> NoReturn:
    """Worker entry point (runs in the forked child): isolate, install signals, run, exit.

    ``timeout``/``grace``: the pool's deadline for this Worker and its SIGTERM-to-SIGKILL grace,
    armed here as the Worker's own backstop (``None``: only the host enforces a deadline).
    ``hold_fd``: the launch's hold pipe (``apsup.workers.zygote``). ``extra_fds``: what the
    launch passed for the target (kept in :data:`launch_fds`)."""
    global _finished_code, launch_fds
    launch_fds = extra_fds
    # PermissionError: already a group leader (e.g. run by hand); nothing to detach from.
    try:  # noqa: SIM105 - suppress() is three more cold calls per Worker
        os.setsid()
    except PermissionError:
        pass
    # ``_signal``: ``signal.signal`` converts the old handler to an enum (a failed lookup, an
    # exception caught) on code a fresh Worker runs cold.
    _signal.signal(signal.SIGINT, _signal.SIG_IGN)
    _signal.signal(signal.SIGTERM, _on_sigterm)
    _report_pid(hold_fd)
    deadline.arm(timeout, grace)
    random.seed()
    code: int
    try:
        code = run(target, payload)
    except WorkerTerminated:
        code = ExitCode.TERMINATED
    except BaseException as exc:  # pragma: no cover - run() maps everything it can
        _report(target, "crashed", exc)
        code = ExitCode.PROCESSOR_FAILURE
    if hold_fd is not None and _vouched:
        try:  # noqa: SIM105 - as above
            write_verdict(hold_fd, code)
        except OSError:
            pass
    _finished_code = code
    _exit(code)


def _report_pid(hold_fd: int | None) -> None:
    """Write our pid into the launch's hold pipe and keep it open for life: if the zygote dies
    before it reports this pid, the host still learns it there, and EOF on that pipe tells it
    when no process of this launch is left (``apsup.workers.pool``). A launch made without one
    (by hand) has nothing to report to."""
    if hold_fd is not None:
        try:  # noqa: SIM105 - as above
            write_signed(hold_fd, os.getpid())
        except OSError:
            pass


def noop(payload: bytes) -> int:
    """A target that does nothing: used to warm the forkserver and by benchmarks."""
    return ExitCode.SUCCESS


def probe_preload(payload: bytes) -> int:
    """Report which preload modules the forkserver failed to import.

    Payload: report path, then one module name per line. The forkserver swallows ImportError for
    preloads, and it does not see the parent's ``sys.path`` edits, so a missing preload would
    otherwise only show up as every launch being ~30x slower. A child inherits the forkserver's
    ``sys.modules`` and this probe imports nothing, so ``sys.modules`` here is the forkserver's.
    """
    report_path, *modules = payload.decode().split("\n")
    missing = [name for name in modules if name and name not in sys.modules]
    with open(report_path, "w", encoding="utf-8") as fh:
        fh.write("\n".join([_fork_note(), *missing]))
    return ExitCode.BAD_CONTEXT if missing else ExitCode.SUCCESS


def _fork_note() -> str:
    """How the zygote forked this probe (the first line of its report): empty when lean or
    when the platform has no lean fork; else why not, for the host to tell the operator."""
    from apsup.workers import fork

    if fork.forked_lean is not False or fork._libc_fork is None:
        return ""
    if fork.foreign_hooks:
        hooks = ", ".join(sorted(set(fork.foreign_hooks)))
        return f"module(s) {hooks} registered os.register_at_fork hooks"
    try:
        threads = len(os.listdir(f"/proc/{os.getppid()}/task"))
    except OSError:
        threads = 0
    if threads > 1:
        return f"the forkserver runs {threads} threads (a preload module started a thread)"
    return "the forkserver could not use the lean fork"
