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
