"""Families for tests/test_async_processors.py, run by the real Worker wrapper in real Workers.

``probe-sync`` and ``probe-async`` behave the same, one as a plain function and one as an
``async def`` (which awaits before each step, so it is really suspended in the Worker's event
loop). The Scope id's part before the first ``.`` selects the behaviour; markers go to the file
``$PROBE_DIR/<scope_id>`` (the directory comes in through the context's settings).

=========  ======================================================================================
noack      write ``ran`` and return without acknowledging and without a fenced transaction
fenced     insert a ``probe_runs`` row and acknowledge, in one fenced transaction
fail       write ``ran``, then raise
conflict   raise ``ProgressConflict``
stale      enter a fenced transaction (the test has bumped the term): ``StaleTermError``
sleep      write ``started``, sleep for two minutes, write ``finally`` on the way out
=========  ======================================================================================
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

from sqlalchemy import Column, MetaData, String, Table, insert

from apsup.context import ExecutionContext
from apsup.errors import ProgressConflict
from apsup.registry import Registry, family

metadata = MetaData()
runs = Table(
    "probe_runs",
    metadata,
    Column("scope_id", String(255), primary_key=True),
    Column("note", String(64), nullable=False),
)

registry = Registry()


def mark(scope_id: str, text: str) -> None:
    path = Path(os.environ["PROBE_DIR"]) / scope_id
    with path.open("a", encoding="utf-8") as fh:
        fh.write(text + "\n")


@family("probe-sync", timeout=60, registry=registry)
def probe_sync(scope_id: str, ctx: ExecutionContext) -> None:
    kind = scope_id.split(".", 1)[0]
    if kind == "noack":
        mark(scope_id, "ran")
    elif kind == "fenced":
        with ctx.fenced() as conn:
            conn.execute(insert(runs).values(scope_id=scope_id, note="sync"))
            ctx.acknowledge(conn)
    elif kind == "fail":
        mark(scope_id, "ran")
        raise RuntimeError("probe failure")
    elif kind == "conflict":
        raise ProgressConflict("probe cursor moved")
    elif kind == "stale":
        with ctx.fenced() as conn:
            conn.execute(insert(runs).values(scope_id=scope_id, note="stale"))
    elif kind == "sleep":
        mark(scope_id, "started")
        try:
            time.sleep(120)
        finally:
            mark(scope_id, "finally")


@family("probe-async", timeout=60, registry=registry)
async def probe_async(scope_id: str, ctx: ExecutionContext) -> None:
    kind = scope_id.split(".", 1)[0]
    await asyncio.sleep(0.01)
    if kind == "noack":
        mark(scope_id, "ran")
    elif kind == "fenced":
        async with ctx.fenced_async() as conn:
            await conn.execute(insert(runs).values(scope_id=scope_id, note="async"))
            await asyncio.sleep(0)
            await ctx.acknowledge_async(conn)
    elif kind == "fail":
        mark(scope_id, "ran")
        raise RuntimeError("probe failure")
    elif kind == "conflict":
        raise ProgressConflict("probe cursor moved")
    elif kind == "stale":
        async with ctx.fenced_async() as conn:
            await conn.execute(insert(runs).values(scope_id=scope_id, note="stale"))
    elif kind == "sleep":
        mark(scope_id, "started")
        try:
            await asyncio.sleep(120)
        finally:
            mark(scope_id, "finally")
