"""Helpers for tests/test_fencing_race.py: a commit journal and the racing process bodies.

The journal is one table in the store's own database. Every entry takes its ``seq`` from a
counter row that it increments in the same transaction; the counter row stays locked until that
transaction commits (row lock on MySQL, the database write lock on SQLite), so ``seq`` order is
commit order among journal writers. Two kinds of entries:

- ``commit``: a business write made inside ``backend.fenced(term)``; ``generation`` is the term
  generation the fence validated.
- ``bump``: written by the bumping process in its own transaction *after* the term bump
  committed; ``generation`` is the new term's generation. Logging after the fact can only move
  the bump later in the journal, so the check below never reports a false violation.

Fencing holds iff no ``commit`` carries a generation older than a ``bump`` journalled before it.

Process bodies run under the ``spawn`` start method: they take plain values and rebuild the
backend from the URL, exactly as a Worker does.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Any

from sqlalchemy import BigInteger, Column, Connection, Integer, MetaData, String, Table, select
from sqlalchemy import update as sa_update

from apsup.errors import StaleTermError
from apsup.store import open_backend
from apsup.store.base import SqlBackend
from apsup.store.leases import Term, read_lease

KEY = "global"
COUNTER_ID = 1

journal_metadata = MetaData()

journal = Table(
    "contract_fence_journal",
    journal_metadata,
    Column("seq", BigInteger, primary_key=True, autoincrement=False),
    Column("kind", String(8), nullable=False),
    Column("generation", BigInteger, nullable=False),
    Column("holder_id", String(64), nullable=False),
)

journal_counter = Table(
    "contract_fence_counter",
    journal_metadata,
    Column("id", Integer, primary_key=True, autoincrement=False),
    Column("value", BigInteger, nullable=False),
)


def create_journal(backend: SqlBackend) -> None:
    journal_metadata.create_all(backend.engine)
    with backend.transaction() as conn:
        conn.execute(journal_counter.insert().values(id=COUNTER_ID, value=0))


def stamp(conn: Connection, kind: str, term: Term) -> int:
    """Append one journal entry in the caller's transaction; returns its commit-ordered seq."""
    conn.execute(
        sa_update(journal_counter)
        .where(journal_counter.c.id == COUNTER_ID)
        .values(value=journal_counter.c.value + 1)
    )
    seq = int(
        conn.execute(
            select(journal_counter.c.value).where(journal_counter.c.id == COUNTER_ID)
        ).scalar_one()
    )
    conn.execute(
        journal.insert().values(
            seq=seq, kind=kind, generation=term.generation, holder_id=term.holder_id
        )
    )
    return seq


@dataclass(frozen=True)
class Entry:
    seq: int
    kind: str
    generation: int
    holder_id: str


def read_journal(backend: SqlBackend) -> list[Entry]:
    with backend.read() as conn:
        rows = conn.execute(
            select(
                journal.c.seq, journal.c.kind, journal.c.generation, journal.c.holder_id
            ).order_by(journal.c.seq)
        ).all()
    return [Entry(int(r[0]), r[1], int(r[2]), r[3]) for r in rows]


def fencing_violations(entries: list[Entry]) -> list[str]:
    """Commits that carry a generation older than a bump journalled before them."""
    problems = []
    newest_bump: Entry | None = None
    for e in entries:
        if e.kind == "bump":
            if newest_bump is not None and e.generation <= newest_bump.generation:
                problems.append(f"bump #{e.seq} to {e.generation} after {newest_bump}")
            newest_bump = e
        elif newest_bump is not None and e.generation < newest_bump.generation:
            problems.append(
                f"commit #{e.seq} of generation {e.generation} after bump #{newest_bump.seq} "
                f"to generation {newest_bump.generation}"
            )
    return problems


def current_term(backend: SqlBackend, key: str = KEY) -> Term:
    """What a Worker would have been handed: the Lease as it reads now, without any lock."""
    with backend.read() as conn:
        row = read_lease(conn, key, for_update=False)
    assert row is not None
    return Term(key, row.holder_id, row.generation)


