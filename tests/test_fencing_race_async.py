"""The fencing proofs of tests/test_fencing_race.py, for the async path (``fenced_async``).

The committing process uses ``AsyncStore.fenced`` on ``sqlite+aiosqlite`` / ``mysql+aiomysql``
(the engine ``ctx.fenced_async()`` uses); the bumping process is the sync one. The journal and
its check are the sync tests' (tests/_contract_fencing.py):

- the randomised race: bumps against an async committer; no commit may carry a generation older
  than an already committed bump, and both outcomes of the race occur;
- the deterministic interleaving: while the async fence is open (its event loop idle), the bump
  waits; the fenced commit lands first, and the same term is then rejected;
- the stale-before-entry case: a term bumped before ``fenced_async()`` commits nothing, at the
  ``AsyncStore`` level and through ``ExecutionContext.fenced_async``;
- the paused Worker: a coroutine that checked its term in one ``fenced_async()`` and is
  suspended while the term is bumped cannot commit a write or an acknowledgment afterwards.
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing
import sqlite3
from collections.abc import Iterator
from typing import Any

import pytest

from apsup.context import ExecutionContext, dispose_async_backends
from apsup.errors import StaleTermError
from apsup.store import intents
from apsup.store.async_engine import AsyncStore, async_url
from apsup.store.base import SqlBackend
from apsup.store.leases import Term
from tests import _contract_fencing as fj
from tests import _contract_fencing_async as fja
from tests.test_fencing_race import _blocked_on_lease_update, _initial_term, _join, _results

pytestmark = [pytest.mark.timeout(180), pytest.mark.backends("sqlite", "mysql", "postgresql")]

ROUNDS = 200
SEED = 20261203
SPAWN = multiprocessing.get_context("spawn")


@pytest.fixture
def store(backend: SqlBackend) -> Iterator[SqlBackend]:
    fj.create_journal(backend)
    yield backend


def test_async_url_is_derived_from_the_configured_url() -> None:
    assert async_url("sqlite:////var/lib/a.db").render_as_string() == (
        "sqlite+aiosqlite:////var/lib/a.db"
    )
    derived = async_url(
        "mysql+pymysql://u:pw@127.0.0.1:2881/db?charset=utf8mb4&apsup_fence_timeout=5"
    )
    assert derived.drivername == "mysql+aiomysql" and derived.password == "pw"
    assert dict(derived.query) == {"charset": "utf8mb4"}  # the backend's own option is dropped


def test_old_term_commits_never_follow_a_bump(store: SqlBackend, db_url: str) -> None:
    _initial_term(store)
    barrier = SPAWN.Barrier(2)
    results = SPAWN.Queue()
    committer = SPAWN.Process(
        target=fja.race_committer, args=(db_url, ROUNDS, SEED, barrier, results), name="committer"
    )
    bumper = SPAWN.Process(
        target=fj.race_bumper, args=(db_url, ROUNDS, SEED, barrier, results), name="bumper"
    )
    committer.start()
    bumper.start()
    try:
        reports = {r[0]: r for r in _results(results, 2)}
    finally:
        _join(committer, bumper)

    assert reports["bumper"][3] is None, reports["bumper"]
    assert reports["committer"][3] is None, reports["committer"]
    _, won, lost, _ = reports["committer"]
    assert won + lost == ROUNDS
    entries = fj.read_journal(store)
    bumps = [e for e in entries if e.kind == "bump"]
    committed = [e for e in entries if e.kind == "commit"]
    assert len(bumps) == ROUNDS + 1
    assert len(committed) == 1 + ROUNDS + won
    assert fj.fencing_violations(entries) == []
    terms = {(b.generation, b.holder_id) for b in bumps}
    assert {(e.generation, e.holder_id) for e in committed} == terms
    reelected = sum(1 for a, b in itertools.pairwise(bumps) if a.holder_id == b.holder_id)
    assert reelected >= ROUNDS // 5
    print(f"{store.name} async: old term committed first {won}x, bump first {lost}x")
    assert won > 0 and lost > 0


def test_bump_waits_for_an_open_async_fenced_transaction(store: SqlBackend, db_url: str) -> None:
    term = _initial_term(store)
    inside, release, bumping, bumped = (SPAWN.Event() for _ in range(4))
    results = SPAWN.Queue()
    holder = SPAWN.Process(
        target=fja.hold_fence_open,
        args=(db_url, term, inside, release, bumped, results),
        name="A",
    )
    bumper = SPAWN.Process(
        target=fj.bump_once, args=(db_url, "holder-1", bumping, bumped, results), name="B"
    )
    holder.start()
    try:
        assert inside.wait(30), "A never entered fenced_async()"
        bumper.start()
        assert bumping.wait(30), "B never started its bump"
        if store.name != "sqlite":
            _blocked_on_lease_update(store)
        else:
            probe = sqlite3.connect(store.path, timeout=0, isolation_level=None)  # type: ignore[attr-defined]
            try:
                with pytest.raises(sqlite3.OperationalError, match="locked"):
                    probe.execute("BEGIN IMMEDIATE")
            finally:
                probe.close()
        assert not bumped.wait(0.5), "the bump committed while an async fence held the term"
        release.set()
        reports = _results(results, 3)
    finally:
        release.set()
        _join(holder, bumper)

    by_kind: dict[str, list[tuple[Any, ...]]] = {}
    for r in reports:
        by_kind.setdefault(r[0], []).append(r)
    assert "error" not in by_kind, by_kind
    ((_, commit_seq),) = by_kind["committed"]
    ((_, new_generation, bump_seq),) = by_kind["bumped"]
    ((_, second),) = by_kind["second"]
    assert new_generation > term.generation
    assert second.startswith("stale"), second
    entries = fj.read_journal(store)
    assert [(e.kind, e.generation) for e in entries] == [
        ("bump", term.generation),
        ("commit", term.generation),
        ("bump", new_generation),
    ]
    assert commit_seq < bump_seq
    assert fj.fencing_violations(entries) == []


def _ctx(store: SqlBackend, term: Term) -> ExecutionContext:
    """A Worker's context for a real accepted request of binding ``b``."""
    generation = store.run(lambda conn: intents.request(conn, "b", "s"))
    with store.read() as conn:
        row = intents.get(conn, "b", "s")
    assert row is not None
    return ExecutionContext(
        binding_name="b",
        artifact_family="f",
        scope_id="s",
        claimed_request_generation=generation,
        supervisor_key=term.supervisor_key,
        holder_id=term.holder_id,
        supervisor_generation=term.generation,
        worker_id="w",
        pending_sequence=row.pending_sequence,
        entry_point="m:f",
        database_url=store.url,
    )


