"""Async twin of a backend's fenced transaction, on SQLAlchemy's asyncio extension.

The async engine is derived from the configured (sync) URL: ``sqlite`` becomes
``sqlite+aiosqlite`` and ``mysql``/``mariadb`` become ``mysql+aiomysql``, with the same database,
credentials and options. Connections get the same treatment as the sync backend's: on SQLite
every write transaction starts with ``BEGIN IMMEDIATE`` (the database write lock is the fence),
on MySQL/OceanBase READ COMMITTED and a bounded transaction time on the Lease row lock. The term
check itself is the sync backend's own code, run on the async connection through
``run_sync``: there is one implementation of "lock and validate the Lease", not two.

An ``AsyncEngine`` belongs to the event loop that opened its connections (aiosqlite runs one
thread per connection, aiomysql owns sockets on the loop): build one per loop, dispose of it
before the loop ends, and never create one in a process that will fork.
"""

from __future__ import annotations

import importlib.util
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from sqlalchemy import Engine, event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from apsup.errors import ConfigError
from apsup.store.base import SqlBackend
from apsup.store.leases import Term

ASYNC_DRIVERS = {
    "sqlite": "sqlite+aiosqlite",
    "mysql": "mysql+aiomysql",
    "postgresql": "postgresql+psycopg",  # psycopg 3 serves both; SQLAlchemy picks its async side
}
_DRIVERS = {
    "sqlite+aiosqlite": "aiosqlite",
    "mysql+aiomysql": "aiomysql",
    "postgresql+psycopg": "psycopg",
}
#: A MySQL URL option the sync backend consumes itself; no driver understands it.
_BACKEND_ONLY_PARAMS = ("apsup_fence_timeout",)


def async_url(url: str | URL) -> URL:
    """The asyncio-driver URL for a configured database URL (same database and options)."""
    u = make_url(url)
    name = u.get_backend_name()
    kind = "mysql" if name in {"mysql", "mariadb"} else name
    if kind not in ASYNC_DRIVERS:
        raise ConfigError(
            f"no async driver for database backend {name!r}: use sqlite, mysql or postgresql"
        )
    return u.difference_update_query(_BACKEND_ONLY_PARAMS).set(drivername=ASYNC_DRIVERS[kind])


def _sqlite_listeners(engine: Engine, synchronous: str) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _rec: Any) -> None:
        dbapi_conn.isolation_level = None  # SQLAlchemy emits BEGIN itself (below)
        cur = dbapi_conn.cursor()
        try:
            cur.execute(f"PRAGMA synchronous={synchronous}")
        finally:
            cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        # The database write lock from the first statement through COMMIT: the term checked
        # inside cannot change before this transaction ends. SQLite's busy handler waits for
        # it in aiosqlite's thread, so the event loop keeps running meanwhile.
        conn.exec_driver_sql("BEGIN IMMEDIATE")

    @event.listens_for(engine, "handle_error")
    def _on_error(ctx: Any) -> None:
        # As in the sync backend: an error that ended SQLite's transaction (SQLITE_FULL ...)
        # while SQLAlchemy still reports it open must not let later statements autocommit.
        conn = ctx.connection
        if conn is None or conn.invalidated or not conn.in_transaction():
            return
        try:
            ended = not conn.connection.dbapi_connection._connection._conn.in_transaction
        except Exception:
            return
        if ended:
            ctx.is_disconnect = True
            ctx.invalidate_pool_on_disconnect = False


def _mysql_listeners(engine: Engine, abort_codes: frozenset[int]) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, rec: Any) -> None:
        # What the sync backend records per connection: whether this is OceanBase (whose
        # transactions that lock the Lease row get a bounded lifetime).
        cur = dbapi_conn.cursor()
        try:
            cur.execute("SELECT VERSION()")
            row = cur.fetchone()
            rec.info["apsup_oceanbase"] = bool(row) and "oceanbase" in str(row[0]).lower()
        finally:
            cur.close()
            dbapi_conn.rollback()

    @event.listens_for(engine, "handle_error")
    def _on_error(ctx: Any) -> None:
        exc = ctx.original_exception
        code = exc.args[0] if getattr(exc, "args", None) else None
        if code in abort_codes:  # the whole transaction, Lease lock included, is gone
            ctx.is_disconnect = True
            ctx.invalidate_pool_on_disconnect = False


class AsyncStore:
    """An ``AsyncEngine`` for ``backend``'s database with the backend's fencing rules."""

    def __init__(self, backend: SqlBackend) -> None:
        self.backend = backend
        url = async_url(backend.engine.url)
        if importlib.util.find_spec(_DRIVERS[url.drivername]) is None:
            raise ConfigError(
                f"fenced_async() needs the {_DRIVERS[url.drivername]} driver: "
                f"pip install {_DRIVERS[url.drivername]}"
            )
        self.engine: AsyncEngine
        if backend.name == "sqlite":
            self.engine = create_async_engine(
                url, connect_args={"timeout": getattr(backend, "busy_timeout", 30.0)}
            )
            _sqlite_listeners(self.engine.sync_engine, "FULL")
        elif backend.name == "postgresql":
            from apsup.store.postgresql import session_options

            self.engine = create_async_engine(
                url,
                connect_args={"options": session_options(backend)},
                isolation_level="READ COMMITTED",
                pool_pre_ping=True,
                pool_recycle=1800,
                pool_size=4,
                max_overflow=8,
            )
        else:
            from apsup.store.mysql import TRANSACTION_ABORT_CODES

            self.engine = create_async_engine(
                url,
                isolation_level="READ COMMITTED",
                pool_pre_ping=True,
                pool_recycle=1800,
                pool_size=4,
                max_overflow=8,
            )
            _mysql_listeners(self.engine.sync_engine, TRANSACTION_ABORT_CODES)

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[AsyncConnection]:
        """A write transaction (``BEGIN IMMEDIATE`` on SQLite), not fenced."""
        async with self.engine.connect() as conn:
            try:
                async with conn.begin():
                    yield conn
            except DBAPIError:
                # The transaction's state is unknown after a driver error: never reuse it.
                if not conn.invalidated:
                    await conn.invalidate()
                raise

    @asynccontextmanager
    async def fenced(self, term: Term) -> AsyncIterator[AsyncConnection]:
        """A write transaction in which ``term`` was locked and validated before the body."""
        async with self.transaction() as conn:
            await conn.run_sync(self.backend.check_term, term)
            yield conn

    async def dispose(self) -> None:
        await self.engine.dispose()
