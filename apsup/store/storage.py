"""Storage-level database errors: the database cannot write (disk full, read-only, I/O error).

These are an infrastructure condition, not a processor's failure: every Scope would fail the
same way until space or the volume comes back. The Supervisor therefore reports them at host
level (readiness, log, metric) and retries without growing any Scope's backoff.

What the MySQL-compatible test server (seekdb 1.4) does when its volume is really full: it
does not answer with a disk-full error. Writes succeed until its current 64 MiB redo block is
used up; then every write ends in a statement timeout (4012), and writes kept timing out for as
long as we watched (90 s) after space returned, until the server was restarted. A timeout does
not name its cause, so that outage is handled like any other database outage (lease expiry,
ordinary retries), not as a storage condition; the codes below are those of servers that do
report the condition.
"""

from __future__ import annotations

import sqlite3
from typing import Literal

StorageKind = Literal["full", "read_only", "io"]

#: SQLite primary result codes (extended codes carry them in the low byte).
_SQLITE: dict[int, StorageKind] = {
    sqlite3.SQLITE_FULL: "full",
    sqlite3.SQLITE_READONLY: "read_only",
    sqlite3.SQLITE_IOERR: "io",
}
#: MySQL / OceanBase error numbers.
_MYSQL: dict[int, StorageKind] = {
    1021: "full",  # ER_DISK_FULL
    1114: "full",  # ER_RECORD_FILE_FULL (table is full)
    4184: "full",  # OceanBase: server out of disk space
    1290: "read_only",  # ER_OPTION_PREVENTS_STATEMENT (--read-only)
    1792: "read_only",  # ER_CANT_EXECUTE_IN_READ_ONLY_TRANSACTION
    1836: "read_only",  # ER_READ_ONLY_MODE
    3: "io",  # ER_ERROR_ON_WRITE
    1030: "io",  # ER_GET_ERRNO (storage engine error)
}

#: Human words for logs and status reasons.
DESCRIBE: dict[str, str] = {"full": "disk full", "read_only": "read-only", "io": "I/O error"}


def storage_error_kind(exc: BaseException | None) -> StorageKind | None:
    """``full`` / ``read_only`` / ``io`` if ``exc`` (or what it wraps) is a storage-level
    database error, else None."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        kind = _direct(exc)
        if kind is not None:
            return kind
        exc = getattr(exc, "orig", None) or exc.__cause__ or exc.__context__
    return None


def _direct(exc: BaseException) -> StorageKind | None:
    code = getattr(exc, "sqlite_errorcode", None)
    if isinstance(code, int):
        return _SQLITE.get(code & 0xFF)
    args = getattr(exc, "args", ())
    if type(exc).__module__.startswith("pymysql") and args and isinstance(args[0], int):
        return _MYSQL.get(args[0])
    return None
