"""What a host checks before its first claim, and which startup errors end it.

A database that does not answer yet (server restarting, network blip, SQLite file locked by a
long transaction) is an infrastructure condition: the host stays up, reports not ready and tries
again (``apsup.supervisor.host``). A wrong URL, refused credentials, a missing database or a
schema at another revision is a configuration error: retrying cannot fix it, so the host exits
with code 2 and one line saying what to change.
"""

from __future__ import annotations

from collections.abc import Iterable

from sqlalchemy.exc import DBAPIError

from apsup.errors import ConfigError
from apsup.registry import Family
from apsup.store import SqlBackend
from apsup.store.revision import check as check_revision

#: MySQL/OceanBase server errors no retry fixes: access denied (1044, 1045, 1698), unknown
#: database (1049), missing table (1146).
_ACCESS_DENIED = {1044, 1045, 1698}
_UNKNOWN_DATABASE = 1049
_NO_TABLE = 1146


def _mysql_code(exc: DBAPIError) -> int | None:
    args = getattr(exc.orig, "args", ())
    return args[0] if args and isinstance(args[0], int) else None


def configuration_problem(exc: BaseException, backend: SqlBackend) -> ConfigError | None:
    """The ``ConfigError`` (what to change) if ``exc`` is a configuration error, else None
    (an infrastructure error worth retrying)."""
    if isinstance(exc, ConfigError):
        return exc
    if not isinstance(exc, DBAPIError):
        return None
    code = _mysql_code(exc)
    text = str(exc.orig).lower()
    where = backend.describe()
    if code == _NO_TABLE or "no such table" in text or "doesn't exist" in text:
        return ConfigError(
            f"the apsup schema is missing in {where}: run `apsup migrate` "
            "(during maintenance) before starting replicas"
        )
    if code in _ACCESS_DENIED:
        return ConfigError(
            f"the database refused the credentials for {where}: fix the user or password "
            "in the DATABASE_URL setting"
        )
    if code == _UNKNOWN_DATABASE:
        return ConfigError(
            f"the database named in the DATABASE_URL setting does not exist ({where}): "
            "create it, then run `apsup migrate`"
        )
    if backend.name == "sqlite" and "unable to open database file" in text:
        return ConfigError(
            f"cannot open the SQLite database {where}: check the DATABASE_URL setting and "
            "that its directory exists and is writable"
        )
    return None


def needs_reference_tables(families: Iterable[Family]) -> bool:
    """Whether any of ``families`` is one of apsup's reference families, whose tables come with
    ``apsup migrate --with-reference-families``."""
    return any(f.entry_point.startswith("apsup.families.") for f in families)


def check_schema(backend: SqlBackend, *, reference_families: bool = False) -> None:
    """Raise ``ConfigError`` when the schema is missing or at another revision, or when
    ``reference_families`` and their tables are missing; infrastructure errors propagate
    unchanged (the caller retries)."""
    try:
        backend.lease_rows()
        with backend.read() as conn:
            # behind or ahead of this code: names `apsup migrate` (and its flag)
            check_revision(conn, reference_families=reference_families)
    except DBAPIError as exc:
        problem = configuration_problem(exc, backend)
        if problem is not None:
            raise problem from None
        raise
