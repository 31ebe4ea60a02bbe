"""Shared fixtures: backend parametrisation, fresh databases, the MySQL-compatible test server.

Fixtures (names are relied on by the whole suite):

- ``backend_name``: ``"sqlite"``, ``"mysql"`` or ``"postgresql"`` (parametrised; the mysql
  param carries the ``mysql_only`` mark and the postgresql one the ``postgresql`` mark, so
  ``-m "not mysql_only and not postgresql"`` runs the sqlite part alone). PostgreSQL runs only
  the tests whose ``backends`` mark names it: the guarantees the backend has reached.
- ``db_url``: URL string of a fresh, empty database for the current backend.
- ``backend``: ``apsup.store.open_backend(db_url)`` after ``apsup.store.migrate(db_url)``.
- ``mysql_url_admin`` (session): server URL without a database, e.g.
  ``mysql+pymysql://root:PASSWORD@127.0.0.1:PORT/``. Taken from ``APSUP_TEST_MYSQL_URL`` (set by
  ``./run test``), otherwise a seekdb server is started once per (xdist worker) process.

- ``postgresql_url_admin`` (session): the PostgreSQL server's URL, from
  ``APSUP_TEST_POSTGRESQL_URL`` (set by ``./run test``), otherwise a server is started once per
  (xdist worker) process (``tests.pg_server``).

Marks: ``@pytest.mark.mysql_only`` or ``@pytest.mark.backends("sqlite")`` on a test (or
``pytestmark`` in a module) keep only the listed ``backend_name`` params; the others are
deselected rather than skipped.

When a server is unavailable its tests are skipped with the reason, except under ``CI=true``
where they fail: CI must never pass without the real servers (DESIGN.md §5).
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# --- environment hygiene (runs at import, before any apsup module reads its settings) ----------

_KEEP_ENV = {
    "APSUP_TEST_MYSQL_URL",
    "APSUP_TEST_POSTGRESQL_URL",
    "APSUP_SOAK",
    "APSUP_TEST_WORKERS",
    "APSUP_SIM_SEED",
    "APSUP_SIM_STEPS",
    "APSUP_UPDATE_SCREENSHOT",
}
_SCRUB_PREFIXES = ("APSUP_", "POWERCONTEXT_SERVER_RUNTIME_")

for _name in list(os.environ):
    if _name.startswith(_SCRUB_PREFIXES) and _name not in _KEEP_ENV:
        del os.environ[_name]

REPO_ROOT = Path(__file__).resolve().parent.parent

# Child processes (the CLI as a subprocess, spawned workers) must import `tests.<helper>` too.
_pythonpath = os.environ.get("PYTHONPATH", "")
if str(REPO_ROOT) not in _pythonpath.split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), _pythonpath) if p)

MYSQL_URL_ENV = "APSUP_TEST_MYSQL_URL"
POSTGRESQL_URL_ENV = "APSUP_TEST_POSTGRESQL_URL"
BACKENDS = ("sqlite", "mysql", "postgresql")
#: Where a test names no backends: PostgreSQL runs a guarantee's tests once the module names it
#: (``@pytest.mark.backends("sqlite", "mysql", "postgresql")``), as the backend reaches it.
DEFAULT_BACKENDS = frozenset({"sqlite", "mysql"})


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in {"1", "true", "yes", "on"}


def _unavailable(reason: str, server: str = "MySQL-compatible") -> None:
    """Fail under CI, skip elsewhere: CI must not go green without the real servers."""
    if in_ci():
        pytest.fail(f"{server} test server unavailable under CI=true: {reason}")
    pytest.skip(f"{server} test server unavailable: {reason}")


# --- marks ---------------------------------------------------------------------------------------


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "backends(*names): run the test only for these backend_name params (sqlite, mysql, "
        "postgresql; without the mark: sqlite and mysql)",
    )


def _allowed_backends(item: pytest.Item) -> set[str] | None:
    allowed: set[str] | None = set(DEFAULT_BACKENDS)
    marker = item.get_closest_marker("backends")
    if marker is not None:
        unknown = set(marker.args) - set(BACKENDS)
        if unknown or not marker.args:
            raise pytest.UsageError(
                f"{item.nodeid}: @pytest.mark.backends takes names from {BACKENDS}, "
                f"got {marker.args!r}"
            )
        allowed = set(marker.args)
    if item.get_closest_marker("mysql_only") is not None:
        allowed = allowed & {"mysql"}
    return allowed


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    keep: list[pytest.Item] = []
    dropped: list[pytest.Item] = []
    for item in items:
        callspec = getattr(item, "callspec", None)
        name = callspec.params.get("backend_name") if callspec is not None else None
        allowed = _allowed_backends(item)
        if name is not None and allowed is not None and name not in allowed:
            dropped.append(item)
        else:
            keep.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep


# --- MySQL-compatible server ---------------------------------------------------------------------


def _pymysql_connect(url: str, **overrides: Any) -> Any:
    import pymysql
    from sqlalchemy.engine import make_url

    u = make_url(url)
    kwargs: dict[str, Any] = {
        "host": u.host or "127.0.0.1",
        "port": u.port or 3306,
        "user": u.username or "root",
        "password": u.password or "",
        "connect_timeout": 10,
        "autocommit": True,
    }
    kwargs.update(overrides)
    return pymysql.connect(**kwargs)


@pytest.fixture(scope="session")
def mysql_url_admin() -> Iterator[str]:
    """URL of the MySQL-compatible server without a database (``.../``); no CREATE done here."""
    url = os.environ.get(MYSQL_URL_ENV, "").strip()
    if url:
        try:
            _pymysql_connect(url).close()
        except Exception as exc:
            _unavailable(f"{MYSQL_URL_ENV}={url} does not accept connections: {exc}")
        yield url
        return

    from tests.seekdb_server import SeekdbServer, SeekdbUnavailable

    server = SeekdbServer()
    try:
        server.start()
    except SeekdbUnavailable as exc:
        _unavailable(f"{MYSQL_URL_ENV} is unset and seekdb could not start: {exc}")
    try:
        yield server.admin_url
    finally:
        server.stop()


def _mysql_database_url(admin_url: str, database: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(admin_url).set(database=database).render_as_string(hide_password=False)


@pytest.fixture(scope="session")
def postgresql_url_admin() -> Iterator[str]:
    """URL of the PostgreSQL server's ``postgres`` database (as superuser ``postgres``)."""
    url = os.environ.get(POSTGRESQL_URL_ENV, "").strip()
    if url:
        try:
            _psycopg_connect(url).close()
        except Exception as exc:
            _unavailable(f"{POSTGRESQL_URL_ENV}={url} does not accept connections: {exc}", "PG")
        yield url
        return

    from tests.pg_server import PostgresServer, PostgresUnavailable

    server = PostgresServer()
    try:
        server.start()
    except PostgresUnavailable as exc:
        _unavailable(f"{POSTGRESQL_URL_ENV} is unset and PostgreSQL could not start: {exc}", "PG")
    try:
        yield server.admin_url
    finally:
        server.stop()


