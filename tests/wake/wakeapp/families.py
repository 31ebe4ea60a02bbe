"""Two families of a user's application, with the application's own table.

``wake-manual`` has automatic admission disabled (it runs only on requests); ``wake-interval``
checks for dirty Scopes once an hour. Each invocation records its start time (``time.time()``)
in ``wake_runs``, in the transaction that acknowledges it.

With ``WAKEAPP_PROBE=<file>`` every transaction start and statement of every SQLAlchemy engine in
the process is appended to that file as ``<pid> <time> <what>``: the tests read the host's lines
to prove it is idle and to time its first reaction to a wake-up.
"""

from __future__ import annotations

import os
import time
from typing import Any

from sqlalchemy import Engine, event, insert
from wakeapp.tables import metadata, runs

from apsup import ExecutionContext, family

__all__ = ["hourly", "manual", "metadata", "runs"]

_PROBE = os.environ.get("WAKEAPP_PROBE")


def _log(what: str) -> None:
    assert _PROBE is not None
    with open(_PROBE, "a") as out:
        out.write(f"{os.getpid()} {time.time():.6f} {what}\n")


if _PROBE:

    @event.listens_for(Engine, "begin")
    def _on_begin(conn: Any) -> None:
        _log("BEGIN")

    @event.listens_for(Engine, "before_cursor_execute")
    def _on_statement(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        _log(" ".join(statement.split())[:2000] or "?")  # one line per statement


def _record(name: str, scope_id: str, ctx: ExecutionContext, *, clean: bool) -> None:
    started = time.time()
    with ctx.fenced() as conn:
        conn.execute(
            insert(runs).values(family=name, scope_id=scope_id, started=started, pid=os.getpid())
        )
        if clean:
            ctx.mark_clean(conn, ctx.dirty_generation(conn))
        ctx.acknowledge(conn)


@family("wake-manual", max_workers=2, timeout=30)
def manual(scope_id: str, ctx: ExecutionContext) -> None:
    _record("wake-manual", scope_id, ctx, clean=False)


@family("wake-interval", interval=3600, max_workers=2, timeout=30)
def hourly(scope_id: str, ctx: ExecutionContext) -> None:
    _record("wake-interval", scope_id, ctx, clean=True)
