"""Families for ``tests/test_testing_kit.py``: imported by the test and by ``invoke``'s child.

``kit-ledger`` writes one ledger row per handled generation in its own fenced transaction and
acknowledges in a second one (so a crash can fall between them); before writing it checks its
own cursor, which is what makes a retry after such a crash idempotent. ``KIT_SKIP_CURSOR=1``
(in the child's settings) turns that check off: the retry then duplicates the row, which the
kit must make visible. ``kit-broken`` raises; ``kit-slow`` sleeps past any test timeout.
"""

from __future__ import annotations

import os
import time
from typing import Any

from sqlalchemy import BigInteger, Column, Integer, MetaData, String, Table, func, insert, select

from apsup.registry import Registry, family

registry = Registry()
metadata = MetaData()

ledger = Table(
    "kit_ledger",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("scope_id", String(64), nullable=False),
    Column("g", BigInteger, nullable=False),
)


@family("kit-ledger", registry=registry, timeout=60)
def kit_ledger(scope_id: str, ctx: Any) -> None:
    g = ctx.claimed_request_generation
    with ctx.fenced() as conn:
        done = conn.execute(
            select(func.count()).where(ledger.c.scope_id == scope_id, ledger.c.g >= g)
        ).scalar_one()
        if not done or os.environ.get("KIT_SKIP_CURSOR") == "1":
            conn.execute(insert(ledger).values(scope_id=scope_id, g=g))
    with ctx.fenced() as conn:
        ctx.acknowledge(conn)


@family("kit-broken", registry=registry, timeout=60)
def kit_broken(scope_id: str, ctx: Any) -> None:
    raise RuntimeError("processor bug")


@family("kit-slow", registry=registry, timeout=60)
def kit_slow(scope_id: str, ctx: Any) -> None:
    time.sleep(600)
