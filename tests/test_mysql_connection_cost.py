"""A new MySQL connection does not rebuild PyMySQL's default TLS context.

PyMySQL (1.2) tries TLS on every connection that names no TLS option and builds a fresh
``ssl.create_default_context()`` for it: loading the system CA store costs ~65 ms of CPU, paid by
every Worker (each opens its own connection). The backend builds that context once per process;
the forkserver builds it before forking, so Workers inherit it.
"""

from __future__ import annotations

import os

import pytest

from apsup.store import open_backend

pytestmark = pytest.mark.mysql_only


def _tls_context(url: str) -> object:
    backend = open_backend(url)
    try:
        with backend.read() as conn:
            return conn.connection.dbapi_connection.ctx  # type: ignore[union-attr]
    finally:
        backend.dispose()


def test_default_tls_context_is_built_once_per_process(backend_name: str, db_url: str) -> None:
    first = _tls_context(db_url)
    second = _tls_context(db_url)  # a new engine and a new connection, as in another Worker
    assert first is not None
    assert first is second


def test_forked_child_reuses_the_parents_context(backend_name: str, db_url: str) -> None:
    parent = _tls_context(db_url)
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        try:
            same = _tls_context(db_url) is parent
            os.write(write_fd, b"1" if same else b"0")
        finally:
            os._exit(0)
    os.close(write_fd)
    try:
        answer = os.read(read_fd, 1)
    finally:
        os.close(read_fd)
        os.waitpid(pid, 0)
    assert answer == b"1"


def test_explicit_tls_options_keep_their_own_context(backend_name: str, db_url: str) -> None:
    """A URL with TLS options is untouched: PyMySQL builds the context those options ask for."""
    from pymysql.connections import Connection

    from apsup.store.mysql import _connection_class

    cls = _connection_class()
    shared = cls._create_ssl_ctx(object.__new__(cls), {})
    own = cls._create_ssl_ctx(object.__new__(cls), {"check_hostname": False})
    assert own is not shared
    assert issubclass(cls, Connection)


def _lock_free(url: str, key: str) -> bool:
    """Whether another session can lock the Lease row ``key`` at once (NOWAIT)."""
    from sqlalchemy import create_engine, text

    engine = create_engine(url, isolation_level="READ COMMITTED")
    try:
        with engine.connect() as conn, conn.begin():
            try:
                conn.execute(
                    text(
                        "SELECT holder_id FROM pc_artifact_processing_leases "
                        "WHERE supervisor_key = :k FOR UPDATE NOWAIT"
                    ),
                    {"k": key},
                ).all()
            except Exception:
                return False
            return True
    finally:
        engine.dispose()


def test_a_connection_returned_inside_a_transaction_is_still_rolled_back(
    backend_name: str, db_url: str
) -> None:
    """The pool skips its ROLLBACK only after a transaction SQLAlchemy saw end: a DBAPI
    connection returned with a row lock held (``raw_connection()``) is rolled back as before."""
    from apsup.store import migrate
    from apsup.store.leases import GLOBAL_KEY, new_holder_id

    migrate(db_url)
    backend = open_backend(db_url)
    try:
        assert backend.claim_term(GLOBAL_KEY, new_holder_id(), 60) is not None
        raw = backend.engine.raw_connection()
        cur = raw.cursor()
        cur.execute(
            "SELECT holder_id FROM pc_artifact_processing_leases "
            "WHERE supervisor_key = %s FOR UPDATE",
            (GLOBAL_KEY,),
        )
        cur.execute(
            "UPDATE pc_artifact_processing_leases SET holder_id = 'uncommitted' "
            "WHERE supervisor_key = %s",
            (GLOBAL_KEY,),
        )
        cur.close()
        assert not _lock_free(db_url, GLOBAL_KEY)  # held by the raw connection
        raw.close()  # back to the pool, transaction open
        assert _lock_free(db_url, GLOBAL_KEY)
        assert [r.holder_id for r in backend.lease_rows()] != ["uncommitted"]
    finally:
        backend.dispose()


def test_an_idle_pooled_connection_killed_by_the_server_is_replaced(
    backend_name: str, db_url: str
) -> None:
    """Connections used a moment ago are not pinged before use; one idle for longer is, and a
    dead one is replaced before the caller sees it."""
    import time

    from sqlalchemy import create_engine, text

    from apsup.store.mysql import PING_AFTER_IDLE_SECONDS

    backend = open_backend(db_url)
    admin = create_engine(db_url, isolation_level="AUTOCOMMIT")
    try:
        with backend.read() as conn:
            victim = conn.execute(text("SELECT CONNECTION_ID()")).scalar_one()
        with admin.connect() as conn:
            conn.execute(text(f"KILL {int(victim)}"))
        time.sleep(PING_AFTER_IDLE_SECONDS + 0.5)
        with backend.read() as conn:
            again = conn.execute(text("SELECT CONNECTION_ID()")).scalar_one()
        assert again != victim
    finally:
        admin.dispose()
        backend.dispose()
