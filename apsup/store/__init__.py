"""Persistence: schema, intents, scan state, leases, and one module per backend."""

from __future__ import annotations

import contextlib
from pathlib import Path

from sqlalchemy.engine import make_url

from apsup.errors import ConfigError
from apsup.store.base import SqlBackend, redact_url
from apsup.store.leases import Backend, Term

__all__ = [
    "Backend",
    "SqlBackend",
    "Term",
    "backend_kind",
    "migrate",
    "open_backend",
    "redact_url",
    "worker_preload",
]


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
    raise ConfigError(f"unsupported database backend {name!r}: use sqlite or mysql (OceanBase)")


def open_backend(url: str, *, control: bool = False) -> SqlBackend:
    """The backend for ``url`` (schema must exist: see ``migrate``).

    ``control``: the host's own backend, whose every call is time-limited
    (``apsup.store.limits``); Workers and CLI commands use the default.
    """
    kind = backend_kind(url)
    if kind == "sqlite":
        from apsup.store.sqlite import SqliteBackend

        return SqliteBackend(url, control=control)
    from apsup.store.mysql import MysqlBackend

    return MysqlBackend(url, control=control)


def worker_preload(url: str) -> list[str]:
    """Modules a Worker imports to open the backend of ``url`` (apsup backend module, SQLAlchemy
    dialect, DBAPI driver), for the forkserver to import once instead of every Worker: the
    SQLite dialect and ``sqlite3`` alone cost 20-40 ms per launch on a 2-core machine."""
    kind = backend_kind(url)
    dialect = make_url(url).get_dialect()
    modules = [f"apsup.store.{kind}", dialect.__module__]
    with contextlib.suppress(ImportError):  # a missing driver: open_backend reports it
        modules.append(dialect.import_dbapi().__name__)
    return modules


def migrations_dir() -> Path:
    import apsup.migrations

    return Path(apsup.migrations.__file__).resolve().parent


def migrate(url: str, revision: str = "head") -> None:
    """Run Alembic ``upgrade`` to ``revision`` on ``url``."""
    from alembic import command
    from alembic.config import Config

    backend = open_backend(url)
    try:
        cfg = Config()
        cfg.set_main_option("script_location", str(migrations_dir()))
        with backend.engine.begin() as conn:
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, revision)
    finally:
        backend.dispose()
