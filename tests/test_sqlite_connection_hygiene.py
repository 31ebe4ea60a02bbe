"""SQLite connection hygiene around fenced transactions (DESIGN §5, §6).

SQLITE_FULL (and a few other errors) roll back the *whole* transaction inside SQLite while
SQLAlchemy still believes it is open; with the BEGIN IMMEDIATE recipe the driver is in
autocommit mode, so a later write on that connection would commit at once, outside any lock or
term check. Therefore:

- after a DBAPI error escapes a fenced transaction its connection is invalidated (closed, never
  returned to the pool), whatever the error;
- a connection whose transaction SQLite has already ended refuses further statements even when
  the processor catches the error and carries on inside the block;
- every later write on the backend still begins with BEGIN IMMEDIATE and holds the write lock;
- SAVEPOINT-level errors that leave the transaction intact (the intents upsert) keep working.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import event, text
from sqlalchemy.exc import DBAPIError, IntegrityError, OperationalError, PendingRollbackError

from apsup.store import intents
from apsup.store.base import SqlBackend
from apsup.store.leases import Term

pytestmark = [pytest.mark.backends("sqlite"), pytest.mark.timeout(60)]


@pytest.fixture
def term(backend: SqlBackend) -> Term:
    with backend.transaction() as conn:
        conn.execute(text("CREATE TABLE hyg_rows (id INTEGER PRIMARY KEY, note TEXT NOT NULL)"))
    return backend.claim_term("global", "holder", 0)


@pytest.fixture
def invalidated(backend: SqlBackend) -> Iterator[list[Any]]:
    """DBAPI connections the pool invalidated while the test ran."""
    seen: list[Any] = []

    def on_invalidate(dbapi_conn: Any, record: Any, exc: Any) -> None:
        seen.append(dbapi_conn)

    event.listen(backend.engine, "invalidate", on_invalidate)
    yield seen
    event.remove(backend.engine, "invalidate", on_invalidate)


def _notes(backend: SqlBackend) -> list[str]:
    with backend.read() as conn:
        return [r[0] for r in conn.execute(text("SELECT note FROM hyg_rows ORDER BY id"))]


def _fill_disk(conn: Any) -> None:
    """Make the next large write fail with SQLITE_FULL on this connection only."""
    pages = conn.exec_driver_sql("PRAGMA page_count").scalar_one()
    conn.exec_driver_sql(f"PRAGMA max_page_count = {int(pages)}")


def _writer_can_begin(backend: SqlBackend) -> bool:
    probe = sqlite3.connect(backend.path, timeout=0, isolation_level=None)  # type: ignore[attr-defined]
    try:
        probe.execute("BEGIN IMMEDIATE")
        probe.execute("ROLLBACK")
        return True
    except sqlite3.OperationalError as exc:
        assert "locked" in str(exc)
        return False
    finally:
        probe.close()


def _closed(dbapi_conn: Any) -> bool:
    try:
        dbapi_conn.execute("SELECT 1")
    except sqlite3.ProgrammingError as exc:
        return "closed" in str(exc)
    return False


def test_the_hazard_is_real_in_this_sqlite() -> None:
    """Why: after SQLITE_FULL, SQLite has rolled back the transaction by itself and the next
    write on the same connection autocommits (raw sqlite3, autocommit mode like the recipe)."""
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "raw.db"
        a = sqlite3.connect(path, isolation_level=None)
        b = sqlite3.connect(path, isolation_level=None)
        try:
            a.execute("PRAGMA journal_mode=WAL")
            a.execute("CREATE TABLE t (v BLOB)")
            a.execute("BEGIN IMMEDIATE")
            a.execute("INSERT INTO t VALUES ('fenced')")
            pages = a.execute("PRAGMA page_count").fetchone()[0]
            a.execute(f"PRAGMA max_page_count = {pages}")
            with pytest.raises(sqlite3.OperationalError, match="full"):
                a.execute("INSERT INTO t VALUES (randomblob(500000))")
            assert a.in_transaction is False  # the whole transaction is gone
            a.execute("INSERT INTO t VALUES ('after')")  # no BEGIN: autocommits
            assert [r[0] for r in b.execute("SELECT v FROM t")] == ["after"]
        finally:
            a.close()
            b.close()


@pytest.mark.parametrize("failure", ["disk_full", "no_such_table", "constraint"])
def test_dbapi_error_invalidates_the_connection(
    backend: SqlBackend, term: Term, invalidated: list[Any], failure: str
) -> None:
    dbapi: Any = None
    with pytest.raises(DBAPIError), backend.fenced(term) as conn:
        dbapi = conn.connection.dbapi_connection
        conn.execute(text("INSERT INTO hyg_rows (id, note) VALUES (1, 'fenced write')"))
        if failure == "disk_full":
            _fill_disk(conn)
            conn.execute(text("INSERT INTO hyg_rows (note) VALUES (randomblob(500000))"))
        elif failure == "no_such_table":
            conn.execute(text("INSERT INTO no_such_table VALUES (1)"))
        else:
            conn.execute(text("INSERT INTO hyg_rows (id, note) VALUES (1, 'duplicate')"))
    assert dbapi is not None
    assert dbapi in invalidated  # not returned to the pool for reuse ...
    assert _closed(dbapi)  # ... but closed
    assert _notes(backend) == []  # nothing of the failed transaction committed
    with backend.engine.connect() as conn:
        assert conn.connection.dbapi_connection is not dbapi


def test_a_caught_error_cannot_turn_later_writes_into_autocommits(
    backend: SqlBackend, term: Term, invalidated: list[Any]
) -> None:
    """A processor that swallows SQLITE_FULL and keeps writing in the same block must not
    commit anything: SQLite already ended the transaction, so the connection is discarded at the
    error and every further statement on it fails."""
    refused = (PendingRollbackError, DBAPIError)
    later: BaseException | None = None
    with pytest.raises(refused), backend.fenced(term) as conn:
        dbapi = conn.connection.dbapi_connection
        conn.execute(text("INSERT INTO hyg_rows (note) VALUES ('fenced write')"))
        _fill_disk(conn)
        try:
            conn.execute(text("INSERT INTO hyg_rows (note) VALUES (randomblob(500000))"))
        except OperationalError as exc:
            assert "full" in str(exc)
        try:
            conn.execute(text("INSERT INTO hyg_rows (note) VALUES ('after the error')"))
        except refused as exc:
            later = exc
            raise
        # Reached only if the write went through: show what it did before failing the test.
        leaked = _notes(backend)
        pytest.fail(f"write after a rolled-back transaction ran unfenced; committed: {leaked}")
    assert later is not None
    assert dbapi in invalidated
    assert _notes(backend) == []


def test_later_writes_still_begin_immediate(
    backend: SqlBackend, term: Term, invalidated: list[Any]
) -> None:
    with pytest.raises(OperationalError), backend.fenced(term) as conn:
        _fill_disk(conn)
        conn.execute(text("INSERT INTO hyg_rows (note) VALUES (randomblob(500000))"))
    assert invalidated

    statements: list[str] = []  # what SQLite itself executed, settings (PRAGMA) left out

    def record(statement: str) -> None:
        if not statement.startswith("PRAGMA"):
            statements.append(" ".join(statement.split()[:2]))

    def trace(dbapi_conn: Any, record_: Any, proxy: Any) -> None:
        dbapi_conn.set_trace_callback(record)

    event.listen(backend.engine, "checkout", trace)
    try:
        for opener in (lambda: backend.fenced(term), backend.transaction):
            statements.clear()
            with opener() as conn:
                dbapi = conn.connection.dbapi_connection
                assert dbapi.in_transaction  # type: ignore[union-attr]
                assert not _writer_can_begin(backend)  # the write lock is held
                conn.execute(text("INSERT INTO hyg_rows (note) VALUES ('fenced again')"))
            assert statements[0] == "BEGIN IMMEDIATE", statements
            assert _writer_can_begin(backend)
        statements.clear()
        backend.run_fenced(term, lambda c: intents.mark_dirty(c, "b", "s"))
        assert statements[0] == "BEGIN IMMEDIATE", statements
        # Reads stay deferred and never block a writer.
        statements.clear()
        with backend.read() as conn:
            conn.execute(text("SELECT count(*) FROM hyg_rows")).scalar_one()
            assert _writer_can_begin(backend)
        assert statements[0] == "BEGIN", statements
    finally:
        event.remove(backend.engine, "checkout", trace)
    assert _notes(backend) == ["fenced again", "fenced again"]


def test_savepoint_errors_keep_the_transaction(
    backend: SqlBackend, term: Term, invalidated: list[Any]
) -> None:
    """A statement error that SQLite confines to a SAVEPOINT leaves the fenced transaction
    usable (the intents first-registration upsert relies on it)."""
    with backend.fenced(term) as conn:
        conn.execute(text("INSERT INTO hyg_rows (id, note) VALUES (1, 'kept')"))
        with pytest.raises(IntegrityError), conn.begin_nested():
            conn.execute(text("INSERT INTO hyg_rows (id, note) VALUES (1, 'duplicate')"))
        conn.execute(text("INSERT INTO hyg_rows (id, note) VALUES (2, 'also kept')"))
        assert intents.mark_dirty(conn, "b", "s") == 1
    assert invalidated == []
    assert _notes(backend) == ["kept", "also kept"]