def _psycopg_connect(url: str) -> Any:
    import psycopg
    from sqlalchemy.engine import make_url

    u = make_url(url)
    return psycopg.connect(
        host=u.host or "127.0.0.1",
        port=u.port or 5432,
        user=u.username or "postgres",
        password=u.password or "",
        dbname=u.database or "postgres",
        connect_timeout=10,
        autocommit=True,
    )


@pytest.fixture(
    params=[
        "sqlite",
        pytest.param("mysql", marks=pytest.mark.mysql_only),
        pytest.param("postgresql", marks=pytest.mark.postgresql),
    ],
    ids=["sqlite", "mysql", "postgresql"],
)
def backend_name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def db_url(backend_name: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh, empty database for ``backend_name``, dropped (mysql) at teardown."""
    if backend_name == "sqlite":
        yield f"sqlite:///{tmp_path / 'apsup.db'}"  # tmp_path is absolute: sqlite:////...
        return
    if backend_name == "postgresql":
        yield from _postgresql_database(request.getfixturevalue("postgresql_url_admin"))
        return
    if backend_name != "mysql":
        raise ValueError(f"unknown backend_name {backend_name!r}; expected one of {BACKENDS}")

    admin_url = request.getfixturevalue("mysql_url_admin")
    database = f"apsup_t_{secrets.token_hex(6)}"  # lower case: lower_case_table_names=1
    conn = _pymysql_connect(admin_url)
    try:
        with conn.cursor() as cur:
            cur.execute(f"CREATE DATABASE `{database}`")
    finally:
        conn.close()
    try:
        yield _mysql_database_url(admin_url, database)
    finally:
        conn = _pymysql_connect(admin_url)
        try:
            with conn.cursor() as cur:
                cur.execute(f"DROP DATABASE IF EXISTS `{database}`")
        finally:
            conn.close()


def _postgresql_database(admin_url: str) -> Iterator[str]:
    from sqlalchemy.engine import make_url

    database = f"apsup_t_{secrets.token_hex(6)}"
    conn = _psycopg_connect(admin_url)
    try:
        conn.execute(f'CREATE DATABASE "{database}"')
    finally:
        conn.close()
    try:
        yield make_url(admin_url).set(database=database).render_as_string(hide_password=False)
    finally:
        conn = _psycopg_connect(admin_url)
        try:
            conn.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
        finally:
            conn.close()


@pytest.fixture
def backend(db_url: str) -> Iterator[Any]:
    """The migrated store for ``db_url``; asserts no pooled connection leaked at teardown."""
    from apsup.store import migrate, open_backend

    migrate(db_url)
    store = open_backend(db_url)
    try:
        yield store
        pool = store.engine.pool
        checked_out = pool.checkedout() if hasattr(pool, "checkedout") else 0
        assert checked_out == 0, f"{checked_out} connection(s) still checked out of {pool!r}"
    finally:
        store.dispose()
