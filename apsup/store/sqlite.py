"""SQLite backend: one host, permanent terms, fencing by real ``BEGIN IMMEDIATE`` transactions.

pysqlite does not emit BEGIN by itself (so a check-then-write would not be fenced): the
documented SQLAlchemy recipe takes over transaction control, and every write transaction starts
with ``BEGIN IMMEDIATE`` so the database write lock is held from the term check through commit.
Reads use a deferred ``BEGIN`` and never take the write lock.
"""

from __future__ import annotations

import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, create_engine, event, update
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError

from apsup.errors import ConfigError
from apsup.store.base import SqlBackend
from apsup.store.leases import INVALIDATED, Term, read_lease, take_lease, validate
from apsup.store.schema import leases

BUSY_TIMEOUT_SECONDS = 30.0
_READONLY = "apsup_readonly"


def database_path(url: str) -> Path | None:
    """The file behind a sqlite URL, or None for in-memory databases."""
    u = make_url(url)
    if u.get_backend_name() != "sqlite":
        raise ConfigError(f"not a sqlite URL: {u.get_backend_name()}")
    if not u.database or u.database == ":memory:":
        return None
    return Path(u.database).resolve()


def _create_private(path: Path) -> None:
    """Create the database file 0600 so -wal/-shm (which copy its mode) are private too."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except FileExistsError:
        return
    os.close(fd)


class SqliteBackend(SqlBackend):
    name = "sqlite"
    # A committed SQLite connection needs no goodbye; closing the last one would checkpoint and
    # truncate the WAL inside a Worker that is about to exit, on the invocation's time.
    close_before_exit = False

    def __init__(self, url: str, *, synchronous: str = "FULL") -> None:
        super().__init__(url)
        self.path = database_path(url)
        if self.path is None:
            raise ConfigError(
                "apsup needs a SQLite database file shared with Worker processes; "
                "use sqlite:////absolute/path/apsup.db, not an in-memory database"
            )
        _create_private(self.path)
        self.engine = create_engine(url, connect_args={"timeout": BUSY_TIMEOUT_SECONDS})
        self.read_engine = self.engine.execution_options(**{_READONLY: True})

        @event.listens_for(self.engine, "connect")
        def _on_connect(dbapi_conn: Any, _rec: Any) -> None:
            dbapi_conn.isolation_level = None  # SQLAlchemy emits BEGIN itself (below)
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute(f"PRAGMA synchronous={synchronous}")
            cur.execute(f"PRAGMA busy_timeout={int(BUSY_TIMEOUT_SECONDS * 1000)}")
            cur.close()

        @event.listens_for(self.engine, "handle_error")
        def _on_error(ctx: Any) -> None:
            # SQLITE_FULL/IOERR/NOMEM/BUSY may end the whole transaction inside SQLite while
            # SQLAlchemy still reports it open; in autocommit mode the next statement on this
            # connection would then commit on its own, outside the lock and the term check, even
            # if the caller catches this error. Treat it like a lost connection: SQLAlchemy
            # invalidates it now and refuses further statements until the block rolls back.
            conn = ctx.connection
            if conn is None or conn.invalidated or not conn.in_transaction():
                return
            try:
                ended = not conn.connection.dbapi_connection.in_transaction
            except Exception:
                return
            if ended:
                ctx.is_disconnect = True
                ctx.invalidate_pool_on_disconnect = False  # only this connection is affected

        @event.listens_for(self.engine, "begin")
        def _on_begin(conn: Connection) -> None:
            if conn.get_execution_options().get(_READONLY):
                conn.exec_driver_sql("BEGIN")
            else:
                conn.exec_driver_sql("BEGIN IMMEDIATE")

    def _is_transient(self, exc: DBAPIError) -> bool:
        text = str(exc.orig).lower()
        return "database is locked" in text or "database is busy" in text

    def now(self) -> datetime:
        # One host: the database clock is this host's clock.
        return datetime.now(UTC).replace(tzinfo=None)

    def _lease_expiry(self, conn: Connection, lease_seconds: float) -> datetime | None:
        return None  # SQLite terms never expire; they are replaced

    def _lock_term(self, conn: Connection, term: Term) -> None:
        # BEGIN IMMEDIATE already holds the database write lock until commit.
        validate(read_lease(conn, term.supervisor_key, for_update=False), term, None)

    def claim_term(self, key: str, holder_id: str, lease_seconds: float = 0) -> Term:
        """Legitimate startup: new holder, generation + 1, expires_at NULL."""

        def body(conn: Connection) -> Term:
            row = read_lease(conn, key, for_update=False)
            return take_lease(conn, key, holder_id, row, None)

        return self.run(body)

    def renew_term(self, term: Term, lease_seconds: float = 0) -> bool:
        with self.read() as conn:
            row = read_lease(conn, term.supervisor_key, for_update=False)
        return row is not None and (row.holder_id, row.generation) == (
            term.holder_id,
            term.generation,
        )

    def release_term(self, term: Term) -> None:
        def body(conn: Connection) -> None:
            conn.execute(
                update(leases)
                .where(
                    leases.c.supervisor_key == term.supervisor_key,
                    leases.c.holder_id == term.holder_id,
                    leases.c.supervisor_generation == term.generation,
                )
                .values(
                    holder_id=INVALIDATED,
                    supervisor_generation=leases.c.supervisor_generation + 1,
                )
            )

        self.run(body)
