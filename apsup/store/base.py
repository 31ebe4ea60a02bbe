"""Transaction plumbing shared by the SQLite and MySQL backends.

Backends differ in how a write transaction begins, how the Lease is locked and how time is
read; the retry loop and connection hygiene are the same and live here.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeVar

from sqlalchemy import Connection, Engine
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError

from apsup.errors import BackendError, DeadlinePassed, ForeignLock, IntentError
from apsup.store import intents
from apsup.store.leases import LeaseRow, Term, all_leases, invalidate, read_lease, validate

T = TypeVar("T")

MAX_ATTEMPTS = 6


@dataclass(frozen=True, slots=True)
class ExitAck:
    """One Worker exit its Supervisor acknowledges: generation G of the claimed intent row."""

    binding: str
    scope_id: str
    generation: int
    pending_sequence: int


#: Per acknowledged exit (``SqlBackend.acknowledge_exits``): the requested generation it
#: reported, None (the caller reads the row), or why the claimed row could not take it.
AckResult = int | None | IntentError | ForeignLock

#: Intent rows to read beside acknowledgments: (binding, scope ids) pairs.
Reads = Sequence[tuple[str, Sequence[str]]]
#: Rows read beside acknowledgments, by (binding, scope id); None: the row does not exist.
ReadRows = dict[tuple[str, str], "intents.Intent | None"]


def redact_url(url: str) -> str:
    """Drop password and query (which may hold secrets); keep driver, host and database."""
    try:
        u = make_url(url)
    except Exception:
        return "<unparseable database url>"
    # Credentials and query (which may carry secrets) are dropped entirely.
    return (
        u._replace(username=None, password=None).set(query={}).render_as_string(hide_password=False)
    )


class SqlBackend:
    """Common behaviour; subclasses set ``name`` and implement the dialect hooks."""

    name = "abstract"
    engine: Engine
    read_engine: Engine
    #: Whether a process about to exit should still close its connections (a server counts a
    #: vanished client as an aborted connection). ``False`` where closing is only extra work.
    close_before_exit = True
    #: Control backends (the host's own): total seconds one ``run``/``run_fenced`` may spend
    #: on attempts and retries, so no database call holds the host loop for long. ``None``
    #: (Workers, CLI): only the attempt count bounds it.
    retry_budget: float | None = None
    #: Monotonic instant no call of this backend may outlive (the host sets it to its term's
    #: renew deadline while it leads; ``apsup.supervisor.lease_keeper``). ``None``: the
    #: static limits alone bound a call.
    call_deadline: float | None = None

    def __init__(self, url: str) -> None:
        self.url = url
        #: Per key, how long the Lease a refused ``claim_term`` met had left (database time):
        #: a standby tries again right when it runs out instead of a renewal interval later.
        self.held_for: dict[str, float] = {}
        #: Per key, the holder of the Lease a ``claim_term`` met when that Lease had run out
        #: unrenewed (not released): that holder is gone (placement leaves its replica out).
        self.lapsed_holder: dict[str, str] = {}
        #: Database time read by the last successful renewal, with this process's monotonic
        #: time then: the Supervisor's clock estimate is synced from it, without a query.
        self.renewed_at: tuple[datetime, float] | None = None

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.describe()}>"

    def describe(self) -> str:
        return redact_url(self.url)

    # -- dialect hooks ----------------------------------------------------------------------
    def _lock_term(self, conn: Connection, term: Term) -> None:
        raise NotImplementedError

    def _is_transient(self, exc: DBAPIError) -> bool:
        raise NotImplementedError

    def _lease_expiry(self, conn: Connection, lease_seconds: float) -> datetime | None:
        raise NotImplementedError

    def now(self) -> datetime:
        raise NotImplementedError

    def db_time_sql(self) -> Any:
        """A SQL expression of database time (naive UTC) to write in a statement."""
        raise NotImplementedError

    def claim_term(
        self, key: str, holder_id: str, lease_seconds: float, free_for: float = 0.0
    ) -> Term | None:
        raise NotImplementedError

    def renew_term(self, term: Term, lease_seconds: float) -> bool:
        raise NotImplementedError

    def release_term(self, term: Term) -> None:
        raise NotImplementedError

    # -- transactions -----------------------------------------------------------------------
    @contextmanager
    def _txn(self, engine: Engine) -> Iterator[Connection]:
        with engine.connect() as conn:
            try:
                with conn.begin():
                    yield conn
            except DBAPIError:
                # After a driver error the transaction state is unknown (SQLITE_FULL rolls back
                # while the driver believes it is open): never reuse this connection.
                if not conn.invalidated:
                    conn.invalidate()
                raise

    def transaction(self) -> AbstractContextManager[Connection]:
        return self._txn(self.engine)

    def read(self) -> AbstractContextManager[Connection]:
        return self._txn(self.read_engine)

    @contextmanager
    def fenced(self, term: Term) -> Iterator[Connection]:
        try:
            with self._txn(self.engine) as conn:
                self._lock_term(conn, term)
                yield conn
        except DBAPIError as exc:
            raise self.fence_error(exc) from exc

    def fence_error(self, exc: DBAPIError) -> BaseException:
        """What a driver error inside a fenced transaction means to its caller: the database
        ending a transaction that ran past its bound is a ``FencedTransactionTimeout`` naming
        the bound (see ``MysqlBackend``); any other error is itself."""
        return exc

    # -- point reads on hot paths: the host's dispatch and exit classification, the Worker
    # wrapper's duplicate check and acknowledgment -------------------------------------------
    def read_intent(self, binding: str, scope_id: str) -> intents.Intent | None:
        """The intent row, read on its own (one snapshot)."""
        with self.read() as conn:
            return intents.get(conn, binding, scope_id)

    def read_intents(self, binding: str, scope_ids: Sequence[str]) -> dict[str, intents.Intent]:
        """The intent rows of several Scopes of one binding (absent ones left out): the host's
        dispatch reads for the keys it is about to start. Here one point read each (SQLite's
        cost next to nothing); a networked backend reads them in one statement."""
        out: dict[str, intents.Intent] = {}
        for scope_id in scope_ids:
            row = self.read_intent(binding, scope_id)
            if row is not None:
                out[scope_id] = row
        return out

    def handled_generation(self, binding: str, scope_id: str) -> int:
        """``handled_generation`` of the intent row (0 if there is none), read on its own."""
        with self.read() as conn:
            row = intents.get(conn, binding, scope_id)
        return 0 if row is None else row.handled_generation

    def acknowledge_fenced(
        self, term: Term, binding: str, scope_id: str, generation: int, pending_sequence: int
    ) -> bool:
        """A fenced transaction that only acknowledges ``generation`` (``intents.acknowledge``):
        True if it moved, False if already handled; StaleTermError if ``term`` is no longer
        valid. Backends may run it more cheaply, never with weaker guarantees."""
        with self.fenced(term) as conn:
            return intents.acknowledge(conn, binding, scope_id, generation, pending_sequence)

    def acknowledge_exits(self, term: Term, exits: Sequence[ExitAck]) -> list[AckResult]:
        """The Supervisor's acknowledgments for Workers whose processors returned, all under
        ``term`` in one fenced transaction (one Lease lock, one commit for the exits of a
        cycle). Per exit, in order: the row's requested generation when this call moved
        handled to G and the backend read it in the same statement; None when it moved
        without reporting it, or G was handled already (the caller reads the row); the
        ``IntentError`` when the claimed row is gone or was recreated (nothing written for
        it). StaleTermError when ``term`` is no longer valid: then nothing was written."""

        def body() -> list[AckResult]:
            out: list[AckResult] = []
            with self.fenced(term) as conn:
                for e in exits:
                    try:
                        intents.acknowledge(
                            conn, e.binding, e.scope_id, e.generation, e.pending_sequence
                        )
                        out.append(None)
                    except IntentError as exc:  # read-only so far: the others still go in
                        out.append(exc)
            return out

        return self._retrying(body)

    def acknowledge_exits_and_read(
        self, term: Term, exits: Sequence[ExitAck], reads: Reads
    ) -> tuple[list[AckResult], ReadRows]:
        """``acknowledge_exits``, and the intent rows of ``reads`` ((binding, scope ids)) read
        in the same round trip where the backend can: the host's next dispatch reads, made
        while it acknowledges the exits that free their slots. The rows returned are those
        read (a backend may read none: then the dispatch reads them itself)."""
        return self.acknowledge_exits(term, exits), {}

    def time_left(self) -> float | None:
        """Seconds left before ``call_deadline``; raises ``DeadlinePassed`` once it passed."""
        deadline = self.call_deadline
        if deadline is None:
            return None
        left = deadline - time.monotonic()
        if left <= 0:
            raise DeadlinePassed(f"{self.name}: the leader's renew deadline passed; not calling")
        return left

    def _retrying(self, body: Callable[[], T]) -> T:
        delay = 0.02
        budget_end = None if self.retry_budget is None else time.monotonic() + self.retry_budget
        if self.call_deadline is not None:
            budget_end = min(budget_end or self.call_deadline, self.call_deadline)
        for attempt in range(1, MAX_ATTEMPTS + 1):
            try:
                return body()
            except DBAPIError as exc:
                spent = budget_end is not None and time.monotonic() + delay >= budget_end
                if not self._is_transient(exc) or attempt == MAX_ATTEMPTS or spent:
                    if self._is_transient(exc):
                        raise BackendError(
                            f"{self.name}: lock contention persisted after {attempt} attempts"
                        ) from exc
                    raise
                time.sleep(delay * (1 + random.random()))
                delay = min(delay * 2, 1.0)
        raise AssertionError("unreachable")  # pragma: no cover

    def run_fenced(self, term: Term, fn: Callable[[Connection], T]) -> T:
        def body() -> T:
            with self.fenced(term) as conn:
                return fn(conn)

        return self._retrying(body)

    def run(self, fn: Callable[[Connection], T]) -> T:
        def body() -> T:
            with self.transaction() as conn:
                return fn(conn)

        return self._retrying(body)

    # -- leases shared logic ----------------------------------------------------------------
    def lease_rows(self) -> list[LeaseRow]:
        with self.read() as conn:
            return list(all_leases(conn))

    def invalidate_terms(self, keys: Iterable[str] | None = None) -> list[str]:
        def body(conn: Connection) -> list[str]:
            return invalidate(conn, keys, self._lease_expiry(conn, 0))

        return self.run(body)

    def check_term(self, conn: Connection, term: Term) -> None:
        """Validate ``term`` inside an already open write transaction."""
        self._lock_term(conn, term)

    def dispose(self) -> None:
        self.engine.dispose()

    def connected(self) -> bool:
        """Whether this process holds a connection of this backend (pooled or in use)."""
        for engine in {self.engine, getattr(self, "read_engine", self.engine)}:
            pool: Any = engine.pool
            if not (hasattr(pool, "checkedin") and hasattr(pool, "checkedout")):
                return True  # a pool that cannot tell: assume it holds one
            if pool.checkedin() or pool.checkedout():
                return True
        return False


__all__ = ["SqlBackend", "read_lease", "redact_url", "validate"]
