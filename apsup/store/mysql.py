"""MySQL-mode backend (OceanBase in production): expiring Leases from database time, election,
renewal, and ``SELECT ... FOR UPDATE`` fencing inside every business and control write.

Dialect facts this module is built on (DESIGN §6, §7):
- READ COMMITTED is set explicitly (OceanBase's default; under REPEATABLE READ a FOR UPDATE on a
  row changed after the snapshot fails with 6235).
- ``NOW(6)`` is fixed at statement start, lock wait included, so expiry is read in a separate
  statement *after* the Lease row lock is held.
- ``NOW(6)`` is also in the session time zone, and seekdb's default is +08:00: database time is
  read as ``UTC_TIMESTAMP(6)``, and every session is set to ``+00:00`` on connect so that any
  other time function or DATETIME conversion on apsup's connections is UTC as well.
- 1205 (lock wait timeout) rolls back only the statement and 1213 (deadlock) the transaction:
  both are retried as a whole transaction, a bounded number of times. 2013 during COMMIT has an
  unknown outcome and is never blindly retried.
- A transaction that locks a Lease row (every fenced write, claim, renewal, release) is bounded
  on OceanBase by ``ob_trx_timeout`` (default 30 s; URL query ``apsup_fence_timeout=SECONDS``,
  0 = the server's default of one day). Otherwise a frozen process (SIGSTOP, VM pause) holding
  the row lock inside a fenced transaction blocks every takeover for as long as the server keeps
  that transaction open. The server aborts it at the bound (4012/6002): nothing of it commits,
  and the waiting candidate proceeds. The variable is session-scoped and set once per connection
  before its first such transaction (``SET`` does not open a transaction there).
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection, create_engine, event, text, update
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError, IntegrityError

from apsup.errors import ConfigError
from apsup.store.base import SqlBackend
from apsup.store.leases import (
    GLOBAL_KEY,
    INVALIDATED,
    Term,
    is_live,
    other_mode_keys,
    read_lease,
    refuse_mode_conflict,
    take_lease,
    validate,
)
from apsup.store.schema import leases

#: Errors after which the server has rolled back the whole transaction (not just a statement).
TRANSACTION_ABORT_CODES = frozenset({1213, 4012, 6002})
TRANSIENT_CODES = frozenset({1205, 1213, 4012, 6002, 6005, 6213, 6235})
FENCE_TIMEOUT_SECONDS = 30.0
FENCE_TIMEOUT_PARAM = "apsup_fence_timeout"
#: Database time in UTC whatever the server's or the session's time zone (naive, microseconds).
_UTC_NOW = text("SELECT UTC_TIMESTAMP(6)")


def _error_code(exc: DBAPIError) -> int | None:
    args = getattr(exc.orig, "args", ())
    if args and isinstance(args[0], int):
        return args[0]
    return None


class MysqlBackend(SqlBackend):
    name = "mysql"

    def __init__(self, url: str) -> None:
        super().__init__(url)
        u = make_url(url)
        raw = u.query.get(FENCE_TIMEOUT_PARAM)
        try:
            self.fence_timeout = FENCE_TIMEOUT_SECONDS if raw is None else float(str(raw))
        except ValueError:
            raise ConfigError(
                f"database URL parameter {FENCE_TIMEOUT_PARAM} must be a number of seconds"
            ) from None
        self.engine = create_engine(
            u.difference_update_query([FENCE_TIMEOUT_PARAM]),
            isolation_level="READ COMMITTED",
            pool_pre_ping=True,
            pool_recycle=1800,
            pool_size=4,
            max_overflow=8,
        )
        self.read_engine = self.engine

        @event.listens_for(self.engine, "connect")
        def _on_connect(dbapi_conn: Any, rec: Any) -> None:
            # PyMySQL reports "5.7.25" as the server version; VERSION() names OceanBase.
            cur = dbapi_conn.cursor()
            try:
                cur.execute("SET time_zone = '+00:00'")  # database time is naive UTC
                cur.execute("SELECT VERSION()")
                row = cur.fetchone()
                rec.info["apsup_oceanbase"] = bool(row) and "oceanbase" in str(row[0]).lower()
            finally:
                cur.close()
                dbapi_conn.rollback()  # leave no implicit transaction open

        @event.listens_for(self.engine, "handle_error")
        def _on_error(ctx: Any) -> None:
            # A deadlock (1213) or a server-side transaction abort rolls back the WHOLE
            # transaction, Lease row lock included; if a caller caught it and kept writing on
            # this connection, those writes would run in a fresh, unfenced transaction. Treat
            # it like a lost connection so SQLAlchemy refuses further statements on it.
            exc = ctx.original_exception
            code = exc.args[0] if getattr(exc, "args", None) else None
            if code in TRANSACTION_ABORT_CODES:
                ctx.is_disconnect = True
                ctx.invalidate_pool_on_disconnect = False

    def _bound(self, conn: Connection) -> None:
        """Bound this session's transactions (OceanBase) before the Lease row is locked."""
        if self.fence_timeout <= 0:
            return
        info = conn.connection.info
        if info.get("apsup_oceanbase") and not info.get("apsup_bounded"):
            conn.exec_driver_sql(f"SET ob_trx_timeout = {int(self.fence_timeout * 1_000_000)}")
            info["apsup_bounded"] = True

    def _is_transient(self, exc: DBAPIError) -> bool:
        return _error_code(exc) in TRANSIENT_CODES

    def _db_now(self, conn: Connection) -> datetime:
        value = conn.execute(_UTC_NOW).scalar_one()
        assert isinstance(value, datetime)
        return value.replace(tzinfo=None)

    def now(self) -> datetime:
        with self.engine.connect() as conn:
            return self._db_now(conn)

    def _lease_expiry(self, conn: Connection, lease_seconds: float) -> datetime | None:
        return self._db_now(conn) + timedelta(seconds=lease_seconds)

    def _lock_term(self, conn: Connection, term: Term) -> None:
        self._bound(conn)
        row = read_lease(conn, term.supervisor_key, for_update=True)
        # Expiry is evaluated only now that the row lock is held (NOW(6) includes lock wait).
        validate(row, term, self._db_now(conn))

    def claim_term(self, key: str, holder_id: str, lease_seconds: float) -> Term | None:
        """Take the Lease if it is free or expired; takeover always increments generation.

        Refused (``ModeConflictError``) while a term of the other mode is live: a replica started
        in ``global`` beside running ``dedicated`` ones (or the reverse) would otherwise hold a
        second valid term over the same Scopes. An expired term of the other mode is no obstacle:
        its Workers fail their fenced check by expiry.
        """

        def body(conn: Connection) -> Term | None:
            self._bound(conn)
            if key != GLOBAL_KEY:
                read_lease(conn, GLOBAL_KEY, for_update=True)  # lock order: global row first
            row = read_lease(conn, key, for_update=True)
            now = self._db_now(conn)
            expires = now + timedelta(seconds=lease_seconds)
            free = row is None or (
                row.holder_id == INVALIDATED or row.expires_at is None or row.expires_at <= now
            )
            if not free:
                return None
            others = other_mode_keys(conn, key, for_update=True)
            refuse_mode_conflict(key, [r for r in others if is_live(r, now)])
            return take_lease(conn, key, holder_id, row, expires)

        try:
            return self.run(body)
        except IntegrityError:
            return None  # another candidate inserted the first Lease row concurrently

    def renew_term(self, term: Term, lease_seconds: float) -> bool:
        def body(conn: Connection) -> bool:
            self._bound(conn)
            row = read_lease(conn, term.supervisor_key, for_update=True)
            now = self._db_now(conn)
            try:
                validate(row, term, now)
            except Exception:
                return False
            conn.execute(
                update(leases)
                .where(leases.c.supervisor_key == term.supervisor_key)
                .values(expires_at=now + timedelta(seconds=lease_seconds))
            )
            return True

        return self.run(body)

    def release_term(self, term: Term) -> None:
        """Expire the Lease now so a standby can take over without waiting (no ABA: the next
        takeover increments generation)."""

        def body(conn: Connection) -> None:
            self._bound(conn)
            row = read_lease(conn, term.supervisor_key, for_update=True)
            if row is None or (row.holder_id, row.generation) != (term.holder_id, term.generation):
                return
            conn.execute(
                update(leases)
                .where(leases.c.supervisor_key == term.supervisor_key)
                .values(holder_id=INVALIDATED, expires_at=self._db_now(conn))
            )

        self.run(body)
