"""Which constraint a refused write broke, from the driver's own error code, not its wording.

A concurrent first registration of a Scope loses an INSERT on the primary key; that, and only
that, is resolved by retrying as an UPDATE. Any other integrity error (a CHECK constraint, a
foreign key) must reach the caller. Messages differ per server and translation, codes do not:
MySQL/OceanBase error 1062, SQLite's extended code for a primary-key or unique violation,
SQLSTATE 23505 (the standard's code, PostgreSQL's).
"""

from __future__ import annotations

from sqlalchemy.exc import DBAPIError

MYSQL_DUPLICATE_ENTRY = 1062
SQLITE_DUPLICATE = frozenset({"SQLITE_CONSTRAINT_PRIMARYKEY", "SQLITE_CONSTRAINT_UNIQUE"})
SQLSTATE_UNIQUE_VIOLATION = "23505"


def is_duplicate_key(exc: BaseException) -> bool:
    """The write was refused because a row with the same primary or unique key exists."""
    orig = exc.orig if isinstance(exc, DBAPIError) else exc
    args: tuple[object, ...] = tuple(getattr(orig, "args", ()))
    if args and isinstance(args[0], int) and not isinstance(args[0], bool):
        # PyMySQL / aiomysql: (errno, message); their SQLSTATE, 23000, covers every integrity
        # error alike, so the server's error number decides.
        return args[0] == MYSQL_DUPLICATE_ENTRY
    errorname = getattr(orig, "sqlite_errorname", None)
    if errorname is not None:
        return str(errorname) in SQLITE_DUPLICATE
    sqlstate = getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)
    return sqlstate is not None and str(sqlstate) == SQLSTATE_UNIQUE_VIOLATION
