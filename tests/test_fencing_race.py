"""Acceptance 10: old-term writes never commit, under real transactions and real processes.

A Worker's business write and its term check happen in one transaction that locks the Lease row
(MySQL ``FOR UPDATE``; SQLite ``BEGIN IMMEDIATE``, i.e. the database write lock) through commit.
These tests race that transaction against term bumps from another OS process and read the
outcome from a commit-ordered journal (tests/_contract_fencing.py):

- the randomised race: 200 bumps against a committer that keeps using its term until the fence
  rejects it; no commit may carry a generation older than an already committed bump;
- the deterministic interleaving: while A holds ``fenced(term)`` open, B's bump waits; A commits
  first, and A's next attempt with the same term is rejected;
- the stale-before-entry case: a term bumped before ``fenced()`` commits nothing;
- positive controls: the journal check does flag a check-then-write across two transactions, and
  on SQLite only ``BEGIN IMMEDIATE`` (not a deferred read or pysqlite's default) is a lock.
"""

from __future__ import annotations

import itertools
import multiprocessing
import queue
import sqlite3
import time
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.exc import OperationalError

from apsup.errors import StaleTermError
from apsup.store.base import SqlBackend
from apsup.store.leases import INVALIDATED, Term, read_lease, validate
from tests import _contract_fencing as fj

pytestmark = [pytest.mark.timeout(180), pytest.mark.backends("sqlite", "mysql", "postgresql")]

ROUNDS = 200
SEED = 20261202
SPAWN = multiprocessing.get_context("spawn")


@pytest.fixture
def store(backend: SqlBackend) -> Iterator[SqlBackend]:
    fj.create_journal(backend)
    yield backend


def _initial_term(store: SqlBackend) -> Term:
    term = store.claim_term(fj.KEY, "holder-0", 60)
    assert term is not None and term.generation == 1
    with store.transaction() as conn:
        fj.stamp(conn, "bump", term)
    return term


def _results(q: Any, expected: int, timeout: float = 120) -> list[tuple[Any, ...]]:
    out = []
    deadline = time.monotonic() + timeout
    while len(out) < expected:
        try:
            out.append(q.get(timeout=max(0.1, deadline - time.monotonic())))
        except queue.Empty:
            pytest.fail(f"child processes reported {out} of {expected} results in {timeout}s")
    return out


def _join(*procs: Any) -> None:
    for p in procs:
        p.join(30)
        if p.is_alive():
            p.kill()
            p.join(5)
            pytest.fail(f"{p.name} did not exit")
        assert p.exitcode == 0, f"{p.name} exited {p.exitcode}"


def _blocked_on_lease_update(store: SqlBackend, timeout: float = 8.0) -> str:
    """Elected backends: wait until some other session is executing a write of the Lease table
    (i.e. B's bump reached the server and is waiting for the row lock). Returns that
    statement."""
    if store.name == "postgresql":
        return _blocked_on_lease_lock_pg(store, timeout)
    deadline = time.monotonic() + timeout
    with store.engine.connect() as observer:
        me = int(observer.execute(text("SELECT CONNECTION_ID()")).scalar_one())
        while time.monotonic() < deadline:
            rows = observer.execute(
                text("SELECT id, info FROM information_schema.processlist WHERE info IS NOT NULL")
            ).all()
            observer.rollback()
            for conn_id, info in rows:
                if (
                    int(conn_id) != me
                    and "pc_artifact_processing_leases" in info
                    and info.lstrip().upper().startswith("UPDATE")
                ):
                    return str(info)
            time.sleep(0.02)
    pytest.fail("the bump never reached the server while the fence was held")


def _blocked_on_lease_lock_pg(store: SqlBackend, timeout: float) -> str:
    """PostgreSQL: another session's statement on the Lease table waits for a row lock."""
    deadline = time.monotonic() + timeout
    with store.engine.connect() as observer:
        while time.monotonic() < deadline:
            rows = observer.execute(
                text(
                    "SELECT query FROM pg_stat_activity WHERE pid <> pg_backend_pid() "
                    "AND state = 'active' AND wait_event_type = 'Lock' "
                    "AND query LIKE '%pc_artifact_processing_leases%'"
                )
            ).all()
            observer.rollback()
            if rows:
                return str(rows[0][0])
            time.sleep(0.02)
    pytest.fail("the bump never reached the server while the fence was held")


