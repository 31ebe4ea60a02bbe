"""Child-side processor wrapper: the Worker pool's target for every Scope invocation.

Input is only the serialized ExecutionContext. The wrapper rebuilds what it needs from it,
skips duplicate invocations (handled >= G consumes no new input, RFC §5), runs the processor
and, when the processor returned without acknowledging, has G acknowledged in a final fenced
transaction. Under a Supervisor (``ctx.host_acknowledges``) both ends are the host's: its
dispatch read right before the launch was the duplicate check, and on
``ExitCode.RETURNED_UNACKNOWLEDGED`` it commits the acknowledgment itself, fenced by the
dispatching term, so a processor that needs no database costs its Worker no session. A
context built by hand gets both from the Worker.
An ``async def`` processor runs to completion in the Worker's own event loop before that
acknowledgment; so does any awaitable a plain processor returns (a sync wrapper around a
coroutine): an un-awaited coroutine would otherwise be acknowledged without ever running.
The exit code tells the Supervisor what happened; the Supervisor still verifies the durable
acknowledgment itself before counting an exit 0 as success.
"""

from __future__ import annotations

import inspect
import os
import sys
from typing import Any

from apsup.context import ExecutionContext, dispose_async_backends, release_before_exit
from apsup.errors import ConfigError, ContextError, ProgressConflict, StaleTermError
from apsup.observability import tracing, worker_logs
from apsup.observability.logging import exception_message
from apsup.registry import resolve_entry_point
from apsup.store.storage import storage_error_kind
from apsup.workers import child
from apsup.workers.exit_codes import STORAGE_EXIT_CODES, ExitCode

TARGET = "apsup.workers.invoke:run"


def _say(kind: str, exc: BaseException) -> None:
    """One stderr line: the exception type and, unless the family opted out (its messages may
    quote Source text or prompts), its redacted, length-capped message (RFC §12: no Source
    bodies, prompts or credentials: redaction masks URL passwords and ``secret=`` pairs)."""
    message = ""
    if worker_logs._include_messages:
        message = f": {exception_message(exc)}"
    print(f"apsup worker: {kind}: {type(exc).__name__}{message}", file=sys.stderr, flush=True)


async def _run_async(processing: Any) -> None:
    """Await the processor, then close this loop's async connections while the loop still runs
    (aiosqlite threads and aiomysql sockets belong to it)."""
    try:
        await processing
    finally:
        await dispose_async_backends()


def run(payload: bytes) -> int:
    try:
        ctx = ExecutionContext.from_bytes(payload)
    except ContextError as exc:
        _say("bad context", exc)
        return ExitCode.BAD_CONTEXT
    for key, value in ctx.settings.items():  # not update(): its Mapping check costs a Worker
        os.environ[key] = value  # first-use work, cold in a fresh Worker
    # Logging, print and stderr join the host's log stream, on the sockets that came with the
    # launch (``child.launch_fds``) when the host passed them.
    worker_logs.attach(ctx, streams=child.launch_fds)
    tracing.attach_context(ctx.trace_context)  # the processor's spans nest under the host's
    try:
        fam = resolve_entry_point(ctx.entry_point)
        worker_logs.set_include_messages(fam.log_exception_messages)
        # Under a Supervisor, its dispatch read was the duplicate check (handled < G right
        # before the launch; any later acknowledgment of G needs the dispatching term, which
        # runs no other Worker for this Scope): the Worker opens no session just to repeat it.
        if not ctx.host_acknowledges and ctx.already_handled():
            return ExitCode.SUCCESS
        result = fam.processor(ctx.scope_id, ctx)
        if result is not None and inspect.isawaitable(result):  # None: no ABC walk
            from apsup.workers.child import run_coroutine  # preloaded: no import cost here

            run_coroutine(_run_async(result))
        if ctx.acknowledged:
            return ExitCode.SUCCESS
        if ctx.host_acknowledges:  # the Supervisor acknowledges G under the same term
            return ExitCode.RETURNED_UNACKNOWLEDGED
        ctx.acknowledge_fenced()
        return ExitCode.SUCCESS
    except ProgressConflict as exc:
        _say("progress conflict", exc)
        return ExitCode.PROGRESS_CONFLICT
    except StaleTermError as exc:
        _say("stale term", exc)
        return ExitCode.STALE_TERM
    except ConfigError as exc:
        _say("configuration", exc)
        return ExitCode.BAD_CONTEXT
    except Exception as exc:
        kind = storage_error_kind(exc)
        if kind is not None:  # the database cannot write: not this Scope's failure
            _say(f"storage unavailable ({kind})", exc)
            return STORAGE_EXIT_CODES[kind]
        worker_logs.report_exception(exc)
        _say("processor failed", exc)
        return ExitCode.PROCESSOR_FAILURE
    finally:
        release_before_exit()  # the Worker exits next
