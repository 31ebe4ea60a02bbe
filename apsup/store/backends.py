"""Which backend a database URL names, and opening it (one module per backend behind it)."""

from __future__ import annotations

import contextlib
import importlib.util

from sqlalchemy import Engine
from sqlalchemy.engine import make_url

from apsup.errors import ConfigError
from apsup.store.base import SqlBackend, redact_url


def backend_kind(url: str) -> str:
    try:
        name = make_url(url).get_backend_name()
    except Exception as exc:
        raise ConfigError(
            f"database URL {redact_url(url)!r} is not a valid SQLAlchemy URL "
            "(e.g. sqlite:////var/lib/apsup/apsup.db or mysql+pymysql://user@host:2881/db)"
        ) from exc
    if name == "sqlite":
        return "sqlite"
    if name in {"mysql", "mariadb"}:
        return "mysql"
    if name == "postgresql":
        return "postgresql"
    raise ConfigError(
        f"unsupported database backend {name!r}: use sqlite, mysql (OceanBase) or postgresql"
    )


#: Backends several replicas share, whose terms are Leases in database time.
ELECTED = frozenset({"mysql", "postgresql"})


def is_elected(url: str) -> bool:
    """Whether ``url``'s backend elects leaders (several hosts may share it)."""
    return backend_kind(url) in ELECTED


def open_backend(url: str, *, create: bool = False, control: bool = False) -> SqlBackend:
    """The backend for ``url`` (schema must exist: see ``migrate``).

    ``create``: a SQLite file (and its directory) is created only then, which ``migrate``
    passes: a mistyped path given to ``run`` or ``trigger`` is refused instead of becoming a new
    empty database. ``control``: the host's own backend, whose every call is time-limited
    (``apsup.store.limits``); Workers and CLI commands use the default.
    """
    kind = backend_kind(url)
    if kind == "sqlite":
        from apsup.store.sqlite import SqliteBackend

        return SqliteBackend(url, create=create, control=control)
    try:
        make_url(url).get_dialect().import_dbapi()
    except ImportError:
        extra = "postgresql] (psycopg 3)" if kind == "postgresql" else "mysql] (PyMySQL)"
        raise ConfigError(
            f"{redact_url(url)!r} needs a database driver that is not installed: "
            f"pip install 'apsup[{extra}"
        ) from None
    if kind == "postgresql":
        from apsup.store.postgresql import PostgresqlBackend

        return PostgresqlBackend(url, control=control)
    from apsup.store.mysql import MysqlBackend

    return MysqlBackend(url, control=control)


def connect(url: str) -> Engine:
    """An SQLAlchemy Engine for the application's own transactions on apsup's database.

    Use it for the transactions that publish intent (``fam.request(conn, ...)``,
    ``fam.mark_dirty(conn, ...)``) together with the application's writes. It is configured as
    apsup's own: on SQLite every transaction starts with ``BEGIN IMMEDIATE`` (so a
    read-then-write transaction waits for the write lock instead of failing with
    ``SQLITE_BUSY_SNAPSHOT``), WAL and a busy timeout (the database must exist: ``apsup
    migrate`` creates it); on MySQL/OceanBase READ COMMITTED, as apsup's own sessions. A plain
    ``create_engine(url)`` works too; ``dispose()`` the engine when done.
    """
    return open_backend(url).engine


def worker_preload(url: str, *, asynchronous: bool = True) -> list[str]:
    """Modules a Worker imports to open the backend of ``url`` (apsup backend module, SQLAlchemy
    dialect, DBAPI driver), for the forkserver to import once instead of every Worker: importing
    them is a large part of a fresh Worker's launch otherwise.

    ``asynchronous``: also the async engine and driver (``fenced_async``), which only
    ``async def`` processors use: image that every fork copies page tables for."""
    kind = backend_kind(url)
    dialect = make_url(url).get_dialect()
    modules = [f"apsup.store.{kind}", dialect.__module__]
    with contextlib.suppress(ImportError):  # a missing driver: open_backend reports it
        modules.append(dialect.import_dbapi().__name__)
    # ``fenced_async()`` (async processors): imports only, paid by every Worker otherwise. No loop,
    # connection or thread is created by importing them; those are made in each Worker.
    if not asynchronous:
        return modules
    from apsup.store.async_engine import async_url

    driver = {"sqlite": "aiosqlite", "mysql": "aiomysql", "postgresql": "psycopg"}[kind]
    if importlib.util.find_spec(driver) is not None:  # optional: only async processors need it
        modules += ["apsup.store.async_engine", async_url(url).get_dialect().__module__, driver]
    return modules
