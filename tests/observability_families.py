"""Families for tests/test_runtime_observability.py (module level: Workers import them)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, text

from apsup.context import ExecutionContext
from apsup.registry import Family, Registry, family

registry = Registry()


@family("obs-ok", interval=60, max_workers=2, timeout=30, registry=registry)
def obs_ok(scope_id: str, ctx: ExecutionContext) -> None:
    with ctx.fenced() as conn:
        ctx.acknowledge(conn)


@family("obs-broken", interval=1, max_workers=2, timeout=30, registry=registry)
def obs_broken(scope_id: str, ctx: ExecutionContext) -> None:
    with ctx.fenced() as conn:
        ctx.acknowledge(conn)


@obs_broken.reconciler
def rebuild_from_missing_table(conn: Connection, fam: Family, token: Any) -> Any:
    """Its domain facts live in a table that does not exist: a real provider failure."""
    conn.execute(text("SELECT scope_id FROM obs_missing_domain_table LIMIT 10")).all()
    return None
