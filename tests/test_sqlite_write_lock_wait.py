"""Waiting for the SQLite write lock (store/sqlite.py ``_begin_immediate``).

A write transaction that finds the lock held waits for it in short steps instead of SQLite's
busy handler, still bounded by the backend's busy timeout: it proceeds once the holder commits,
it fails as "database is locked" (a transient error the callers retry) when the holder keeps the
lock past the timeout, the connection keeps its busy timeout either way, and writers racing from
several processes lose no update.
"""

from __future__ import annotations

import multiprocessing
import sqlite3
import threading
from pathlib import Path

import pytest
from sqlalchemy import text
from sqlalchemy.exc import OperationalError

from apsup.store import migrate
from apsup.store.base import BackendError
from apsup.store.sqlite import SqliteBackend, database_path

pytestmark = [pytest.mark.backends("sqlite"), pytest.mark.timeout(120)]


@pytest.fixture
def path(db_url: str) -> Path:
    migrate(db_url)
    backend = SqliteBackend(db_url)
    with backend.transaction() as conn:
        conn.execute(text("CREATE TABLE lock_rows (id INTEGER PRIMARY KEY, who TEXT NOT NULL)"))
    backend.dispose()
    found = database_path(db_url)
    assert found is not None
    return found


def _hold_lock(path: Path) -> sqlite3.Connection:
    holder = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    holder.execute("BEGIN IMMEDIATE")
    holder.execute("INSERT INTO lock_rows (who) VALUES ('holder')")
    return holder


def _busy_timeout_ms(backend: SqliteBackend) -> int:
    with backend.read() as conn:
        return int(conn.exec_driver_sql("PRAGMA busy_timeout").scalar_one())


def test_a_write_waits_for_the_holder_and_commits_after_it(db_url: str, path: Path) -> None:
    backend = SqliteBackend(db_url)
    holder = _hold_lock(path)
    release = threading.Timer(0.3, lambda: holder.execute("COMMIT"))
    try:
        release.start()
        with backend.transaction() as conn:
            conn.execute(text("INSERT INTO lock_rows (who) VALUES ('waiter')"))
        with backend.read() as conn:
            order = [r[0] for r in conn.execute(text("SELECT who FROM lock_rows ORDER BY id"))]
        assert order == ["holder", "waiter"]  # the waiter began only after the holder committed
        assert _busy_timeout_ms(backend) == 30_000  # the driver's busy timeout is back
    finally:
        release.join()
        holder.close()
        backend.dispose()


def test_a_lock_held_past_the_busy_timeout_fails_as_database_is_locked(
    db_url: str, path: Path
) -> None:
    backend = SqliteBackend(db_url, busy_timeout=0.3)
    holder = _hold_lock(path)
    try:
        with (
            pytest.raises(OperationalError, match="database is locked") as failure,
            backend.transaction() as conn,
        ):
            conn.execute(text("INSERT INTO lock_rows (who) VALUES ('never')"))
        assert backend._is_transient(failure.value)  # callers' bounded retry applies
        with pytest.raises(BackendError, match="lock contention persisted"):
            backend.run(lambda conn: conn.execute(text("INSERT INTO lock_rows (who) VALUES ('x')")))
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    with backend.transaction() as conn:  # the lock is free: the same backend writes again
        conn.execute(text("INSERT INTO lock_rows (who) VALUES ('after')"))
    assert _busy_timeout_ms(backend) == 300
    with backend.read() as conn:
        assert [r[0] for r in conn.execute(text("SELECT who FROM lock_rows"))] == ["after"]
    backend.dispose()


def test_errors_other_than_busy_are_not_waited_on_and_surface_wrapped(
    db_url: str, path: Path
) -> None:
    backend = SqliteBackend(db_url, busy_timeout=60)
    with backend.engine.connect() as conn:
        # The driver is inside a transaction SQLAlchemy does not know of: BEGIN IMMEDIATE fails
        # with an error that waiting cannot cure (the test's 120 s limit would catch a wait).
        conn.connection.dbapi_connection.execute("BEGIN")  # type: ignore[union-attr]
        with pytest.raises(OperationalError, match="within a transaction"):
            conn.begin()
    backend.dispose()


def _increment(url: str, rounds: int, ready: object) -> None:
    backend = SqliteBackend(url)
    ready.wait()  # type: ignore[attr-defined]
    for _ in range(rounds):
        with backend.transaction() as conn:
            value = conn.execute(text("SELECT COUNT(*) FROM lock_rows")).scalar_one()
            conn.execute(text("INSERT INTO lock_rows (who) VALUES (:who)"), {"who": str(value)})
    backend.dispose()


def test_racing_writer_processes_lose_no_update(db_url: str, path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()
    procs = [ctx.Process(target=_increment, args=(db_url, 40, ready)) for _ in range(6)]
    for proc in procs:
        proc.start()
    ready.set()
    for proc in procs:
        proc.join(90)
        assert proc.exitcode == 0
    with sqlite3.connect(path) as conn:
        seen = [int(r[0]) for r in conn.execute("SELECT who FROM lock_rows ORDER BY id")]
    # Each writer read the count and wrote it in one write transaction: serialised, the values
    # are exactly 0..239; any write outside the lock would repeat a value.
    assert seen == list(range(240))