def bump(backend: SqlBackend, holder_id: str, key: str = KEY) -> Term:
    """A legitimate term replacement: the SQLite startup claim; elsewhere invalidate + take over."""
    if backend.name != "sqlite":  # elected: invalidate, then take over
        backend.invalidate_terms([key])
        term = backend.claim_term(key, holder_id, 60)
        if term is None:
            raise AssertionError("takeover of an invalidated Lease was refused")
        return term
    return backend.claim_term(key, holder_id, 0)


# -- process bodies (spawn) ------------------------------------------------------------------


def _jitter(rng: random.Random) -> None:
    """A random head start of up to ~2 ms, so that either side may win each race (a fault
    schedule, not synchronisation: correctness never depends on it)."""
    deadline = time.perf_counter() + rng.random() * 0.002
    while time.perf_counter() < deadline:
        pass


def race_committer(url: str, rounds: int, seed: int, barrier: Any, results: Any) -> None:
    """Process A. Each round, after the start barrier, it retries the term it holds at the very
    moment B bumps (the race); after the end barrier a term that just lost must be rejected,
    and it commits once under the new term, like a Worker dispatched by the new Supervisor."""
    backend = open_backend(url)
    rng = random.Random(seed)
    won = lost = 0
    try:
        term = current_term(backend)
        with backend.fenced(term) as conn:
            stamp(conn, "commit", term)
        for _ in range(rounds):
            barrier.wait(30)
            _jitter(rng)
            try:
                with backend.fenced(term) as conn:
                    stamp(conn, "commit", term)
                won += 1
            except StaleTermError:
                lost += 1
            barrier.wait(30)
            # B's bump has committed now: the held term must be rejected.
            try:
                with backend.fenced(term) as conn:
                    stamp(conn, "commit", term)
            except StaleTermError:
                pass
            else:
                raise AssertionError(f"term {term} committed after it was replaced")
            term = current_term(backend)
            with backend.fenced(term) as conn:
                stamp(conn, "commit", term)
        results.put(("committer", won, lost, None))
    except BaseException as exc:
        barrier.abort()
        results.put(("committer", won, lost, repr(exc)))
        raise
    finally:
        backend.dispose()


def race_bumper(url: str, rounds: int, seed: int, barrier: Any, results: Any) -> None:
    """Process B: one term bump per round, racing A's retry. Holders alternate at random, so
    the same holder is often re-elected with a new generation (the ABA case)."""
    backend = open_backend(url)
    rng = random.Random(seed + 1)
    done = 0
    try:
        for _ in range(rounds):
            barrier.wait(30)
            _jitter(rng)
            term = bump(backend, rng.choice(["holder-0", "holder-1"]))
            with backend.transaction() as conn:
                stamp(conn, "bump", term)
            done += 1
            barrier.wait(30)
        results.put(("bumper", done, 0, None))
    except BaseException as exc:
        barrier.abort()
        results.put(("bumper", done, 0, repr(exc)))
        raise
    finally:
        backend.dispose()


def hold_fence_open(
    url: str, term: Term, inside: Any, release: Any, bumped: Any, results: Any
) -> None:
    """Process A of the deterministic variant: journal a commit inside ``fenced(term)`` and keep
    the transaction open until told to commit; once B's bump went through, try the term again."""
    backend = open_backend(url)
    try:
        with backend.fenced(term) as conn:
            seq = stamp(conn, "commit", term)
            inside.set()
            if not release.wait(20):
                raise AssertionError("never released")
        results.put(("committed", seq))
        if not bumped.wait(30):
            raise AssertionError("the bump never completed")
        try:
            with backend.fenced(term) as conn:
                stamp(conn, "commit", term)
            results.put(("second", "committed"))
        except StaleTermError as exc:
            results.put(("second", f"stale: {exc}"))
    except BaseException as exc:
        results.put(("error", repr(exc)))
        raise
    finally:
        backend.dispose()


def bump_once(url: str, holder_id: str, bumping: Any, bumped: Any, results: Any) -> None:
    """Process B of the deterministic variant: one term bump, journalled after it commits."""
    backend = open_backend(url)
    try:
        bumping.set()
        term = bump(backend, holder_id)
        bumped.set()
        with backend.transaction() as conn:
            seq = stamp(conn, "bump", term)
        results.put(("bumped", term.generation, seq))
    except BaseException as exc:
        results.put(("error", repr(exc)))
        raise
    finally:
        backend.dispose()
