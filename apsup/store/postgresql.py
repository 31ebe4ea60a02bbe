"""PostgreSQL backend (psycopg 3): elected Leases in database time, fenced writes.

Everything a leader relies on is set per connection, in the startup packet (no extra round
trip): ``TimeZone`` UTC, and on the host's own connections ``statement_timeout`` and
``lock_timeout`` (``apsup_query_timeout``), plus ``idle_in_transaction_session_timeout`` (the
fence bound) on every connection, so a frozen Worker that holds the Lease row lock is ended by
the server and a standby can take over. Sessions run READ COMMITTED.

Traps this module is built around:

- ``now()`` and ``statement_timestamp()`` are taken before a lock wait, and even
  ``clock_timestamp()`` inside the locking statement can be as old as the wait: database time is
  read with ``clock_timestamp()`` in a statement of its own after the Lease row is locked
  (``ElectedBackend._lock_term``).
- psycopg has no client-side read timeout: a call to a frozen server never returns by itself,
  and neither ``statement_timeout`` nor a cancel request reaches a frozen server. On the host's
  connections a watchdog shuts the socket down when a call outlives its bound (the read limit,
  or the leader's renew deadline): the call then fails at once and the connection is dropped.
- any error aborts the whole transaction (SQLSTATE 25P02): nothing can be written outside the
  fence by mistake; the transaction is retried as a whole on the transient SQLSTATEs only.
"""

from __future__ import annotations

import contextlib
import math
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, Engine, create_engine, event, literal_column, text
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import DBAPIError, DisconnectionError

from apsup.errors import FencedTransactionTimeout
from apsup.store.elected import FENCE_TIMEOUT_PARAM, ElectedBackend, fence_timeout
from apsup.store.limits import DbLimits, parse_limits, strip_limits

#: Serialization failure, deadlock, lock_timeout, statement_timeout / cancel: the whole
#: transaction was rolled back and may run again.
TRANSIENT_SQLSTATES = frozenset({"40001", "40P01", "55P03", "57014"})
#: The server ended a session idle in a transaction past the fence bound.
IDLE_IN_TRANSACTION_TIMEOUT = "25P03"
#: The server ended a transaction that ran past ``transaction_timeout`` (PostgreSQL 17+).
TRANSACTION_TIMEOUT = "25P04"

_NOW = text("SELECT clock_timestamp() AT TIME ZONE 'UTC'")
#: A pooled connection idle longer than this is pinged before use (``_ping_when_idle``).
PING_AFTER_IDLE_SECONDS = 1.0
_RETURNED_AT = "apsup_returned_at"


def sqlstate(exc: BaseException) -> str | None:
    orig = exc.orig if isinstance(exc, DBAPIError) else exc
    state = getattr(orig, "sqlstate", None)
    return None if state is None else str(state)


def _options(settings: dict[str, str]) -> str:
    """libpq ``options``: ``-c name=value`` for each setting, sent at connect."""
    return " ".join(f"-c {name}={value}" for name, value in settings.items())


def session_options(backend: Any) -> str:
    """The session settings ``backend`` sends at connect (for the async engine of a Worker's
    ``fenced_async()``, which must run under the same rules)."""
    return str(backend.options)