def _handled(store: SqlBackend) -> int:
    with store.read() as conn:
        row = intents.get(conn, "b", "s")
    return 0 if row is None else row.handled_generation


def test_paused_worker_cannot_commit_after_a_bump(store: SqlBackend) -> None:
    term = _initial_term(store)
    ctx = _ctx(store, term)
    resumed = asyncio.Event()

    async def worker() -> list[str]:
        outcome: list[str] = []
        async with ctx.fenced_async() as conn:  # the check: the term is valid now
            outcome.append(f"checked dirty={await ctx.dirty_generation_async(conn)}")
        await resumed.wait()  # ... suspended here while the term is bumped ...
        try:
            async with ctx.fenced_async() as conn:
                await conn.run_sync(fj.stamp, "commit", term)
                await ctx.acknowledge_async(conn)
        except StaleTermError:
            outcome.append("stale")
        return outcome

    async def scenario() -> list[str]:
        task = asyncio.create_task(worker())
        await asyncio.sleep(0.2)
        newer = await asyncio.to_thread(fj.bump, store, "holder-1")
        assert newer.generation > term.generation
        resumed.set()
        try:
            return await task
        finally:
            await dispose_async_backends()

    assert asyncio.run(scenario()) == ["checked dirty=0", "stale"]
    assert [e.kind for e in fj.read_journal(store)] == ["bump"]  # nothing written
    assert not ctx.acknowledged and _handled(store) == 0


def test_term_bumped_before_entry_commits_nothing(store: SqlBackend) -> None:
    term = _initial_term(store)
    ctx = _ctx(store, term)
    newer = fj.bump(store, "holder-1")

    async def attempts() -> list[str]:
        ran: list[str] = []
        async_store = AsyncStore(store)
        try:
            with pytest.raises(StaleTermError, match="superseded"):
                async with async_store.fenced(term) as conn:
                    ran.append("store")  # never reached: validation happens before the body
                    await conn.run_sync(fj.stamp, "commit", term)
            with pytest.raises(StaleTermError, match="superseded"):
                async with ctx.fenced_async() as conn:
                    ran.append("ctx")
                    await ctx.acknowledge_async(conn)
            async with async_store.fenced(newer) as conn:  # the new term commits
                await conn.run_sync(fj.stamp, "commit", newer)
        finally:
            await async_store.dispose()
            await dispose_async_backends()
        return ran

    assert asyncio.run(attempts()) == []
    assert not ctx.acknowledged and _handled(store) == 0
    entries = fj.read_journal(store)
    assert [(e.kind, e.generation) for e in entries] == [
        ("bump", term.generation),
        ("commit", newer.generation),
    ]
    assert fj.fencing_violations(entries) == []


def test_acknowledge_async_outside_the_async_fence_is_refused(store: SqlBackend) -> None:
    term = _initial_term(store)
    ctx = ExecutionContext(
        binding_name="b",
        artifact_family="f",
        scope_id="s",
        claimed_request_generation=1,
        supervisor_key=term.supervisor_key,
        holder_id=term.holder_id,
        supervisor_generation=term.generation,
        worker_id="w",
        pending_sequence=1,
        entry_point="m:f",
        database_url=store.url,
    )

    async def attempt() -> None:
        async_store = AsyncStore(store)
        try:
            async with async_store.transaction() as conn:  # a write, but not this ctx's fence
                with pytest.raises(StaleTermError, match=r"inside ctx\.fenced_async"):
                    await ctx.acknowledge_async(conn)
                with pytest.raises(StaleTermError, match=r"inside ctx\.fenced_async"):
                    await ctx.mark_clean_async(conn, 1)
        finally:
            await async_store.dispose()

    asyncio.run(attempt())
    assert not ctx.acknowledged
