"""MySQL-mode backend (OceanBase in production): expiring Leases from database time, election,
renewal, and ``SELECT ... FOR UPDATE`` fencing inside every business and control write.

Dialect facts this module is built on (DESIGN §6, §7):
- READ COMMITTED is set explicitly (OceanBase's default; under REPEATABLE READ a FOR UPDATE on a
  row changed after the snapshot fails with 6235).
- ``NOW(6)`` is fixed at statement start, lock wait included, so expiry is read in a separate
  statement *after* the Lease row lock is held.
- 1205 (lock wait timeout) rolls back only the statement and 1213 (deadlock) the transaction:
  both are retried as a whole transaction, a bounded number of times. 2013 during COMMIT has an
  unknown outcome and is never blindly retried.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import Connection, create_engine, insert, text, update
from sqlalchemy.exc import DBAPIError, IntegrityError

from apsup.store.base import SqlBackend
from apsup.store.leases import INVALIDATED, Term, read_lease, validate
from apsup.store.schema import leases

TRANSIENT_CODES = frozenset({1205, 1213, 4012, 6002, 6005, 6213, 6235})


def _error_code(exc: DBAPIError) -> int | None:
    args = getattr(exc.orig, "args", ())
    if args and isinstance(args[0], int):
        return args[0]
    return None


class MysqlBackend(SqlBackend):
    name = "mysql"

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.engine = create_engine(
            url,
            isolation_level="READ COMMITTED",
            pool_pre_ping=True,
            pool_recycle=1800,
            pool_size=4,
            max_overflow=8,
        )
        self.read_engine = self.engine

    def _is_transient(self, exc: DBAPIError) -> bool:
        return _error_code(exc) in TRANSIENT_CODES

    def _db_now(self, conn: Connection) -> datetime:
        value = conn.execute(text("SELECT NOW(6)")).scalar_one()
        assert isinstance(value, datetime)
        return value.replace(tzinfo=None)

    def now(self) -> datetime:
        with self.engine.connect() as conn:
            return self._db_now(conn)

    def _lease_expiry(self, conn: Connection, lease_seconds: float) -> datetime | None:
        return self._db_now(conn) + timedelta(seconds=lease_seconds)

    def _lock_term(self, conn: Connection, term: Term) -> None:
        row = read_lease(conn, term.supervisor_key, for_update=True)
        # Expiry is evaluated only now that the row lock is held (NOW(6) includes lock wait).
        validate(row, term, self._db_now(conn))

    def claim_term(self, key: str, holder_id: str, lease_seconds: float) -> Term | None:
        """Take the Lease if it is free or expired; takeover always increments generation."""

        def body(conn: Connection) -> Term | None:
            row = read_lease(conn, key, for_update=True)
            now = self._db_now(conn)
            expires = now + timedelta(seconds=lease_seconds)
            if row is None:
                conn.execute(
                    insert(leases).values(
                        supervisor_key=key,
                        holder_id=holder_id,
                        supervisor_generation=1,
                        expires_at=expires,
                    )
                )
                return Term(key, holder_id, 1)
            free = row.holder_id == INVALIDATED or row.expires_at is None or row.expires_at <= now
            if not free:
                return None
            conn.execute(
                update(leases)
                .where(leases.c.supervisor_key == key)
                .values(
                    holder_id=holder_id,
                    supervisor_generation=row.generation + 1,
                    expires_at=expires,
                )
            )
            return Term(key, holder_id, row.generation + 1)

        try:
            return self.run(body)
        except IntegrityError:
            return None  # another candidate inserted the first Lease row concurrently

    def renew_term(self, term: Term, lease_seconds: float) -> bool:
        def body(conn: Connection) -> bool:
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
            row = read_lease(conn, term.supervisor_key, for_update=True)
            if row is None or (row.holder_id, row.generation) != (term.holder_id, term.generation):
                return
            conn.execute(
                update(leases)
                .where(leases.c.supervisor_key == term.supervisor_key)
                .values(holder_id=INVALIDATED, expires_at=self._db_now(conn))
            )

        self.run(body)
