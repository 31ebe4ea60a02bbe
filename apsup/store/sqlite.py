"""SQLite backend: one host, permanent terms, fencing by real ``BEGIN IMMEDIATE`` transactions.

pysqlite does not emit BEGIN by itself (so a check-then-write would not be fenced): the
documented SQLAlchemy recipe takes over transaction control, and every write transaction starts
with ``BEGIN IMMEDIATE`` so the database write lock is held from the term check through commit.
Reads use a deferred ``BEGIN`` and never take the write lock.

A control backend (the host's) waits at most ``apsup_lock_wait`` (default 2 s) for the write
lock, retries included, instead of 30 s per attempt: a Worker holding the lock can then delay
one Supervisor step, never freeze the host loop (``apsup.store.limits``). Workers keep the
30 s wait: their acknowledgment is worth waiting for.
"""

from __future__ import annotations

import os
import random
import sqlite3
import stat
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, create_engine, event, update
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError

from apsup.errors import ConfigError, IntentError
from apsup.store.base import AckResult, ExitAck, SqlBackend
from apsup.store.intents import Intent, check_unmoved_acknowledgment
from apsup.store.leases import (
    INVALIDATED,
    LeaseRow,
    Term,
    invalidate,
    other_mode_keys,
    read_lease,
    take_lease,
    validate,
)
from apsup.store.limits import parse_limits, strip_limits
from apsup.store.schema import intents, leases

BUSY_TIMEOUT_SECONDS = 30.0
_SPIN_FIRST = 0.0001  # seconds between attempts at the write lock, growing x1.5 ...
_SPIN_MAX = 0.002  # ... up to this
_READONLY = "apsup_readonly"


def database_path(url: str) -> Path | None:
    """The file behind a sqlite URL, or None for in-memory databases."""
    u = make_url(url)
    if u.get_backend_name() != "sqlite":
        raise ConfigError(f"not a sqlite URL: {u.get_backend_name()}")
    if not u.database or u.database == ":memory:":
        return None
    return Path(u.database).resolve()


