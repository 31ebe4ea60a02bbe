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
- PyMySQL (1.2) tries TLS on every connection that names no TLS option, and builds a fresh
  ``ssl.create_default_context()`` for it: loading the system CA store costs ~65 ms of CPU per
  connection, more than the rest of a Worker's invocation. The same context is built once per
  process instead (``_PyMySQLConnection``), and the forkserver builds it while warming the engine,
  so Workers inherit it; the TLS behaviour (attempted, same settings) is unchanged.
- A control backend (the host's) bounds every call (``apsup.store.limits``): PyMySQL
  connect/read/write timeouts end a half-open connection, and ``ob_query_timeout`` (checked on
  seekdb: error 4012 for a slow statement, 1205 for a lock wait; ``max_execution_time`` is
  accepted there but not enforced) ends a slow statement on the server first.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection, Engine, create_engine, event, text, update
from sqlalchemy.engine import make_url
from sqlalchemy.engine.default import DefaultDialect
from sqlalchemy.exc import DBAPIError, DisconnectionError, IntegrityError

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
from apsup.store.limits import DbLimits, parse_limits, strip_limits
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


_tls_lock = threading.Lock()
_preferred_tls: Any = None  # PyMySQL's context for "TLS if the server offers it", once per process


def _connection_class() -> Any:
    """PyMySQL's ``Connection`` with its default TLS context cached per process (see above).

    Only the context PyMySQL builds when the URL names no TLS option is shared; explicit TLS
    options (``ssl_ca``...) keep a context of their own per connection, exactly as before.
    """
    from pymysql.connections import Connection

    if not hasattr(Connection, "_create_ssl_ctx"):  # another PyMySQL: keep its own behaviour
        return Connection

    class _PyMySQLConnection(Connection):  # type: ignore[misc]
        def _create_ssl_ctx(self, sslp: Any) -> Any:
            global _preferred_tls
            if not (isinstance(sslp, dict) and not sslp):
                return super()._create_ssl_ctx(sslp)
            with _tls_lock:
                if _preferred_tls is None:
                    _preferred_tls = super()._create_ssl_ctx({})
                return _preferred_tls

    return _PyMySQLConnection


_TXN_OPEN = "apsup_txn_open"
_RETURNED_AT = "apsup_returned_at"
#: A pooled connection used again within this many seconds is not pinged before use.
PING_AFTER_IDLE_SECONDS = 1.0


def _ping_when_idle(engine: Engine) -> None:
    """SQLAlchemy's ``pool_pre_ping``, but only for connections idle for a while.

    A pre-ping on every checkout is one more round trip per transaction, paid above all where
    it protects nothing: a Worker's connection is seconds old, and the host reuses its
    connections many times a second while it dispatches. A connection idle for longer than
    ``PING_AFTER_IDLE_SECONDS`` (the server may have restarted, a proxy may have dropped it) is
    pinged as before; a dead one is replaced before use (``DisconnectionError``, the pool's
    documented way to retry the checkout with a fresh connection).
    """

    def checkin(dbapi_conn: Any, rec: Any) -> None:
        if rec is not None:
            rec.info[_RETURNED_AT] = time.monotonic()

    def checkout(dbapi_conn: Any, rec: Any, proxy: Any) -> None:
        returned = rec.info.get(_RETURNED_AT)
        if returned is None or time.monotonic() - returned < PING_AFTER_IDLE_SECONDS:
            return  # a fresh connection, or one in use a moment ago
        try:
            dbapi_conn.ping(reconnect=False)
        except Exception as exc:
            raise DisconnectionError("pooled connection failed its ping") from exc

    event.listen(engine.pool, "checkin", checkin)
    event.listen(engine.pool, "checkout", checkout)


def _skip_needless_reset(engine: Engine) -> None:
    """Roll a returned connection back only when a transaction may still be open on it.

    The pool's default reset sends a ROLLBACK on every return, even right after the COMMIT that
    ended the transaction: one wasted round trip per transaction (two per Worker invocation).
    SQLAlchemy's own transaction events say whether this connection's last transaction ended;
    anything else (a new checkout not yet used through a ``Connection``, ``raw_connection()``
    users, an error) counts as possibly open and is rolled back as before. The server's
    in-transaction status flag cannot be used instead: OceanBase does not set it for a
    ``SELECT ... FOR UPDATE`` that holds a row lock.
    """

    def mark(conn: Connection | None, value: bool) -> None:
        if conn is None or conn.invalidated:
            return  # an invalidated connection is discarded by the pool, never reset
        # A connection on its way to invalidation refuses ``info``: never mask the real error.
        with contextlib.suppress(Exception):
            conn.info[_TXN_OPEN] = value

    def opened(conn: Connection, *args: Any) -> None:
        mark(conn, True)

    def ended(conn: Connection, *args: Any) -> None:
        mark(conn, False)

    def checkout(dbapi_conn: Any, rec: Any, proxy: Any) -> None:
        rec.info[_TXN_OPEN] = True

    def errored(ctx: Any) -> None:
        mark(ctx.connection, True)

    def reset(dbapi_conn: Any, rec: Any, state: Any) -> None:
        if state.transaction_was_reset or not state.asyncio_safe:
            return  # already rolled back inline / no IO allowed (the pool discards it)
        if rec.info.get(_TXN_OPEN, True):
            dbapi_conn.rollback()

    event.listen(engine, "begin", opened)
    event.listen(engine, "commit", ended)
    event.listen(engine, "rollback", ended)
    event.listen(engine, "handle_error", errored)
    event.listen(engine.pool, "checkout", checkout)
    event.listen(engine.pool, "reset", reset)


def _statement_limits(oceanbase: bool, seconds: float) -> list[str]:
    """Session settings that make the server end a statement (lock waits included)."""
    if oceanbase:
        return [f"SET ob_query_timeout = {max(1, int(seconds * 1_000_000))}"]
    return [
        f"SET SESSION max_execution_time = {max(1, int(seconds * 1000))}",
        f"SET SESSION innodb_lock_wait_timeout = {max(1, math.ceil(seconds))}",
    ]


class MysqlBackend(SqlBackend):
    name = "mysql"

    def __init__(self, url: str, *, control: bool = False) -> None:
        super().__init__(url)
        u = make_url(url)
        limits = parse_limits(u)
        self.limits: DbLimits | None = limits if control else None
        connect_args: dict[str, Any] = {}
        if control:
            connect_args = {
                "connect_timeout": limits.connect_timeout,
                "read_timeout": limits.read_timeout,
                "write_timeout": limits.read_timeout,
            }
            self.retry_budget = limits.read_timeout
        raw = u.query.get(FENCE_TIMEOUT_PARAM)
        try:
            self.fence_timeout = FENCE_TIMEOUT_SECONDS if raw is None else float(str(raw))
        except ValueError:
            raise ConfigError(
                f"database URL parameter {FENCE_TIMEOUT_PARAM} must be a number of seconds"
            ) from None
        engine_url = strip_limits(u.difference_update_query([FENCE_TIMEOUT_PARAM]))
        pymysql = engine_url.get_driver_name() == "pymysql"
        self.engine = create_engine(
            engine_url,
            connect_args=connect_args,
            isolation_level="READ COMMITTED",
            pool_pre_ping=not pymysql,
            pool_recycle=1800,
            pool_size=4,
            max_overflow=8,
            pool_reset_on_return=None,  # ``_skip_needless_reset``: only when a txn may be open
        )
        self.read_engine = self.engine
        #: Whether the server is OceanBase: asked once per backend (a forked Worker inherits the
        #: answer from the forkserver's warm-up instead of asking on its own connection).
        self._oceanbase: bool | None = None
        self._instrument(self.engine, control, limits)
        _skip_needless_reset(self.engine)
        if pymysql:
            _ping_when_idle(self.engine)
        if control:
            # The host's reads (request pages, dispatch and exit reads, the clock, the idle
            # poll) run in autocommit: under READ COMMITTED every statement sees the latest
            # commits anyway, and a read costs one statement instead of three (statement,
            # COMMIT, the pool's ROLLBACK on return).
            read_options: dict[str, Any] = {}
            if "skip_autocommit_rollback" in inspect.signature(DefaultDialect.__init__).parameters:
                read_options["skip_autocommit_rollback"] = True
            self.read_engine = create_engine(
                engine_url,
                connect_args=connect_args,
                isolation_level="AUTOCOMMIT",
                pool_pre_ping=not pymysql,
                pool_recycle=1800,
                pool_size=2,
                max_overflow=4,
                **read_options,
            )
            self._instrument(self.read_engine, control, limits)
            if pymysql:
                _ping_when_idle(self.read_engine)

    def _instrument(self, engine: Engine, control: bool, limits: DbLimits) -> None:
        pymysql_class = _connection_class() if engine.dialect.driver == "pymysql" else None

        @event.listens_for(engine, "do_connect")
        def _connect(dialect: Any, rec: Any, cargs: Any, cparams: Any) -> Any:
            if control:
                # PyMySQL reads the server's greeting under read_timeout: bound the whole
                # handshake by connect_timeout instead, then restore the statement bound (a
                # private attribute: PyMySQL has no public setter).
                cparams["read_timeout"] = limits.connect_timeout
            factory = pymysql_class or dialect.loaded_dbapi.connect
            conn = factory(*cargs, **cparams)
            if control:
                conn._read_timeout = limits.read_timeout
            return conn

        @event.listens_for(engine, "connect")
        def _on_connect(dbapi_conn: Any, rec: Any) -> None:
            # PyMySQL reports "5.7.25" as the server version; VERSION() names OceanBase.
            cur = dbapi_conn.cursor()
            asked = False
            try:
                cur.execute("SET time_zone = '+00:00'")  # database time is naive UTC
                if self._oceanbase is None:
                    asked = True
                    cur.execute("SELECT VERSION()")
                    row = cur.fetchone()
                    self._oceanbase = bool(row) and "oceanbase" in str(row[0]).lower()
                rec.info["apsup_oceanbase"] = self._oceanbase
                query_timeout = self.limits.query_timeout if self.limits else 0
                if query_timeout > 0:
                    for statement in _statement_limits(self._oceanbase, query_timeout):
                        cur.execute(statement)
            finally:
                cur.close()
                if asked:  # a SELECT may open an implicit transaction; SET never does
                    dbapi_conn.rollback()

        @event.listens_for(engine, "handle_error")
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

    def read(self) -> AbstractContextManager[Connection]:
        if self.read_engine is self.engine:
            return super().read()
        return self._autocommit_read()

    @contextmanager
    def _autocommit_read(self) -> Iterator[Connection]:
        """A read on the autocommit engine: no BEGIN, no COMMIT, no ROLLBACK on return."""
        with self.read_engine.connect() as conn:
            try:
                yield conn
            except DBAPIError:
                if not conn.invalidated:
                    conn.invalidate()
                raise

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
        with self.read() as conn:
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
