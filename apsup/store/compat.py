"""Driver compatibility shims, each installed only when its driver is in use.

aiomysql (0.3) escapes ``bytes`` parameters with ``pymysql.converters.escape_bytes_prefixed``,
which PyMySQL 1.2 replaced by a placeholder string: every ``bytes`` parameter then fails with
"'str' object is not callable". apsup binds identifiers as bytes on MySQL (``VARBINARY``), so the
async path needs the helper back; PyMySQL's own connection escapes bytes the same way.
"""

from __future__ import annotations

_done = False


def _escape_bytes_prefixed(value: bytes) -> str:
    return f"_binary X'{bytes(value).hex()}'"


def aiomysql_bytes() -> None:
    """Give aiomysql a working bytes escaper when the installed PyMySQL lacks it (idempotent)."""
    global _done
    if _done:
        return
    _done = True
    try:
        import aiomysql.connection as conn
    except ImportError:
        return
    if not callable(getattr(conn, "escape_bytes_prefixed", None)):
        conn.escape_bytes_prefixed = _escape_bytes_prefixed
