"""Async process bodies for tests/test_fencing_race_async.py: the committing side uses
``AsyncStore.fenced`` (what ``ctx.fenced_async()`` runs on), with the journal of
tests/_contract_fencing.py; the bumping side is the sync one from that module.

Each body runs under ``spawn`` with plain values, rebuilds its store from the URL like a Worker,
and runs its own event loop (``asyncio.run``).
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

from apsup.errors import StaleTermError
from apsup.store import open_backend
from apsup.store.async_engine import AsyncStore
from apsup.store.leases import Term
from tests import _contract_fencing as fj


async def _commit(store: AsyncStore, term: Term) -> int:
    async with store.fenced(term) as conn:
        return int(await conn.run_sync(fj.stamp, "commit", term))


def race_committer(url: str, rounds: int, seed: int, barrier: Any, results: Any) -> None:
    """``fj.race_committer`` with every fenced commit made on an ``AsyncConnection``."""

    async def body() -> tuple[int, int]:
        backend = open_backend(url)
        store = AsyncStore(backend)
        rng = random.Random(seed)
        won = lost = 0
        try:
            term = fj.current_term(backend)
            await _commit(store, term)
            for _ in range(rounds):
                barrier.wait(30)
                fj._jitter(rng)
                try:
                    await _commit(store, term)
                    won += 1
                except StaleTermError:
                    lost += 1
                barrier.wait(30)
                try:
                    await _commit(store, term)
                except StaleTermError:
                    pass
                else:
                    raise AssertionError(f"term {term} committed after it was replaced")
                term = fj.current_term(backend)
                await _commit(store, term)
            return won, lost
        finally:
            await store.dispose()
            backend.dispose()

    try:
        won, lost = asyncio.run(body())
        results.put(("committer", won, lost, None))
    except BaseException as exc:
        barrier.abort()
        results.put(("committer", -1, -1, repr(exc)))
        raise


def hold_fence_open(
    url: str, term: Term, inside: Any, release: Any, bumped: Any, results: Any
) -> None:
    """``fj.hold_fence_open`` on an ``AsyncConnection``: journal a commit inside the async fence
    and keep the transaction open until told to commit (waiting in the event loop, so the loop
    really is idle while the lock is held); then try the same term again."""

    async def wait(event: Any, timeout: float) -> bool:
        return bool(await asyncio.to_thread(event.wait, timeout))

    async def body() -> None:
        backend = open_backend(url)
        store = AsyncStore(backend)
        try:
            async with store.fenced(term) as conn:
                seq = await conn.run_sync(fj.stamp, "commit", term)
                inside.set()
                if not await wait(release, 20):
                    raise AssertionError("never released")
            results.put(("committed", seq))
            if not await wait(bumped, 30):
                raise AssertionError("the bump never completed")
            try:
                await _commit(store, term)
                results.put(("second", "committed"))
            except StaleTermError as exc:
                results.put(("second", f"stale: {exc}"))
        finally:
            await store.dispose()
            backend.dispose()

    try:
        asyncio.run(body())
    except BaseException as exc:
        results.put(("error", repr(exc)))
        raise