# -- the randomised race -------------------------------------------------------------------------


def test_old_term_commits_never_follow_a_bump(store: SqlBackend, db_url: str) -> None:
    _initial_term(store)
    barrier = SPAWN.Barrier(2)
    results = SPAWN.Queue()
    committer = SPAWN.Process(
        target=fj.race_committer, args=(db_url, ROUNDS, SEED, barrier, results), name="committer"
    )
    bumper = SPAWN.Process(
        target=fj.race_bumper, args=(db_url, ROUNDS, SEED, barrier, results), name="bumper"
    )
    started = time.monotonic()
    committer.start()
    bumper.start()
    try:
        reports = {r[0]: r for r in _results(results, 2)}
    finally:
        _join(committer, bumper)
    elapsed = time.monotonic() - started

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

    # Every commit carried a real term (holder and generation), every term committed, and the
    # same holder was re-elected with a new generation many times (no ABA).
    terms = {(b.generation, b.holder_id) for b in bumps}
    assert {(e.generation, e.holder_id) for e in committed} == terms
    reelected = sum(1 for a, b in itertools.pairwise(bumps) if a.holder_id == b.holder_id)
    assert reelected >= ROUNDS // 5
    print(
        f"{store.name}: {ROUNDS} races in {elapsed:.1f}s: old term committed first {won}x "
        f"(the bump waited), bump first {lost}x (rejected); {reelected} same-holder re-elections"
    )
    # Both outcomes of the race occurred, so both paths were checked.
    assert won > 0 and lost > 0


# -- deterministic interleavings ------------------------------------------------------------------


def test_bump_waits_for_an_open_fenced_transaction(store: SqlBackend, db_url: str) -> None:
    term = _initial_term(store)
    inside, release, bumping, bumped = (SPAWN.Event() for _ in range(4))
    results = SPAWN.Queue()
    holder = SPAWN.Process(
        target=fj.hold_fence_open,
        args=(db_url, term, inside, release, bumped, results),
        name="A",
    )
    bumper = SPAWN.Process(
        target=fj.bump_once, args=(db_url, "holder-1", bumping, bumped, results), name="B"
    )
    holder.start()
    try:
        assert inside.wait(30), "A never entered fenced()"
        bumper.start()
        assert bumping.wait(30), "B never started its bump"
        if store.name != "sqlite":
            # B's UPDATE of the Lease row is on the server, waiting for A's FOR UPDATE lock.
            _blocked_on_lease_update(store)
        else:
            # A holds the database write lock: no writer can begin, however briefly it tries.
            probe = sqlite3.connect(store.path, timeout=0, isolation_level=None)  # type: ignore[attr-defined]
            try:
                with pytest.raises(sqlite3.OperationalError, match="locked"):
                    probe.execute("BEGIN IMMEDIATE")
            finally:
                probe.close()
        # Bounded check only (never used for ordering): B cannot finish while A holds the fence.
        assert not bumped.wait(0.5), "the bump committed while a fenced transaction held the term"
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


def test_term_bumped_before_entry_commits_nothing(store: SqlBackend) -> None:
    term = _initial_term(store)
    newer = fj.bump(store, "holder-1")
    assert newer.generation > term.generation
    ran = False
    with pytest.raises(StaleTermError, match="superseded"), store.fenced(term) as conn:
        ran = True  # never reached: validation happens before the body
        fj.stamp(conn, "commit", term)
    assert ran is False
    assert [e.kind for e in fj.read_journal(store)] == ["bump"]
    # The retried helper rejects it too, without retrying a term loss.
    with pytest.raises(StaleTermError):
        store.run_fenced(term, lambda conn: fj.stamp(conn, "commit", term))
    assert [e.kind for e in fj.read_journal(store)] == ["bump"]
    # The new term commits.
    store.run_fenced(newer, lambda conn: fj.stamp(conn, "commit", newer))
    assert fj.fencing_violations(fj.read_journal(store)) == []


