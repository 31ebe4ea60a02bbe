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
  ``ssl.create_default_context()`` for it: loading the system CA store costs more CPU per
  connection than the rest of a Worker's invocation. The same context is built once per
  process instead (``_PyMySQLConnection``), and the forkserver builds it while warming the engine,
  so Workers inherit it; the TLS behaviour (attempted, same settings) is unchanged.
- A new PyMySQL session is set up by one statement: the ``SET NAMES`` PyMySQL sends at connect
  also carries the time zone, READ COMMITTED, autocommit off (on for the host's read engine),
  the control backend's statement limits and, in a Worker, ``ob_trx_timeout``; SQLAlchemy's own
  repeat of ``SET NAMES`` is skipped. Six commands per new session before, one now.
- The Worker wrapper's duplicate check and fenced acknowledgment, and the host's point read of
  an intent row, run on the pooled PyMySQL connection with the Core path's statements, fence
  and errors (``read_intent``, ``handled_generation``, ``acknowledge_fenced``): a Worker sends
  five SQL commands per invocation (thirteen through SQLAlchemy Core). OceanBase opens no
  transaction for a plain read under READ COMMITTED, so the duplicate check needs no COMMIT.
- A control backend (the host's) bounds every call (``apsup.store.limits``): PyMySQL
  connect/read/write timeouts end a half-open connection, and ``ob_query_timeout`` (checked on
  seekdb: error 4012 for a slow statement, 1205 for a lock wait; ``max_execution_time`` is
  accepted there but not enforced) ends a slow statement on the server first.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import re
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from datetime import datetime
from typing import Any, cast

from sqlalchemy import Connection, Engine, create_engine, event, literal_column, text
from sqlalchemy.engine import make_url
from sqlalchemy.engine.default import DefaultDialect
from sqlalchemy.exc import DBAPIError, DisconnectionError

from apsup.errors import (
    DeadlinePassed,
    FencedTransactionTimeout,
    ForeignLock,
    IntentError,
    StaleTermError,
)
from apsup.store.base import AckResult, ExitAck, ReadRows, Reads
from apsup.store.elected import (
    FENCE_TIMEOUT_PARAM,
    ElectedBackend,
    fence_timeout,
)
from apsup.store.intents import Intent, check_unmoved_acknowledgment
from apsup.store.leases import (
    LeaseRow,
    Term,
    validate,
)
from apsup.store.limits import DbLimits, parse_limits, strip_limits
from apsup.store.schema import intents, leases

#: Errors after which the server has rolled back the whole transaction (not just a statement).
TRANSACTION_ABORT_CODES = frozenset({1213, 4012, 6002})
TRANSIENT_CODES = frozenset({1205, 1213, 4012, 6002, 6005, 6213, 6235})
#: OceanBase ends a transaction past ``ob_trx_timeout``: the next statement fails with 4012
#: ("Transaction timeout occurred"), the COMMIT with 6002 ("Transaction rollbacked").
TRX_TIMEOUT = 4012
TRX_ROLLED_BACK = 6002
#: Database time in UTC whatever the server's or the session's time zone (naive, microseconds).
_UTC_NOW = text("SELECT UTC_TIMESTAMP(6)")
#: The Worker wrapper's statements on the DBAPI connection: the same conditions as
#: ``intents.get``, ``leases.read_lease(for_update=True)`` and ``intents.acknowledge``. Set to
#: False to compare with the SQLAlchemy Core path (a benchmark switch).
DBAPI_PATH = True
_INTENT_SQL = (
    "SELECT binding_name, scope_id, pending_sequence, dirty_generation, clean_generation,"
    " requested_generation, handled_generation, last_auto_scan_generation"
    f" FROM {intents.name} WHERE binding_name = %s AND scope_id = %s"
)
_HANDLED_SQL = (
    f"SELECT handled_generation FROM {intents.name} WHERE binding_name = %s AND scope_id = %s"
)
_ROW_SQL = (
    f"SELECT handled_generation, requested_generation, pending_sequence FROM {intents.name}"
    " WHERE binding_name = %s AND scope_id = %s"
)
_LEASE_LOCK_SQL = (
    f"SELECT holder_id, supervisor_generation, expires_at FROM {leases.name}"
    " WHERE supervisor_key = %s FOR UPDATE"
)
_ACK_SQL = (
    f"UPDATE {intents.name} SET handled_generation = %s WHERE binding_name = %s AND scope_id = %s"
    " AND handled_generation < %s AND requested_generation >= %s AND pending_sequence = %s"
)
#: The same acknowledgment, also reporting the row's requested generation in the OK packet
#: (``LAST_INSERT_ID(expr)`` sets the session's insert id; the column keeps its value, read
#: under the row lock this UPDATE holds): the Supervisor classifies the exit without a read.
_ACK_REPORTING_SQL = _ACK_SQL.replace(
    "SET handled_generation = %s",
    "SET handled_generation = %s, requested_generation = LAST_INSERT_ID(requested_generation)",
)
#: The acknowledgment in a multi-statement batch: fenced in the statement itself, by the Lease
#: row this transaction has locked (holder, generation, and unexpired on database time at this
#: statement's start, after the lock).
_FENCED_ACK_SQL = _ACK_REPORTING_SQL + (
    f" AND EXISTS (SELECT 1 FROM {leases.name} WHERE supervisor_key = %s AND holder_id = %s"
    " AND supervisor_generation = %s AND (expires_at IS NULL OR expires_at > UTC_TIMESTAMP(6)))"
)
_UNMOVED = object()
#: Appended for an expiring Lease: still unexpired at this statement's start (after the lock).
_UNEXPIRED = " AND CAST(%s AS DATETIME(6)) > UTC_TIMESTAMP(6)"


def _intents_sql(count: int) -> str:
    """``_INTENT_SQL`` for ``count`` Scope ids of one binding."""
    if count == 1:
        return _INTENT_SQL
    return _INTENT_SQL.replace("scope_id = %s", f"scope_id IN ({', '.join(['%s'] * count)})")


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _intent_rows(rows: Sequence[Sequence[Any]]) -> dict[str, Intent]:
    """``_INTENT_SQL``'s rows (PyMySQL, binary columns) by Scope id."""
    return {
        row[1].decode(): Intent(row[0].decode(), row[1].decode(), *map(int, row[2:]))
        for row in rows
    }


def _error_code(exc: DBAPIError) -> int | None:
    args = getattr(exc.orig, "args", ())
    if args and isinstance(args[0], int):
        return args[0]
    return None


_NAMES_SENT = "_apsup_names_sent"
#: Set on a PyMySQL connection whose timeouts were cut to a leader's deadline.
_CUT = "_apsup_deadline_cut"
_SESSION_SQL = "_apsup_session_sql"
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

        def set_character_set(self, charset: str, collation: str | None = None) -> None:
            # PyMySQL's connect() sends ``SET NAMES`` right after authenticating. With apsup's
            # session setup pending (``_SESSION_SQL``, left by ``_open``), both travel in one
            # statement; its OK packet also tells PyMySQL that autocommit is already as wanted.
            session = self.__dict__.pop(_SESSION_SQL, None)
            if session is None or collation:
                return super().set_character_set(charset, collation)  # type: ignore[no-any-return]
            from pymysql.charset import charset_by_name
            from pymysql.constants import COMMAND

            encoding = charset_by_name(charset).encoding
            self._execute_command(COMMAND.COM_QUERY, f"SET NAMES {charset}, {session}")
            self._read_ok_packet()
            self.charset, self.encoding, self.collation = charset, encoding, collation
            return None

        def character_set_name(self) -> Any:
            # SQLAlchemy's connect hook (the first to ask on a new connection) re-sends
            # ``SET NAMES <this>``, which PyMySQL has just sent: None skips that round trip.
            # Asked again (dialect initialisation, later callers), the name is given as usual.
            if self.__dict__.pop(_NAMES_SENT, False):
                return None
            return super().character_set_name()

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


def _limit_settings(oceanbase: bool, seconds: float) -> list[str]:
    """Session settings that make the server end a statement (lock waits included)."""
    if oceanbase:
        return [f"ob_query_timeout = {max(1, int(seconds * 1_000_000))}"]
    return [
        f"SESSION max_execution_time = {max(1, int(seconds * 1000))}",
        f"SESSION innodb_lock_wait_timeout = {max(1, math.ceil(seconds))}",
    ]


def _statement_limits(oceanbase: bool, seconds: float) -> list[str]:
    return [f"SET {setting}" for setting in _limit_settings(oceanbase, seconds)]


def _isolation_variable(version: str) -> str:
    """The session variable that holds the isolation level on this server: MySQL renamed
    ``tx_isolation`` to ``transaction_isolation`` in 5.7.20 and dropped the old name in 8.0;
    OceanBase knows both, MariaDB only the old one (before 11.1)."""
    lowered = version.lower()
    if "oceanbase" in lowered:
        return "transaction_isolation"
    numbers = re.match(r"(\d+)\.(\d+)\.(\d+)", version)
    if "mariadb" in lowered or numbers is None:
        return "tx_isolation"
    new_name = tuple(map(int, numbers.groups())) >= (5, 7, 20)
    return "transaction_isolation" if new_name else "tx_isolation"


class MysqlBackend(ElectedBackend):
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
        self.fence_timeout = fence_timeout(u)
        engine_url = strip_limits(u.difference_update_query([FENCE_TIMEOUT_PARAM]))
        pymysql = engine_url.get_driver_name() == "pymysql"
        #: PyMySQL: each session is set up by one statement sent at connect (``_session_settings``)
        #: instead of SQLAlchemy's and our own separate ones; unless the URL brings its own
        #: ``init_command`` (then sessions are set up as before, statement by statement).
        self._session_init = pymysql and "init_command" not in engine_url.query
        isolation: dict[str, Any] = {}
        if not self._session_init:
            isolation["isolation_level"] = "READ COMMITTED"
        #: Whether the server is OceanBase: asked once per backend (a forked Worker inherits the
        #: answer from the forkserver's warm-up instead of asking on its own connection).
        self._oceanbase: bool | None = None
        self._isolation_var = "transaction_isolation"
        #: Bound every new session's transactions at connect (``ob_trx_timeout``), not before
        #: its first fenced transaction: set once this backend serves a Worker invocation,
        #: whose session runs a fenced acknowledgment anyway (``handled_generation``).
        self._bound_at_connect = False
        #: The host's write sessions accept multi-statement queries: a batch of acknowledgments
        #: (Lease lock, UPDATEs, COMMIT) is one round trip (``acknowledge_exits``). Only the
        #: host's own statements run on them; Workers' sessions (processors' SQL) never do.
        self._multi_statements = control and pymysql
        write_args = dict(connect_args)
        if self._multi_statements:
            from pymysql.constants import CLIENT

            write_args["client_flag"] = CLIENT.MULTI_STATEMENTS
        self.engine = create_engine(
            engine_url,
            connect_args=write_args,
            **isolation,
            pool_pre_ping=not pymysql,
            pool_recycle=1800,
            pool_size=4,
            max_overflow=8,
            pool_reset_on_return=None,  # ``_skip_needless_reset``: only when a txn may be open
        )
        self.read_engine = self.engine
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
            self._instrument(self.read_engine, control, limits, autocommit=True)
            if pymysql:
                _ping_when_idle(self.read_engine)

    def _instrument(
        self, engine: Engine, control: bool, limits: DbLimits, *, autocommit: bool = False
    ) -> None:
        pymysql_class = _connection_class() if engine.dialect.driver == "pymysql" else None
        session_init = pymysql_class is not None and self._session_init

        @event.listens_for(engine, "do_connect")
        def _connect(dialect: Any, rec: Any, cargs: Any, cparams: Any) -> Any:
            if control:
                # PyMySQL reads the server's greeting under read_timeout: bound the whole
                # handshake by connect_timeout instead, then restore the statement bound (a
                # private attribute: PyMySQL has no public setter). A leader's connect also
                # ends by its renew deadline.
                left = self.time_left()
                bound = limits.connect_timeout
                if left is not None:
                    bound = min(bound, left)
                cparams["read_timeout"] = bound
                cparams["connect_timeout"] = bound
            if not session_init or pymysql_class is None:
                factory = pymysql_class or dialect.loaded_dbapi.connect
                conn = factory(*cargs, **cparams)
                if control:
                    conn._read_timeout = limits.read_timeout
                return conn
            cparams["autocommit"] = autocommit
            # The server is known from this backend's first connection (a Worker inherits it):
            # the whole session setup then travels with the SET NAMES PyMySQL sends at connect
            # (``set_character_set``), and with autocommit already as PyMySQL wants it, the
            # driver sends nothing more.
            known = self._oceanbase is not None
            conn = pymysql_class(*cargs, **dict(cparams, defer_connect=True))
            try:
                if known:
                    setattr(conn, _SESSION_SQL, self._session_settings(autocommit, rec.info))
                conn.connect()
                if control:
                    conn._read_timeout = limits.read_timeout
                setattr(conn, _NAMES_SENT, True)  # ``character_set_name``
                cur = conn.cursor()
                try:
                    if not known:  # this backend's first connection: which server is this?
                        cur.execute("SELECT VERSION()")
                        row = cur.fetchone()
                        self._learn_server(str(row[0]) if row else "")
                        conn.rollback()  # a SELECT may open an implicit transaction
                        setattr(conn, _SESSION_SQL, self._session_settings(autocommit, rec.info))
                    pending = conn.__dict__.pop(_SESSION_SQL, None)
                    if pending is not None:  # not sent with SET NAMES: on its own
                        cur.execute(f"SET {pending}")
                finally:
                    cur.close()
            except BaseException:
                if conn.open:
                    conn.close()
                raise
            rec.info["apsup_oceanbase"] = self._oceanbase
            return conn

        if control:
            # A leader's calls end by its renew deadline (``SqlBackend.call_deadline``): every
            # checkout and statement cuts PyMySQL's read/write timeouts to the time left, so a
            # call into a black hole returns when the term can no longer act, not later.
            @event.listens_for(engine, "checkout")
            def _bound_checkout(dbapi_conn: Any, rec: Any, proxy: Any) -> None:
                self._cut_timeouts(dbapi_conn, limits, strict=False)

            @event.listens_for(engine, "before_cursor_execute")
            def _bound_statement(
                conn: Any, cursor: Any, statement: Any, params: Any, ctx: Any, many: Any
            ) -> None:
                self._cut_timeouts(getattr(cursor, "connection", None), limits, strict=True)

        @event.listens_for(engine, "connect")
        def _on_connect(dbapi_conn: Any, rec: Any) -> None:
            if session_init:
                return  # set up at connect (``_connect``)
            # PyMySQL reports "5.7.25" as the server version; VERSION() names OceanBase.
            cur = dbapi_conn.cursor()
            asked = False
            try:
                cur.execute("SET time_zone = '+00:00'")  # database time is naive UTC
                if self._oceanbase is None:
                    asked = True
                    cur.execute("SELECT VERSION()")
                    row = cur.fetchone()
                    self._learn_server(str(row[0]) if row else "")
                rec.info["apsup_oceanbase"] = self._oceanbase
                query_timeout = self.limits.query_timeout if self.limits else 0
                if query_timeout > 0:
                    for statement in _statement_limits(bool(self._oceanbase), query_timeout):
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

    def _cut_timeouts(self, dbapi_conn: Any, limits: DbLimits, *, strict: bool) -> None:
        """Set PyMySQL's per-read/write timeouts to the time left before ``call_deadline`` (the
        configured limit when none is set). ``strict``: raise ``DeadlinePassed`` when no time is
        left (before a statement; a checkout only shortens the bound)."""
        if dbapi_conn is None or not hasattr(dbapi_conn, "_read_timeout"):
            return
        deadline = self.call_deadline
        if deadline is None:
            if dbapi_conn.__dict__.pop(_CUT, False):
                dbapi_conn._read_timeout = limits.read_timeout
                dbapi_conn._write_timeout = limits.read_timeout
            return
        left = deadline - time.monotonic()
        if left <= 0:
            if strict:
                raise DeadlinePassed("mysql: the leader's renew deadline passed; not calling")
            left = 0.001
        bound = min(limits.read_timeout, left)
        dbapi_conn._read_timeout = bound
        dbapi_conn._write_timeout = bound
        setattr(dbapi_conn, _CUT, True)

    def dispose(self) -> None:
        """Close the pooled connections of both engines (each with a goodbye to the server).

        The pools are kept, as ``warm.py`` does: ``engine.dispose()`` would also build a new
        pool, CPU spent in a Worker about to exit, and make the next connection of a
        backend still in use initialise the dialect again. Connections checked out right now
        are not closed, as with ``engine.dispose()``."""
        self.engine.pool.dispose()
        if self.read_engine is not self.engine:
            self.read_engine.pool.dispose()

    def _learn_server(self, version: str) -> None:
        self._oceanbase = "oceanbase" in version.lower()
        self._isolation_var = _isolation_variable(version)

    def _session_settings(self, autocommit: bool, info: dict[str, Any]) -> str:
        """The settings of the one ``SET`` that prepares a new session: UTC session time, READ
        COMMITTED and autocommit off (autocommit on for the host's read engine), the control
        backend's statement limits, and for a Worker the bound of its fenced transactions."""
        settings = ["time_zone = '+00:00'"]  # database time is naive UTC
        if autocommit:
            settings.append("autocommit = 1")
        else:
            settings += [f"{self._isolation_var} = 'READ-COMMITTED'", "autocommit = 0"]
        query_timeout = self.limits.query_timeout if self.limits else 0
        if query_timeout > 0:
            settings += _limit_settings(bool(self._oceanbase), query_timeout)
        if self._bound_at_connect and self._oceanbase and self.fence_timeout > 0 and not autocommit:
            settings.append(f"ob_trx_timeout = {int(self.fence_timeout * 1_000_000)}")
            info["apsup_bounded"] = True
        return ", ".join(settings)

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
        info = conn.connection.info
        bound = self._unbounded(info)
        if bound is not None:
            conn.exec_driver_sql(bound)
            info["apsup_bounded"] = True

    def _unbounded(self, info: dict[str, Any]) -> str | None:
        """The ``SET`` that bounds this session's transactions, if it still needs one."""
        if self.fence_timeout <= 0 or not info.get("apsup_oceanbase") or info.get("apsup_bounded"):
            return None
        return f"SET ob_trx_timeout = {int(self.fence_timeout * 1_000_000)}"

    def fence_error(self, exc: DBAPIError) -> BaseException:
        code = _error_code(exc)
        expired = code == TRX_ROLLED_BACK or (
            code == TRX_TIMEOUT and "transaction timeout" in str(exc.orig).lower()
        )
        if not expired or self.fence_timeout <= 0:
            return exc
        return FencedTransactionTimeout(
            f"the fenced transaction stayed open longer than its bound of {self.fence_timeout:g} "
            "s and the database rolled it back (nothing of it committed); the bound keeps the "
            "leader's Lease renewable: compute outside ctx.fenced(), write inside it"
        )

    def _is_transient(self, exc: DBAPIError) -> bool:
        return _error_code(exc) in TRANSIENT_CODES

    def _db_now(self, conn: Connection) -> datetime:
        value = conn.execute(_UTC_NOW).scalar_one()
        assert isinstance(value, datetime)
        return value.replace(tzinfo=None)

    def db_time_sql(self) -> Any:
        return literal_column("UTC_TIMESTAMP(6)")

    # -- the Worker wrapper's duplicate check and acknowledgment: PyMySQL on the pooled
    # connection, no SQLAlchemy Core ------------------------------------------------------
    # In a freshly forked Worker, SQLAlchemy's per-transaction machinery (connection wrapper,
    # events, result objects, the compiled-statement cache) runs on copy-on-write pages; the
    # same statements on the DBAPI connection cost a fraction of it. Same connection (from the
    # same pool, so a processor's own ``ctx.fenced()`` reuses it), same fence: the Lease row is
    # locked FOR UPDATE, holder and generation are checked, and expiry is judged on database
    # time evaluated after the lock is held: inside the acknowledging UPDATE itself, whose
    # ``UTC_TIMESTAMP(6)`` is fixed when that statement starts, i.e. after the locking SELECT
    # returned (one round trip fewer than a separate ``SELECT UTC_TIMESTAMP(6)``).
    def _dbapi_path(self) -> bool:
        return self._session_init and DBAPI_PATH

    @contextmanager
    def _dbapi(self) -> Iterator[tuple[Any, dict[str, Any]]]:
        """The pooled PyMySQL connection and its record's ``info``. The body ends its own
        transaction; after a driver error the connection is discarded (its transaction state is
        unknown: 1213 rolled back everything, 1205 only the statement), after any other error
        it is rolled back, and the error is raised as SQLAlchemy would wrap it (``DBAPIError``,
        parameters hidden), so callers and the retry loop see the same exceptions."""
        from pymysql.err import Error as DriverError

        self.time_left()  # a leader past its renew deadline calls nothing (raises)
        fairy = self.engine.raw_connection()
        dbapi_conn: Any = fairy.driver_connection
        try:
            yield dbapi_conn, fairy.info
            fairy.info[_TXN_OPEN] = False  # ended here: the pool needs no ROLLBACK
        except DriverError as exc:
            fairy.invalidate(exc)
            raise self._wrapped(exc) from exc
        except BaseException as exc:
            try:
                dbapi_conn.rollback()
                fairy.info[_TXN_OPEN] = False
            except Exception:
                fairy.invalidate(exc)
            raise
        finally:
            fairy.close()

    def read_intent(self, binding: str, scope_id: str) -> Intent | None:
        # The host's dispatch read and exit classification: one statement on the autocommit
        # read engine's PyMySQL connection is one snapshot, like the Core read, without
        # SQLAlchemy's result machinery. Time limits are the session's.
        if not self._dbapi_path() or self.read_engine is self.engine:
            return super().read_intent(binding, scope_id)
        return self._read_rows(binding, [scope_id]).get(scope_id)

    def read_intents(self, binding: str, scope_ids: Sequence[str]) -> dict[str, Intent]:
        if not self._dbapi_path() or self.read_engine is self.engine:
            return super().read_intents(binding, scope_ids)
        return self._read_rows(binding, scope_ids) if scope_ids else {}

    def _read_rows(self, binding: str, scope_ids: Sequence[str]) -> dict[str, Intent]:
        """One statement (one snapshot, one round trip) for the rows of ``scope_ids``."""
        from pymysql.err import Error as DriverError

        self.time_left()  # a leader past its renew deadline calls nothing (raises)
        statement = _intents_sql(len(scope_ids))
        fairy = self.read_engine.raw_connection()
        try:
            cur = fairy.driver_connection.cursor()  # type: ignore[union-attr]
            cur.execute(statement, (binding.encode(), *(s.encode() for s in scope_ids)))
            rows = cur.fetchall()
            cur.close()
        except DriverError as exc:
            fairy.invalidate(exc)  # the session's state is unknown after a failed statement
            raise self._wrapped(exc) from exc
        except BaseException as exc:
            fairy.invalidate(exc)
            raise
        finally:
            fairy.close()
        return _intent_rows(rows)

    def _wrapped(self, exc: Exception) -> BaseException:
        """A PyMySQL error as SQLAlchemy raises it (a ``DBAPIError`` subclass; parameters
        hidden: they hold Scope ids)."""
        from pymysql.err import Error as DriverError

        return DBAPIError.instance(
            None, None, exc, DriverError, hide_parameters=True, dialect=self.engine.dialect
        )

    def handled_generation(self, binding: str, scope_id: str) -> int:
        if not self._dbapi_path():
            return super().handled_generation(binding, scope_id)
        # A Worker invocation: its session will lock the Lease row (acknowledgment, a
        # processor's ``ctx.fenced()``), so bound it at connect, not in a statement of its own.
        self._bound_at_connect = True
        with self._dbapi() as (dbapi_conn, info):
            cur = dbapi_conn.cursor()
            cur.execute(_HANDLED_SQL, (binding.encode(), scope_id.encode()))
            row = cur.fetchone()
            if not info.get("apsup_oceanbase"):
                # MySQL opens a transaction for this read (and keeps a metadata lock until it
                # ends): end it before the processor runs. OceanBase opens none for a plain
                # read under READ COMMITTED (its session shows no transaction until the first
                # locking statement), so there is nothing to end and no round trip to spend.
                dbapi_conn.commit()
        return 0 if row is None else int(row[0])

    def acknowledge_fenced(
        self, term: Term, binding: str, scope_id: str, generation: int, pending_sequence: int
    ) -> bool:
        if not self._dbapi_path():
            return super().acknowledge_fenced(term, binding, scope_id, generation, pending_sequence)
        moved, _ = self._acknowledge(term, binding, scope_id, generation, pending_sequence, False)
        return moved

    def acknowledge_exits(self, term: Term, exits: Sequence[ExitAck]) -> list[AckResult]:
        return self.acknowledge_exits_and_read(term, exits, ())[0]

    def acknowledge_exits_and_read(
        self, term: Term, exits: Sequence[ExitAck], reads: Reads
    ) -> tuple[list[AckResult], ReadRows]:
        if not (self._dbapi_path() and self._multi_statements):
            return super().acknowledge_exits_and_read(term, exits, reads)
        results, rows = self._retrying(lambda: self._acknowledge_batch(term, exits, reads))
        for i, result in enumerate(results):
            if result is not _UNMOVED:
                continue
            # Not moved in the batch (already handled, the row gone, the Lease run out at that
            # statement): decided one by one on the path that checks each reason in turn.
            e = exits[i]
            try:
                moved, requested = self._acknowledge(
                    term, e.binding, e.scope_id, e.generation, e.pending_sequence, True
                )
                results[i] = requested if moved else None
            except (IntentError, StaleTermError, ForeignLock) as exc:
                results[i] = exc
        return cast(list[AckResult], results), rows

    def _acknowledge_batch(
        self, term: Term, exits: Sequence[ExitAck], reads: Reads
    ) -> tuple[list[object], ReadRows]:
        """One round trip: lock the Lease row FOR UPDATE, one acknowledging UPDATE per exit,
        one SELECT per binding of ``reads``, COMMIT (a multi-statement query on the host's
        connection). Each UPDATE carries the fence itself (the Lease row, already locked by
        this transaction, still names ``term`` and is unexpired at that statement's start), so
        nothing is written under a stale term though the client checks the locked row only
        after the COMMIT. Per exit: the requested generation its UPDATE reported, or
        ``_UNMOVED``; and the rows read (those of an exit's own key left out: an unmoved exit
        is decided again after this). StaleTermError if the locked row is not ``term``'s
        (nothing was written)."""
        lease_key = term.supervisor_key.encode()
        fence = (lease_key, term.holder_id.encode(), term.generation)
        own = {(e.binding, e.scope_id) for e in exits}
        wanted = [(b, [s for s in ids if (b, s) not in own]) for b, ids in reads]
        wanted = [(b, ids) for b, ids in wanted if ids]
        with self._dbapi() as (dbapi_conn, info):
            cur = dbapi_conn.cursor()
            parts = [_LEASE_LOCK_SQL]
            params: list[bytes | int] = [lease_key]
            bound = self._unbounded(info)
            if bound is not None:
                parts.insert(0, bound)
            # Never wait on a row another transaction holds (an application's open request for
            # the same Scope): lock the exits' rows SKIP LOCKED first; one that exists but was
            # not locked is deferred (the Supervisor retries it; its key stays occupied).
            held, present = self._lock_rows(cur, exits, parts, params, bound is not None)
            if bound is not None:
                info["apsup_bounded"] = True
            found = held.pop(None)
            deferred = {k for k in present if k not in held}
            parts, params = [], []
            for e in exits:
                if (e.binding, e.scope_id) in deferred:
                    continue
                parts.append(_FENCED_ACK_SQL)
                g = e.generation
                params += [g, e.binding.encode(), e.scope_id.encode(), g, g, e.pending_sequence]
                params += fence
            for binding, scope_ids in wanted:
                parts.append(_intents_sql(len(scope_ids)))
                params += [binding.encode(), *(s.encode() for s in scope_ids)]
            parts.append("COMMIT")
            cur.execute("; ".join(parts), params)
            results: list[object] = []
            first = True
            for e in exits:
                if (e.binding, e.scope_id) in deferred:
                    results.append(ForeignLock(e.binding, e.scope_id))
                    continue
                if not first:
                    cur.nextset()
                first = False
                results.append(int(cur.lastrowid) if cur.rowcount == 1 else _UNMOVED)
            rows: ReadRows = {}
            for binding, scope_ids in wanted:
                if not first:
                    cur.nextset()
                first = False
                got = _intent_rows(cur.fetchall())
                rows.update(((binding, s), got.get(s)) for s in scope_ids)
            if not first:
                cur.nextset()  # the COMMIT's OK: every result read, the connection is usable
        if any(r is not _UNMOVED and not isinstance(r, ForeignLock) for r in results):
            return results, rows  # a row moved: the fence held at that statement
        lease = None
        if found is not None:
            lease = LeaseRow(term.supervisor_key, found[0], int(found[1]), found[2])
        validate(lease, term, None)  # holder and generation (expiry: decided per exit)
        return results, rows

    def _lock_rows(
        self,
        cur: Any,
        exits: Sequence[ExitAck],
        parts: list[str],
        params: list[Any],
        bounded: bool,
    ) -> tuple[dict[Any, Any], set[tuple[str, str]]]:
        """Send ``parts`` (the Lease lock, maybe the session bound before it), then lock the
        exits' intent rows ``FOR UPDATE SKIP LOCKED`` and read which exist, in one round trip.
        Returns ({(binding, scope): True for each row locked, None: the Lease row}, the keys
        whose rows exist). A row that exists and was not locked is held by another
        transaction: acknowledging it now would wait for that lock with the Lease row held."""
        by_binding: dict[str, list[str]] = {}
        for e in exits:
            by_binding.setdefault(e.binding, []).append(e.scope_id)
        for binding, scope_ids in by_binding.items():
            ids = ", ".join(["%s"] * len(scope_ids))
            where = f" FROM {intents.name} WHERE binding_name = %s AND scope_id IN ({ids})"
            encoded = [binding.encode(), *(s.encode() for s in scope_ids)]
            parts.append("SELECT scope_id" + where + " FOR UPDATE SKIP LOCKED")
            parts.append("SELECT scope_id" + where)
            params += encoded + encoded
        cur.execute("; ".join(parts), params)
        if bounded:
            cur.nextset()
        held: dict[Any, Any] = {None: cur.fetchone()}
        present: set[tuple[str, str]] = set()
        for binding in by_binding:
            cur.nextset()
            held.update(((binding, _text(r[0])), True) for r in cur.fetchall())
            cur.nextset()
            present.update((binding, _text(r[0])) for r in cur.fetchall())
        return held, present

    def _acknowledge(
        self,
        term: Term,
        binding: str,
        scope_id: str,
        generation: int,
        pending_sequence: int,
        report: bool,
    ) -> tuple[bool, int | None]:
        """The fenced acknowledgment on the DBAPI path: (moved, the requested generation when
        ``report`` and moved). ``report`` is the host's call: it raises ``ForeignLock``
        instead of waiting for a row another transaction holds."""
        key = (binding.encode(), scope_id.encode())

        def attempt() -> tuple[bool, int | None]:
            with self._dbapi() as (dbapi_conn, info):
                cur = dbapi_conn.cursor()
                bound = self._unbounded(info)
                if bound is not None:
                    cur.execute(bound)
                    info["apsup_bounded"] = True
                cur.execute(_LEASE_LOCK_SQL, (term.supervisor_key.encode(),))
                found = cur.fetchone()
                lease = None
                if found is not None:
                    lease = LeaseRow(term.supervisor_key, found[0], int(found[1]), found[2])
                validate(lease, term, None)  # holder and generation; expiry on database time:
                assert lease is not None
                # The host never waits on a row another transaction holds (``_lock_rows``); a
                # Worker's own acknowledgment may wait (its fenced transaction is bounded).
                if report:
                    cur.execute(_ROW_SQL + " FOR UPDATE SKIP LOCKED", key)
                if report and cur.fetchone() is None:
                    cur.execute(_ROW_SQL, key)
                    if cur.fetchone() is not None:
                        dbapi_conn.rollback()
                        raise ForeignLock(binding, scope_id)
                params: list[Any] = [generation, *key, generation, generation, pending_sequence]
                statement = _ACK_REPORTING_SQL if report else _ACK_SQL
                if lease.expires_at is not None:
                    statement += _UNEXPIRED
                    params.append(lease.expires_at)
                moved = cur.execute(statement, params) == 1
                requested = int(cur.lastrowid) if moved and report else None
                if not moved:  # expired, already handled, or an error (as intents.acknowledge)
                    cur.execute("SELECT UTC_TIMESTAMP(6)")
                    validate(lease, term, cur.fetchone()[0])
                    cur.execute(_ROW_SQL, key)
                    row = cur.fetchone()
                    check_unmoved_acknowledgment(
                        row, binding, scope_id, generation, pending_sequence
                    )
                dbapi_conn.commit()
                return moved, requested

        # Lock waits and deadlocks retry the whole transaction, as every fenced write does; a
        # retry after a COMMIT of unknown outcome is safe here (the acknowledgment is
        # idempotent and fenced again), and a lost connection (2013) is never retried.
        return self._retrying(attempt)
