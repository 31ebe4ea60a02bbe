"""ExecutionContext: the only input a Worker receives (RFC §1, §6).

It crosses the process boundary as orjson bytes with a version field, never as pickle. The
child rebuilds its own database engine from ``database_url``; ``fenced()`` gives the processor a
transaction in which the dispatching term was locked and validated, so an acknowledgment or any
business write commits only while that term is still the valid one. ``fenced_async()`` is the
same fence on a SQLAlchemy ``AsyncConnection`` (aiosqlite / aiomysql), for ``async def``
processors; its engine is built in the Worker's own event loop, on first use.
"""

from __future__ import annotations

import asyncio
import os
import weakref
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

import orjson
from sqlalchemy import Connection, event

from apsup.errors import ContextError, StaleTermError
from apsup.store import SqlBackend, open_backend, redact_url
from apsup.store import intents as _intents
from apsup.store.leases import Term

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncConnection

    from apsup.store.async_engine import AsyncStore

CONTEXT_VERSION = 1

_BACKENDS: dict[str, SqlBackend] = {}
#: The pid of the last process that opened a connection of a backend in ``_BACKENDS``. A Worker
#: inherits these backends from the forkserver with empty pools, so unless this is its own pid
#: it holds no connection, and ``release_before_exit`` has nothing to look at.
_connected_pid = 0


def _note_connection(dbapi_conn: Any, record: Any) -> None:
    global _connected_pid
    _connected_pid = os.getpid()


def backend_for(url: str) -> SqlBackend:
    """One backend (engine + pool) per database URL per process."""
    backend = _BACKENDS.get(url)
    if backend is None:
        backend = _BACKENDS[url] = open_backend(url)
        for engine in {backend.engine, getattr(backend, "read_engine", backend.engine)}:
            event.listen(engine, "connect", _note_connection)
    return backend


def dispose_backends() -> None:
    for backend in _BACKENDS.values():
        backend.dispose()
    _BACKENDS.clear()


# Async engines per event loop (their connections belong to it), then per database URL.
_ASYNC_STORES: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, AsyncStore]] = (
    weakref.WeakKeyDictionary()
)


def async_store_for(url: str) -> AsyncStore:
    """One async engine per database URL per running event loop."""
    from apsup.store.async_engine import AsyncStore

    stores = _ASYNC_STORES.setdefault(asyncio.get_running_loop(), {})
    store = stores.get(url)
    if store is None:
        store = stores[url] = AsyncStore(backend_for(url))
    return store


async def dispose_async_backends() -> None:
    """Close the running loop's async connections (before that loop ends)."""
    stores = _ASYNC_STORES.pop(asyncio.get_running_loop(), {})
    for store in stores.values():
        await store.dispose()


def release_before_exit() -> None:
    """What a Worker does with its connections right before ``os._exit``: close those whose
    server would otherwise log an aborted client; leave the rest to the kernel.

    A backend with no connection open (the forkserver's warm one, which a processor that
    needed no session never used) is left alone, and none is dropped from ``_BACKENDS``:
    closing an empty pool, or freeing the engine the Worker inherited, only writes to its
    pages (each write copies one) in a process about to exit. A disposed backend stays usable
    if the same process calls on it again (``invoke.run`` run in-process, as tests do).

    A Worker that opened no connection returns at once: asking each inherited pool whether it
    holds one runs code the forkserver never ran on objects it never touched, which cost a
    no-op MySQL Worker ~37 copied pages (4 on SQLite, which is not asked)."""
    if _connected_pid != os.getpid():
        return
    for backend in _BACKENDS.values():
        if backend.close_before_exit and backend.connected():
            backend.dispose()


_TYPES: dict[str, type | tuple[type, ...]] = {
    "binding_name": str,
    "artifact_family": str,
    "scope_id": str,
    "claimed_request_generation": int,
    "supervisor_key": str,
    "holder_id": str,
    "supervisor_generation": int,
    "worker_id": str,
    "pending_sequence": int,
    "entry_point": str,
    "database_url": str,
    "settings": dict,
}