class _Watchdog:
    """Ends calls that outlive their deadline by shutting their socket down.

    One daemon thread for the backend, sleeping until the earliest armed deadline. ``shutdown``
    on a duplicate of the descriptor acts on the socket itself, so the blocked read in the
    calling thread returns at once (psycopg then reports the connection lost)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._armed: dict[int, tuple[float, int]] = {}  # token -> (deadline, socket fd)
        self._next = 0
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.fired = 0

    def arm(self, fd: int, deadline: float) -> int:
        with self._cond:
            self._next += 1
            self._armed[self._next] = (deadline, fd)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="apsup-pg-watchdog", daemon=True
                )
                self._thread.start()
            self._cond.notify()
            return self._next

    def disarm(self, token: int) -> None:
        with self._cond:
            self._armed.pop(token, None)

    def stop(self) -> None:
        """End the thread now (a disposed backend; a process about to fork must hold no other
        thread: ``apsup.workers.fork``). The next ``arm`` starts it again."""
        with self._cond:
            thread, self._thread = self._thread, None
            self._armed.clear()
            self._stopping = True
            self._cond.notify_all()
        if thread is not None and thread is not threading.current_thread():
            thread.join(5.0)
        with self._cond:
            self._stopping = False

    def _run(self) -> None:
        with self._cond:
            while True:
                if self._stopping:
                    return
                if not self._armed:
                    self._cond.wait(5.0)
                    if not self._armed or self._stopping:
                        if self._thread is threading.current_thread():
                            self._thread = None
                        return
                    continue
                token, (deadline, fd) = min(self._armed.items(), key=lambda kv: kv[1][0])
                left = deadline - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                del self._armed[token]
                self.fired += 1
                with contextlib.suppress(OSError):
                    sock = socket.socket(fileno=os.dup(fd))
                    try:
                        sock.shutdown(socket.SHUT_RDWR)
                    finally:
                        sock.close()


class PostgresqlBackend(ElectedBackend):
    name = "postgresql"

    def __init__(self, url: str, *, control: bool = False) -> None:
        super().__init__(url)
        u = make_url(url)
        limits = parse_limits(u)
        self.limits: DbLimits | None = limits if control else None
        self.fence_timeout = fence_timeout(u)
        engine_url = strip_limits(u.difference_update_query([FENCE_TIMEOUT_PARAM]))
        settings = {"TimeZone": "UTC"}
        if self.fence_timeout > 0:
            settings["idle_in_transaction_session_timeout"] = str(int(self.fence_timeout * 1000))
        connect_args: dict[str, Any] = {}
        if control:
            connect_args["connect_timeout"] = max(1, round(limits.connect_timeout))
            if limits.query_timeout > 0:
                # A lock wait ends a little sooner than the statement, so it reports itself as
                # one (55P03, not 57014); both are retried.
                settings["statement_timeout"] = str(int(limits.query_timeout * 1000))
                settings["lock_timeout"] = str(int(limits.query_timeout * 750))
            self.retry_budget = limits.read_timeout
        given = str(engine_url.query.get("options", "") or "")
        self.options = " ".join(p for p in (given, _options(settings)) if p)
        connect_args["options"] = self.options
        engine_url = engine_url.difference_update_query(["options"])
        self._watchdog = _Watchdog() if control else None
        self.engine = self._engine(engine_url, connect_args, "READ COMMITTED", 4, 8)
        self.read_engine = self.engine
        if control:
            # The host's reads run in autocommit: under READ COMMITTED each statement sees the
            # latest commits anyway, and a read costs one statement instead of three.
            self.read_engine = self._engine(engine_url, connect_args, "AUTOCOMMIT", 2, 4)

    def _engine(
        self,
        url: URL,
        connect_args: dict[str, Any],
        isolation: str,
        size: int,
        overflow: int,
    ) -> Engine:
        engine = create_engine(
            url,
            connect_args=connect_args,
            isolation_level=isolation,
            pool_pre_ping=False,  # ``_ping_when_idle``
            pool_recycle=1800,
            pool_size=size,
            max_overflow=overflow,
        )

        if self._watchdog is not None:

            @event.listens_for(engine, "do_connect")
            def _connect_by_deadline(dialect: Any, rec: Any, cargs: Any, cparams: Any) -> None:
                # A leader's connect ends by its renew deadline too (whole seconds: libpq's).
                left = self.time_left()
                if left is not None:
                    bound = cparams.get("connect_timeout", left)
                    cparams["connect_timeout"] = max(1, min(int(bound), math.ceil(left)))

        self._ping_when_idle(engine)

        @event.listens_for(engine, "handle_error")
        def _on_error(ctx: Any) -> None:
            # The server ended the session (fence bound) or the watchdog cut it: the
            # connection is gone, never to be reused.
            if sqlstate(ctx.original_exception) in {
                IDLE_IN_TRANSACTION_TIMEOUT,
                TRANSACTION_TIMEOUT,
            }:
                ctx.is_disconnect = True
                ctx.invalidate_pool_on_disconnect = False

        return engine

    def _ping_when_idle(self, engine: Engine) -> None:
        """SQLAlchemy's ``pool_pre_ping``, only for connections idle for a while, and bounded.

        A ping on every checkout is one more round trip per transaction, paid where it protects
        nothing: a Worker's connection is seconds old, and the host reuses its connections many
        times a second. One idle longer than ``PING_AFTER_IDLE_SECONDS`` (the server may have
        restarted, a proxy dropped it) is pinged, and a dead one replaced before use
        (``DisconnectionError``: the pool retries with a fresh connection). On the host's
        connections the watchdog bounds the ping too: a frozen server cannot hold a checkout.
        """

        def checkin(dbapi_conn: Any, rec: Any) -> None:
            if rec is not None:
                rec.info[_RETURNED_AT] = time.monotonic()

        def checkout(dbapi_conn: Any, rec: Any, proxy: Any) -> None:
            returned = rec.info.get(_RETURNED_AT)
            if returned is None or time.monotonic() - returned < PING_AFTER_IDLE_SECONDS:
                return  # a fresh connection, or one in use a moment ago
            token, watchdog = None, self._watchdog
            if watchdog is not None and self.limits is not None:
                left = self.time_left()
                bound = (
                    self.limits.read_timeout
                    if left is None
                    else min(self.limits.read_timeout, left)
                )
                token = watchdog.arm(dbapi_conn.pgconn.socket, time.monotonic() + bound)
            try:
                engine.dialect.do_ping(dbapi_conn)
            except Exception as exc:
                raise DisconnectionError("pooled connection failed its ping") from exc
            finally:
                if watchdog is not None and token is not None:
                    watchdog.disarm(token)

        event.listen(engine.pool, "checkin", checkin)
        event.listen(engine.pool, "checkout", checkout)

    # -- calls bounded on the client side -------------------------------------------------------
    @contextmanager
    def _bounded(self, conn: Connection) -> Iterator[None]:
        """The host's calls on ``conn`` end by the read limit or the renew deadline, whichever
        comes first, even when the server does not answer at all."""
        if self._watchdog is None or self.limits is None:
            yield
            return
        left = self.time_left()  # raises DeadlinePassed once the renew deadline passed
        bound = self.limits.read_timeout if left is None else min(self.limits.read_timeout, left)
        fd = conn.connection.dbapi_connection.pgconn.socket  # type: ignore[union-attr]
        token = self._watchdog.arm(fd, time.monotonic() + bound)
        try:
            yield
        finally:
            self._watchdog.disarm(token)

    @contextmanager
    def _txn(self, engine: Engine) -> Iterator[Connection]:
        if self._watchdog is not None:
            self.time_left()  # past the renew deadline: not even a connect
        with engine.connect() as conn:
            try:
                with self._bounded(conn):
                    if engine is self.read_engine and self.read_engine is not self.engine:
                        yield conn  # autocommit: no BEGIN, no COMMIT
                    else:
                        with conn.begin():
                            yield conn
            except DBAPIError:
                # After a driver error the transaction state is unknown: never reuse it.
                if not conn.invalidated:
                    conn.invalidate()
                raise

    def read(self) -> AbstractContextManager[Connection]:
        return self._txn(self.read_engine)

    # -- dialect hooks ----------------------------------------------------------------------------
    def _db_now(self, conn: Connection) -> datetime:
        value = conn.execute(_NOW).scalar_one()
        assert isinstance(value, datetime)
        return value.replace(tzinfo=None)

    def db_time_sql(self) -> Any:
        return literal_column("(clock_timestamp() AT TIME ZONE 'UTC')")

    def _is_transient(self, exc: DBAPIError) -> bool:
        return sqlstate(exc) in TRANSIENT_SQLSTATES

    def fence_error(self, exc: DBAPIError) -> BaseException:
        if sqlstate(exc) not in {IDLE_IN_TRANSACTION_TIMEOUT, TRANSACTION_TIMEOUT}:
            return exc
        return FencedTransactionTimeout(
            f"the fenced transaction stayed open longer than its bound of {self.fence_timeout:g} "
            "s and the database ended it (nothing of it committed); the bound keeps the "
            "leader's Lease renewable: compute outside ctx.fenced(), write inside it"
        )

    def dispose(self) -> None:
        self.engine.pool.dispose()
        if self.read_engine is not self.engine:
            self.read_engine.pool.dispose()
        if self._watchdog is not None:
            self._watchdog.stop()


__all__ = ["TRANSIENT_SQLSTATES", "PostgresqlBackend", "sqlstate"]
