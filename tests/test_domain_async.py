"""Domain side from async code: ``request_async`` / ``mark_dirty_async`` in the caller's own
``AsyncConnection`` transaction commit with the caller's input or not at all, on both backends
(aiosqlite / aiomysql engines derived from the configured URL)."""

from __future__ import annotations

import asyncio

import pytest
from sqlalchemy import Column, MetaData, String, Table, insert, select
from sqlalchemy.ext.asyncio import create_async_engine

from apsup.store import SqlBackend, intents
from apsup.store.async_engine import async_url
from tests import processor_families as pf

metadata = MetaData()
inbox = Table("domain_async_inbox", metadata, Column("scope_id", String(255), primary_key=True))


class Abort(Exception):
    pass


def test_request_and_mark_dirty_commit_with_the_callers_transaction_or_not_at_all(
    backend: SqlBackend,
) -> None:
    metadata.create_all(backend.engine)
    fam = pf.probe_async

    async def scenario() -> list[int]:
        engine = create_async_engine(async_url(backend.url))
        try:
            results = []
            async with engine.begin() as conn:
                await conn.execute(insert(inbox).values(scope_id="kept"))
                results.append(await fam.request_async(conn, "kept"))
                results.append(await fam.mark_dirty_async(conn, "kept"))
                results.append(await fam.request_async(conn, "kept"))
            with pytest.raises(Abort):
                async with engine.begin() as conn:
                    await conn.execute(insert(inbox).values(scope_id="lost"))
                    results.append(await fam.request_async(conn, "lost"))
                    results.append(await fam.mark_dirty_async(conn, "lost"))
                    raise Abort  # the caller's transaction rolls back: input and intent alike
            return results
        finally:
            await engine.dispose()

    assert asyncio.run(scenario()) == [1, 1, 2, 1, 1]
    with backend.read() as conn:
        kept = intents.get(conn, fam.binding_name, "kept")
        lost = intents.get(conn, fam.binding_name, "lost")
        rows = conn.execute(select(inbox.c.scope_id)).scalars().all()
    assert kept is not None
    assert (kept.requested_generation, kept.dirty_generation) == (2, 1)
    assert lost is None and rows == ["kept"]