def _create_private(path: Path) -> None:
    """Create the database file 0600 so -wal/-shm (which copy its mode) are private too."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except FileExistsError:
        return
    except OSError as exc:
        raise ConfigError(
            f"cannot create the SQLite database {path}: {exc.strerror}; point the database "
            "URL (--db or DATABASE_URL) at a writable directory"
        ) from None
    os.close(fd)


#: Pseudo file systems whose entries look like empty regular files but are never databases.
_PSEUDO_ROOTS = (Path("/proc"), Path("/sys"), Path("/dev"))


def _check_existing(path: Path, *, allow_empty: bool) -> None:
    """Refuse, before anything is created or opened, a path that is no usable database file:
    a missing one (``apsup migrate`` creates it), a directory, a /proc entry, or an empty file.

    Only ``stat``: opening and closing the file here would drop every POSIX lock that SQLite
    connections of this same process hold on it (closing any descriptor of a file releases
    them all), which breaks SQLite's locking for the other connections. A non-empty file that
    is not a database is refused on first connect instead (``_on_first_connect``).
    """
    try:
        st = path.stat()
    except FileNotFoundError:
        if not path.parent.is_dir():
            raise ConfigError(
                f"the SQLite database {path} does not exist, nor does its directory: fix the "
                "database URL (--db or DATABASE_URL)"
            ) from None
        raise ConfigError(
            f"the SQLite database {path} does not exist: run `apsup migrate` to create it, or "
            "fix the database URL (--db or DATABASE_URL)"
        ) from None
    except OSError as exc:
        raise ConfigError(f"the SQLite database {path} is not accessible: {exc.strerror}") from None
    pseudo = any(path.is_relative_to(root) for root in _PSEUDO_ROOTS)
    if not stat.S_ISREG(st.st_mode) or pseudo:
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular database file"
        raise ConfigError(
            f"the SQLite database path {path} is {kind}: point the database URL (--db or "
            "DATABASE_URL) at a database file, e.g. sqlite:////var/lib/apsup/apsup.db"
        )
    if st.st_size == 0 and not allow_empty:
        raise ConfigError(
            f"the SQLite database {path} is empty (no apsup schema): run `apsup migrate` first"
        )


def shared_mode(path: Path) -> int | None:
    """The permission bits of an existing database file that other users may read or write.

    Only files apsup creates are made 0600; an existing file keeps its mode, since tightening
    it could break a deliberate setup. The host warns about it instead (it holds every intent
    and the processors' business data).
    """
    try:
        mode = path.stat().st_mode & 0o777
    except OSError:
        return None
    return mode if mode & 0o077 else None


def _spin_begin_immediate(dbapi_conn: Any, busy_timeout: float) -> bool:
    """Try ``BEGIN IMMEDIATE`` in short jittered steps until ``busy_timeout`` (see
    ``_begin_immediate``). True once the lock is held; False after the deadline or on any
    other error, leaving the last attempt (which raises that error) to the caller."""
    deadline = time.monotonic() + busy_timeout
    delay = _SPIN_FIRST
    while time.monotonic() < deadline:
        try:
            dbapi_conn.execute("BEGIN IMMEDIATE")
            return True
        except sqlite3.OperationalError as exc:
            # The extended codes (BUSY_RECOVERY, BUSY_SNAPSHOT ...) are contention too.
            if getattr(exc, "sqlite_errorcode", 0) & 0xFF != sqlite3.SQLITE_BUSY:
                return False  # not contention: the caller's last attempt raises it
        time.sleep(delay * (0.5 + random.random()))
        delay = min(delay * 1.5, _SPIN_MAX)
    return False


def _begin_immediate(conn: Connection, busy_timeout: float) -> None:
    """``BEGIN IMMEDIATE``, waiting for the write lock in short, jittered steps.

    SQLite's own busy handler sleeps 1, 2, 5, 10 ... up to 100 ms between attempts, so with
    several Workers committing at once a waiter sleeps far longer than the lock is held (a
    fenced acknowledgment holds it very briefly), and the acknowledgment's tail latency grows
    with the number of Workers. Here the handler is off while waiting for this one lock, which
    is polled in short jittered steps instead (``_SPIN_FIRST`` growing), up to the same
    ``busy_timeout``; the last attempt goes through SQLAlchemy so a
    timeout surfaces as the usual ``OperationalError`` ("database is locked"), which callers
    retry or report.
    """
    dbapi_conn: Any = conn.connection.dbapi_connection
    dbapi_conn.execute("PRAGMA busy_timeout=0")
    try:
        if not _spin_begin_immediate(dbapi_conn, busy_timeout):
            conn.exec_driver_sql("BEGIN IMMEDIATE")  # raises, wrapped, if still not possible
    finally:
        dbapi_conn.execute(f"PRAGMA busy_timeout={int(busy_timeout * 1000)}")


def _set_up(dbapi_conn: Any, synchronous: str) -> None:
    """What every connection needs before its first statement (the pool's "connect" listener
    and the Worker wrapper's own connection)."""
    dbapi_conn.isolation_level = None  # SQLAlchemy emits BEGIN itself (see the "begin" event)
    # Per connection. The busy timeout is already set by the driver's ``timeout``.
    dbapi_conn.execute(f"PRAGMA synchronous={synchronous}")


# The Worker wrapper's statements as plain SQL for its DBAPI path (``acknowledge_fenced``):
# the same conditions as ``leases.read_lease`` and ``intents.acknowledge``.
_LEASE_SQL = f"SELECT holder_id, supervisor_generation FROM {leases.name} WHERE supervisor_key = ?"
_INTENT_SQL = (
    "SELECT binding_name, scope_id, pending_sequence, dirty_generation, clean_generation,"
    " requested_generation, handled_generation, last_auto_scan_generation"
    f" FROM {intents.name} WHERE binding_name = ? AND scope_id = ?"
)
_HANDLED_SQL = (
    f"SELECT handled_generation, requested_generation, pending_sequence FROM {intents.name}"
    " WHERE binding_name = ? AND scope_id = ?"
)
_ACK_SQL = (
    f"UPDATE {intents.name} SET handled_generation = ? WHERE binding_name = ? AND scope_id = ?"
    " AND handled_generation < ? AND requested_generation >= ? AND pending_sequence = ?"
)


class SqliteBackend(SqlBackend):
    name = "sqlite"
    # A committed SQLite connection needs no goodbye; closing the last one would checkpoint and
    # truncate the WAL inside a Worker that is about to exit, on the invocation's time.
    close_before_exit = False

    def __init__(
        self,
        url: str,
        *,
        synchronous: str = "FULL",
        busy_timeout: float = BUSY_TIMEOUT_SECONDS,
        create: bool = False,
        control: bool = False,
    ) -> None:
        super().__init__(url)
        limits = parse_limits(url)
        if control:
            busy_timeout = limits.lock_wait
            self.retry_budget = limits.lock_wait
        self.path = database_path(url)
        if self.path is None:
            raise ConfigError(
                "apsup needs a SQLite database file shared with Worker processes; "
                "use sqlite:////absolute/path/apsup.db, not an in-memory database"
            )
        if create:  # ``apsup migrate`` only: everything else needs an existing database
            _create_private(self.path)
        _check_existing(self.path, allow_empty=create)
        self.busy_timeout = busy_timeout
        self.engine = create_engine(strip_limits(url), connect_args={"timeout": busy_timeout})
        self.read_engine = self.engine.execution_options(**{_READONLY: True})
        self._synchronous = synchronous
        # The Worker wrapper's own DBAPI connection (see ``_wrapper_connection``), the pid that
        # opened it, whether it is in use, and the last pid in which the pool connected (the
        # forkserver's warm-up connects, its Workers must not count that).
        cargs, cparams = self.engine.dialect.create_connect_args(self.engine.url)
        self._connect_args = (tuple(cargs), {**cparams, "timeout": busy_timeout})
        self._own: Any = None
        self._own_pid = 0
        self._own_busy = False
        self._pool_pid = 0
        self._own_lock = threading.Lock()
        # ``read_intent``'s autocommit connection and the pid that opened it (see there).
        self._reader: Any = None
        self._reader_pid = 0
        self._reader_lock = threading.Lock()

        @event.listens_for(self.engine, "do_connect")
        def _on_do_connect(dialect: Any, _rec: Any, cargs: Any, cparams: Any) -> Any:
            # The pool's first connection in a Worker whose wrapper already opened one: adopt it
            # (the "connect" listeners below still run on it), so a processor that uses the
            # engine shares the wrapper's connection instead of opening a second one.
            with self._own_lock:
                self._pool_pid = os.getpid()
                own = self._own
                if own is None or self._own_busy or self._own_pid != os.getpid():
                    return None
                self._own = None
                return own

        @event.listens_for(self.engine, "first_connect")
        def _on_first_connect(dbapi_conn: Any, _rec: Any) -> None:
            # WAL is a property of the file, kept across connections and restarts: once per
            # engine is enough, and a Worker inherits an engine that has already done it.
            try:
                dbapi_conn.execute("PRAGMA journal_mode=WAL").fetchall()
            except sqlite3.DatabaseError as exc:
                if "not a database" not in str(exc):
                    raise
                raise ConfigError(
                    f"{self.path} is not a SQLite database: point the database URL (--db or "
                    "DATABASE_URL) at the apsup database file"
                ) from None

        @event.listens_for(self.engine, "connect")
        def _on_connect(dbapi_conn: Any, _rec: Any) -> None:
            _set_up(dbapi_conn, synchronous)

        @event.listens_for(self.engine, "handle_error")
        def _on_error(ctx: Any) -> None:
            # SQLITE_FULL/IOERR/NOMEM/BUSY may end the whole transaction inside SQLite while
            # SQLAlchemy still reports it open; in autocommit mode the next statement on this
            # connection would then commit on its own, outside the lock and the term check, even
            # if the caller catches this error. Treat it like a lost connection: SQLAlchemy
            # invalidates it now and refuses further statements until the block rolls back.
            conn = ctx.connection
            if conn is None or conn.invalidated or not conn.in_transaction():
                return
            try:
                ended = not conn.connection.dbapi_connection.in_transaction
            except Exception:
                return
            if ended:
                ctx.is_disconnect = True
                ctx.invalidate_pool_on_disconnect = False  # only this connection is affected

        @event.listens_for(self.engine, "begin")
        def _on_begin(conn: Connection) -> None:
            if conn.get_execution_options().get(_READONLY):
                conn.exec_driver_sql("BEGIN")
            else:
                _begin_immediate(conn, self.busy_timeout)

    # -- hot point reads and the Worker wrapper's path: the sqlite3 connection, no SQLAlchemy
    # Core ----------------------------------------------------------------------------------
    # A freshly forked Worker pays SQLAlchemy's per-transaction machinery (connection wrapper,
    # events, result objects) on copy-on-write pages, more than the same SQL costs on the DBAPI
    # connection (docs/benchmarks.md, "Measurements behind code choices"). One
    # connection per Worker (``_wrapper_connection``: a processor's own ``ctx.fenced()`` reuses
    # it), same statements, same fence: the write lock taken by BEGIN IMMEDIATE is held from the
    # Lease check through COMMIT.
    def read_intent(self, binding: str, scope_id: str) -> Intent | None:
        # The host's dispatch read and exit classification (twice per invocation): one
        # autocommit SELECT is one snapshot, like read()'s transaction, at a fifth of its CPU.
        # On a connection of its own: a pool checkout and its reset on return cost as much
        # again as the SELECT. Busy waits are bounded by the connection's busy timeout; after
        # any error the connection is closed and the next read opens another.
        with self._reader_lock:
            conn = self._reader if self._reader_pid == os.getpid() else None
            if conn is None:
                cargs, cparams = self._connect_args
                conn = self.engine.dialect.loaded_dbapi.connect(
                    *cargs, **{**cparams, "check_same_thread": False}
                )
                _set_up(conn, self._synchronous)
                self._reader, self._reader_pid = conn, os.getpid()
            try:
                row = conn.execute(_INTENT_SQL, (binding, scope_id)).fetchone()
            except BaseException:
                self._reader = None
                conn.close()
                raise
        return None if row is None else Intent(*row)

    @contextmanager
    def _wrapper_connection(self) -> Iterator[Any]:
        """The DBAPI connection for the Worker wrapper's duplicate check and acknowledgment.

        A fresh Worker opens it directly, set up as the pool's "connect" listener would set up
        any connection: SQLAlchemy's connect and checkout machinery in a just-forked process
        costs CPU and copied memory pages beyond the driver's ``connect`` alone.
        If the processor uses the engine, the pool adopts this connection as its first one
        (``do_connect``) and from then on the wrapper checks one out of the pool like everyone
        else: one connection per Worker either way. Never one opened by another process (a
        connection does not cross a fork), nor one a thread is using. On an error the
        connection's state is unknown (SQLITE_FULL may have ended the transaction inside
        SQLite): it is closed, never reused.
        """
        with self._own_lock:
            pid = os.getpid()
            own = self._own if self._own_pid == pid else None
            if own is None and self._pool_pid != pid and not self._own_busy:
                cargs, cparams = self._connect_args
                own = self.engine.dialect.loaded_dbapi.connect(*cargs, **cparams)
                _set_up(own, self._synchronous)
                self._own, self._own_pid = own, pid
            if own is not None and not self._own_busy:
                self._own_busy = True
            else:
                own = None
        if own is None:
            fairy = self.engine.raw_connection()
            clean = False
            try:
                yield fairy.driver_connection
                clean = True
            finally:
                if not clean:
                    fairy.invalidate()
                fairy.close()
            return
        clean = False
        try:
            yield own
            clean = True
        finally:
            with self._own_lock:
                self._own_busy = False
                if not clean and self._own is own:
                    self._own = None
            if not clean:
                own.close()

    def handled_generation(self, binding: str, scope_id: str) -> int:
        with self._wrapper_connection() as dbapi_conn:
            # One statement in autocommit mode: its own read transaction (one snapshot).
            row = dbapi_conn.execute(_HANDLED_SQL, (binding, scope_id)).fetchone()
        return 0 if row is None else int(row[0])

    def acknowledge_fenced(
        self, term: Term, binding: str, scope_id: str, generation: int, pending_sequence: int
    ) -> bool:
        exit_ack = ExitAck(binding, scope_id, generation, pending_sequence)
        (moved,) = self._acknowledge(term, [exit_ack])
        if isinstance(moved, IntentError):
            raise moved
        return moved

    def acknowledge_exits(self, term: Term, exits: Sequence[ExitAck]) -> list[AckResult]:
        # SQLite reports no requested generation: a point read afterwards costs next to nothing.
        return [m if isinstance(m, IntentError) else None for m in self._acknowledge(term, exits)]

    def _acknowledge(self, term: Term, exits: Sequence[ExitAck]) -> list[bool | IntentError]:
        """One ``BEGIN IMMEDIATE`` transaction that checks ``term`` and acknowledges each exit
        (moved or not; the IntentError of one whose claimed row is gone: nothing is written for
        it, the others still are)."""
        with self._wrapper_connection() as dbapi_conn:
            dbapi_conn.execute("PRAGMA busy_timeout=0")
            try:
                locked = _spin_begin_immediate(dbapi_conn, self.busy_timeout)
            finally:
                dbapi_conn.execute(f"PRAGMA busy_timeout={int(self.busy_timeout * 1000)}")
            if not locked:
                dbapi_conn.execute("BEGIN IMMEDIATE")  # raises "database is locked" if still
            try:
                lease = dbapi_conn.execute(_LEASE_SQL, (term.supervisor_key,)).fetchone()
                validate(
                    None
                    if lease is None
                    else LeaseRow(term.supervisor_key, lease[0], int(lease[1]), None),
                    term,
                    None,
                )
                out: list[bool | IntentError] = []
                for e in exits:
                    key = (e.binding, e.scope_id)
                    g, seq = e.generation, e.pending_sequence
                    moved = dbapi_conn.execute(_ACK_SQL, (g, *key, g, g, seq)).rowcount == 1
                    if not moved:  # as intents.acknowledge: already handled, or an error
                        row = dbapi_conn.execute(_HANDLED_SQL, key).fetchone()
                        try:
                            check_unmoved_acknowledgment(row, *key, g, seq)
                        except IntentError as exc:
                            out.append(exc)
                            continue
                    out.append(moved)
                dbapi_conn.execute("COMMIT")
            finally:
                if dbapi_conn.in_transaction:
                    dbapi_conn.execute("ROLLBACK")
            return out

    def dispose(self) -> None:
        with self._own_lock:
            own = self._own if self._own_pid == os.getpid() else None
            self._own = None
        if own is not None:
            own.close()
        with self._reader_lock:
            reader = self._reader if self._reader_pid == os.getpid() else None
            self._reader = None
        if reader is not None:
            reader.close()
        super().dispose()

    def connected(self) -> bool:
        pid = os.getpid()
        own = self._own is not None and self._own_pid == pid
        return own or (self._reader is not None and self._reader_pid == pid) or super().connected()

    def _is_transient(self, exc: DBAPIError) -> bool:
        text = str(exc.orig).lower()
        return "database is locked" in text or "database is busy" in text

    def now(self) -> datetime:
        # One host: the database clock is this host's clock.
        return datetime.now(UTC).replace(tzinfo=None)

    def db_time_sql(self) -> Any:
        return self.now()  # one host: its clock is the database's

    def _lease_expiry(self, conn: Connection, lease_seconds: float) -> datetime | None:
        return None  # SQLite terms never expire; they are replaced

    def _lock_term(self, conn: Connection, term: Term) -> None:
        # BEGIN IMMEDIATE already holds the database write lock until commit.
        validate(read_lease(conn, term.supervisor_key, for_update=False), term, None)

    def claim_term(
        self, key: str, holder_id: str, lease_seconds: float = 0, free_for: float = 0.0
    ) -> Term:
        """Legitimate startup: new holder, generation + 1, expires_at NULL.

        SQLite terms never expire, so the other mode's terms are invalidated in the same
        transaction: one host (the host lock proves it) restarted in another mode without
        ``switch-mode`` would otherwise leave the old mode's surviving Workers able to commit.
        """

        def body(conn: Connection) -> Term:
            row = read_lease(conn, key, for_update=False)
            others = [r.supervisor_key for r in other_mode_keys(conn, key)]
            if others:
                invalidate(conn, others, None)
            return take_lease(conn, key, holder_id, row, None)

        return self.run(body)

    def renew_term(self, term: Term, lease_seconds: float = 0) -> bool:
        with self.read() as conn:
            row = read_lease(conn, term.supervisor_key, for_update=False)
        return row is not None and (row.holder_id, row.generation) == (
            term.holder_id,
            term.generation,
        )

    def release_term(self, term: Term) -> None:
        def body(conn: Connection) -> None:
            conn.execute(
                update(leases)
                .where(
                    leases.c.supervisor_key == term.supervisor_key,
                    leases.c.holder_id == term.holder_id,
                    leases.c.supervisor_generation == term.generation,
                )
                .values(
                    holder_id=INVALIDATED,
                    supervisor_generation=leases.c.supervisor_generation + 1,
                )
            )

        self.run(body)