@dataclass(eq=False)
class ExecutionContext:
    """Correlation and commit-validation data for one Scope invocation; selects no input."""

    binding_name: str
    artifact_family: str
    scope_id: str
    claimed_request_generation: int
    supervisor_key: str
    holder_id: str
    supervisor_generation: int
    worker_id: str
    pending_sequence: int
    entry_point: str
    database_url: str = field(repr=False)
    settings: dict[str, str] = field(default_factory=dict, repr=False)
    #: W3C trace context of the host's invocation span (``traceparent``...), only with tracing
    #: (``apsup[otel]``); a processor's own spans nest under it.
    trace_context: dict[str, str] = field(default_factory=dict, repr=False)
    #: Set by the Supervisor that dispatched this invocation: it found ``handled < G`` right
    #: before the launch (the duplicate check), and it acknowledges G itself, fenced by the same
    #: term, when the Worker exits with ``ExitCode.RETURNED_UNACKNOWLEDGED``. A processor that
    #: returns without acknowledging then needs no database session of its own. Off (the Worker
    #: checks and acknowledges itself) for a context built by hand.
    host_acknowledges: bool = field(default=False, repr=False)
    _ack_pending: Connection | AsyncConnection | None = field(default=None, repr=False, init=False)
    _fenced_conn: Connection | None = field(default=None, repr=False, init=False)
    _fenced_aconn: AsyncConnection | None = field(default=None, repr=False, init=False)
    _acknowledged: bool = field(default=False, repr=False, init=False)

    # -- serialisation ------------------------------------------------------------------------
    def to_bytes(self) -> bytes:
        data: dict[str, Any] = {"v": CONTEXT_VERSION}
        for name in _TYPES:
            data[name] = getattr(self, name)
        if self.trace_context:  # optional: absent without tracing
            data["trace_context"] = self.trace_context
        if self.host_acknowledges:  # optional: absent in a context built by hand
            data["host_acknowledges"] = True
        return orjson.dumps(data)

    @classmethod
    def from_bytes(cls, payload: bytes) -> ExecutionContext:
        try:
            data = orjson.loads(payload)
        except orjson.JSONDecodeError as exc:
            raise ContextError("execution context is not valid JSON") from exc
        if not isinstance(data, dict):
            raise ContextError("execution context must be a JSON object")
        version = data.pop("v", None)
        if version != CONTEXT_VERSION:
            raise ContextError(
                f"execution context version {version!r} is not supported (expected "
                f"{CONTEXT_VERSION}); restart Workers and Supervisor from the same release"
            )
        trace_context = data.pop("trace_context", {})
        if not isinstance(trace_context, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in trace_context.items()
        ):
            raise ContextError("execution context trace_context must map strings to strings")
        host_acknowledges = data.pop("host_acknowledges", False)
        if not isinstance(host_acknowledges, bool):
            raise ContextError("execution context field 'host_acknowledges' must be a boolean")
        missing = sorted(set(_TYPES) - set(data))
        unknown = sorted(set(data) - set(_TYPES))
        if missing or unknown:
            raise ContextError(f"execution context fields missing={missing} unknown={unknown}")
        for name, kind in _TYPES.items():
            value = data[name]
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                raise ContextError(f"execution context field {name!r} has the wrong type")
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in data["settings"].items()):
            raise ContextError("execution context settings must map strings to strings")
        for name in ("claimed_request_generation", "supervisor_generation", "pending_sequence"):
            if data[name] < 1:
                raise ContextError(f"execution context field {name!r} must be >= 1")
        for name in ("binding_name", "artifact_family", "scope_id", "supervisor_key", "worker_id"):
            if not data[name]:
                raise ContextError(f"execution context field {name!r} must not be empty")
        return cls(**data, trace_context=trace_context, host_acknowledges=host_acknowledges)

    def __repr__(self) -> str:
        shown = ", ".join(
            f"{f.name}={getattr(self, f.name)!r}"
            for f in fields(self)
            if f.repr and not f.name.startswith("_")
        )
        return f"ExecutionContext({shown}, database={redact_url(self.database_url)!r})"

    # -- term and database --------------------------------------------------------------------
    @property
    def term(self) -> Term:
        return Term(self.supervisor_key, self.holder_id, self.supervisor_generation)

    @property
    def backend(self) -> SqlBackend:
        return backend_for(self.database_url)

    @contextmanager
    def fenced(self) -> Iterator[Connection]:
        """A short write transaction fenced by the dispatching term (StaleTermError if lost)."""
        with self.backend.fenced(self.term) as conn:
            outer, self._fenced_conn = self._fenced_conn, conn
            try:
                yield conn
                ack = self._ack_pending is conn
            finally:
                self._fenced_conn = outer
        # Reached only after COMMIT succeeded.
        if ack:
            self._acknowledged = True
        self._ack_pending = None

    @asynccontextmanager
    async def fenced_async(self) -> AsyncIterator[AsyncConnection]:
        """``fenced()`` for async processors: an ``AsyncConnection`` in a short write transaction
        in which the dispatching term was locked and validated (StaleTermError if lost)."""
        async with async_store_for(self.database_url).fenced(self.term) as conn:
            outer, self._fenced_aconn = self._fenced_aconn, conn
            try:
                yield conn
                ack = self._ack_pending is conn
            finally:
                self._fenced_aconn = outer
        # Reached only after COMMIT succeeded.
        if ack:
            self._acknowledged = True
        self._ack_pending = None

    def _check_aconn(self, conn: AsyncConnection) -> None:
        if conn is not self._fenced_aconn or not conn.in_transaction():
            raise StaleTermError(
                "acknowledge_async/mark_clean_async must run inside ctx.fenced_async()"
            )

    async def acknowledge_async(self, conn: AsyncConnection) -> bool:
        """``acknowledge`` inside ``fenced_async()``."""
        self._check_aconn(conn)
        moved = await conn.run_sync(
            _intents.acknowledge,
            self.binding_name,
            self.scope_id,
            self.claimed_request_generation,
            self.pending_sequence,
        )
        self._ack_pending = conn
        return bool(moved)

    async def mark_clean_async(self, conn: AsyncConnection, dirty_generation: int) -> bool:
        """``mark_clean`` inside ``fenced_async()``."""
        self._check_aconn(conn)
        return bool(
            await conn.run_sync(
                _intents.mark_clean,
                self.binding_name,
                self.scope_id,
                dirty_generation,
                self.pending_sequence,
            )
        )

    async def dirty_generation_async(self, conn: AsyncConnection) -> int:
        return int(await conn.run_sync(self.dirty_generation))

    def _check_conn(self, conn: Connection) -> None:
        # Only the connection this context's fenced() yielded has this term locked + validated;
        # any other transaction (plain, or fenced by another term) would commit unfenced.
        if conn is not self._fenced_conn or not conn.in_transaction():
            raise StaleTermError("acknowledge/mark_clean must run inside ctx.fenced()")

    def acknowledge(self, conn: Connection) -> bool:
        """handled_generation := claimed G in this (fenced) transaction. False if already."""
        self._check_conn(conn)
        moved = _intents.acknowledge(
            conn,
            self.binding_name,
            self.scope_id,
            self.claimed_request_generation,
            self.pending_sequence,
        )
        self._ack_pending = conn
        return moved

    def mark_clean(self, conn: Connection, dirty_generation: int) -> bool:
        """Record that no work remains up to the dirty generation read in this snapshot."""
        self._check_conn(conn)
        return _intents.mark_clean(
            conn, self.binding_name, self.scope_id, dirty_generation, self.pending_sequence
        )

    def dirty_generation(self, conn: Connection) -> int:
        row = _intents.get(conn, self.binding_name, self.scope_id)
        return 0 if row is None else row.dirty_generation

    def handled_generation(self, conn: Connection) -> int:
        row = _intents.get(conn, self.binding_name, self.scope_id)
        return 0 if row is None else row.handled_generation

    @property
    def acknowledged(self) -> bool:
        """True once an acknowledgment of G committed durably in this process."""
        return self._acknowledged

    def already_handled(self) -> bool:
        """``handled >= G``: a duplicate invocation that must consume no new input."""
        handled = self.backend.handled_generation(self.binding_name, self.scope_id)
        return handled >= self.claimed_request_generation

    def acknowledge_fenced(self) -> bool:
        """Acknowledge G in a fenced transaction of its own (the wrapper's final step when the
        processor did not acknowledge): ``with ctx.fenced() as c: ctx.acknowledge(c)`` on the
        backend's cheapest path. StaleTermError if the term is no longer valid."""
        moved = self.backend.acknowledge_fenced(
            self.term,
            self.binding_name,
            self.scope_id,
            self.claimed_request_generation,
            self.pending_sequence,
        )
        self._acknowledged = True  # reached only after COMMIT succeeded
        return moved