def test_invalidated_lease_validates_no_term(store: SqlBackend) -> None:
    """After invalidate_terms (shutdown/mode switch) no term is valid, not even one that names
    the placeholder holder at the current generation."""
    term = _initial_term(store)
    store.invalidate_terms([fj.KEY])
    (row,) = store.lease_rows()
    assert row.holder_id == INVALIDATED and row.generation == term.generation + 1
    for candidate in (term, Term(fj.KEY, INVALIDATED, row.generation)):
        with pytest.raises(StaleTermError), store.fenced(candidate) as conn:
            fj.stamp(conn, "commit", candidate)
    assert [e.kind for e in fj.read_journal(store)] == ["bump"]


# -- positive controls ----------------------------------------------------------------------------


def test_check_then_write_in_two_transactions_is_caught(store: SqlBackend) -> None:
    """What fenced() prevents: validating in one transaction and writing in another commits a
    stale generation. The journal check must flag it (else the race test proves nothing)."""
    term = _initial_term(store)
    with store.read() as conn:
        validate(read_lease(conn, fj.KEY, for_update=False), term, store.now())
    newer = fj.bump(store, "holder-1")
    with store.transaction() as conn:
        fj.stamp(conn, "bump", newer)
    with store.transaction() as conn:  # unfenced: nothing re-checks the term
        fj.stamp(conn, "commit", term)
    problems = fj.fencing_violations(fj.read_journal(store))
    assert len(problems) == 1 and f"generation {term.generation} after bump" in problems[0]


@pytest.mark.backends("sqlite")
def test_sqlite_only_begin_immediate_is_a_lock(store: SqlBackend, db_url: str) -> None:
    """pysqlite's default transaction handling and a deferred BEGIN both let a bump through
    between the term check and the write; BEGIN IMMEDIATE (backend.fenced) does not."""
    term = _initial_term(store)
    path = store.path  # type: ignore[attr-defined]

    def writer_can_begin() -> bool:
        probe = sqlite3.connect(path, timeout=0, isolation_level=None)
        try:
            probe.execute("BEGIN IMMEDIATE")
            probe.execute("ROLLBACK")
            return True
        except sqlite3.OperationalError as exc:
            assert "locked" in str(exc)
            return False
        finally:
            probe.close()

    # 1. The recipe: from the term check to commit, no other writer can begin.
    with store.fenced(term) as conn:
        assert conn.connection.dbapi_connection.in_transaction  # type: ignore[union-attr]
        assert not writer_can_begin()
        fj.stamp(conn, "commit", term)
    assert writer_can_begin()

    # 2. A deferred read transaction is not a lock: a bump commits while it is open, and the
    #    stale snapshot cannot be upgraded to a write (SQLITE_BUSY_SNAPSHOT, immediately).
    with pytest.raises(OperationalError, match="locked"), store.read() as conn:
        validate(read_lease(conn, fj.KEY, for_update=False), term, None)
        assert writer_can_begin()
        term2 = fj.bump(store, "holder-1")
        started = time.monotonic()
        try:
            fj.stamp(conn, "commit", term)
        finally:
            assert time.monotonic() - started < 5  # no busy wait: it can never succeed

    assert term2.generation == term.generation + 1
    with store.transaction() as conn:
        fj.stamp(conn, "bump", term2)
    assert fj.fencing_violations(fj.read_journal(store)) == []

    # 3. Without the recipe (pysqlite's own BEGIN, emitted only before DML) FOR UPDATE is
    #    ignored, the check holds no lock, and the stale write commits after the bump.
    plain = create_engine(db_url)
    try:
        with plain.begin() as conn:
            validate(read_lease(conn, fj.KEY, for_update=True), term2, None)
            term3 = fj.bump(store, "holder-0")  # not blocked by the "locked" lease read
            with store.transaction() as other:
                fj.stamp(other, "bump", term3)
            fj.stamp(conn, "commit", term2)
    finally:
        plain.dispose()
    assert term3.generation == term2.generation + 1
    problems = fj.fencing_violations(fj.read_journal(store))
    assert len(problems) == 1, problems
    assert f"generation {term2.generation} after bump" in problems[0]
