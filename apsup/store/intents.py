"""Durable scheduling intents (RFC §3): two independent generation pairs per (binding, scope).

``dirty/clean`` says whether ordinary work may exist; ``requested/handled`` whether accepted
invocations completed. The pairs are never compared with each other. ``pending_sequence`` is
drawn from a counter row, so it is unique, increasing and never reused even after a row is
deleted and recreated; it also identifies the row's incarnation, which is why acknowledgments
carry it (a Worker of a deleted incarnation cannot acknowledge its successor).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import (
    BindParameter,
    ColumnElement,
    Connection,
    Update,
    bindparam,
    delete,
    func,
    insert,
    select,
    update,
)
from sqlalchemy.exc import IntegrityError

from apsup.errors import IntentError
from apsup.store.schema import (
    BINDING_LENGTH,
    PENDING_SEQUENCE_COUNTER,
    SCOPE_LENGTH,
    counters,
    intents,
    scope_states,
)
from apsup.store.violations import is_duplicate_key

c = intents.c


@dataclass(frozen=True)
class Intent:
    binding_name: str
    scope_id: str
    pending_sequence: int
    dirty_generation: int
    clean_generation: int
    requested_generation: int
    handled_generation: int
    last_auto_scan_generation: int

    @property
    def dirty(self) -> bool:
        return self.dirty_generation > self.clean_generation

    @property
    def pending_request(self) -> bool:
        return self.requested_generation > self.handled_generation


_COLUMNS = (
    c.binding_name,
    c.scope_id,
    c.pending_sequence,
    c.dirty_generation,
    c.clean_generation,
    c.requested_generation,
    c.handled_generation,
    c.last_auto_scan_generation,
)


def check_scope_id(scope_id: object) -> str:
    if not isinstance(scope_id, str) or not scope_id or len(scope_id) > SCOPE_LENGTH:
        raise IntentError(
            f"scope_id must be a non-empty string of at most {SCOPE_LENGTH} characters, "
            f"got {scope_id!r:.80}"
        )
    if any(ord(ch) < 32 for ch in scope_id):
        raise IntentError("scope_id must not contain control characters")
    try:
        scope_id.encode("utf-8")  # identifiers are stored as UTF-8 bytes
    except UnicodeEncodeError:
        raise IntentError(f"scope_id must be valid Unicode text, got {scope_id!r:.80}") from None
    return scope_id


def _check_binding(binding: object) -> str:
    if not isinstance(binding, str) or not binding or len(binding) > BINDING_LENGTH:
        raise IntentError(f"binding_name must be a non-empty string, got {binding!r:.80}")
    return binding


# The statements of every invocation (dispatch read, exit classification, the Worker's duplicate
# check and acknowledgment) are built once, with bound parameters: SQLAlchemy then memoises their
# cache keys, so executing one skips statement construction and cache-key traversal. In a freshly
# forked Worker that traversal is what costs: every object it touches is a copy-on-write page
# fault (about 400 faults per statement against about 25 with a prebuilt one).
_BY_KEY = (c.binding_name == bindparam("p_binding"), c.scope_id == bindparam("p_scope"))
_GET = select(*_COLUMNS).where(*_BY_KEY)
_GET_FOR_UPDATE = _GET.with_for_update()
#: The same, skipping a row another transaction holds (MySQL, OceanBase, PostgreSQL).
_GET_FOR_UPDATE_SKIP_LOCKED = _GET.with_for_update(skip_locked=True)


def _raise_statement(lower: str, upper: str, *, with_sequence: bool) -> Update:
    target: BindParameter[int] = bindparam("p_target")
    where: list[ColumnElement[bool]] = [*_BY_KEY, c[lower] < target, c[upper] >= target]
    if with_sequence:
        where.append(c.pending_sequence == bindparam("p_sequence"))
    return update(intents).where(*where).values({lower: target})


_RAISE = {
    (lower, upper, with_sequence): _raise_statement(lower, upper, with_sequence=with_sequence)
    for lower, upper in (
        ("handled_generation", "requested_generation"),
        ("clean_generation", "dirty_generation"),
    )
    for with_sequence in (True, False)
}


def _key(binding: str, scope_id: str):  # type: ignore[no-untyped-def]
    return (c.binding_name == binding) & (c.scope_id == scope_id)


def next_pending_sequence(conn: Connection) -> int:
    """A never-reused pending sequence for a first registration (see
    ``reserve_pending_sequences``)."""
    return reserve_pending_sequences(conn, 1)


#: ``Connection.info`` key: the transaction that holds the counter row lock (a bulk creation).
_COUNTER_TXN = "apsup_counter_txn"


def reserve_pending_sequences(conn: Connection, count: int) -> int:
    """Reserve ``count`` consecutive never-reused sequences with one counter update; returns the
    first.

    On a backend with row locks the counter is advanced in a short transaction of its own, on
    another connection of the caller's engine, and committed at once: an application
    transaction that registers a Scope and stays open would otherwise hold the one counter row,
    and every other first registration would wait for it. A sequence reserved by a
    transaction that then rolls back is simply never used (gaps are fine; reuse is not), and one
    that commits late is visible late: a scan already past it admits it at the next check, as
    for any row that becomes visible late. SQLite locks the whole database for a write, so
    there the caller's own transaction advances it."""
    if conn.dialect.name == "sqlite" or conn.info.get(_COUNTER_TXN) is conn.get_transaction():
        return _reserve(conn, count)  # (or this transaction holds the counter already: bulk)
    with conn.engine.connect() as own, own.begin():
        return _reserve(own, count)


def _reserve(conn: Connection, count: int) -> int:
    conn.execute(
        update(counters)
        .where(counters.c.name == PENDING_SEQUENCE_COUNTER)
        .values(value=counters.c.value + count)
    )
    value = conn.execute(
        select(counters.c.value).where(counters.c.name == PENDING_SEQUENCE_COUNTER)
    ).scalar_one_or_none()
    if value is None:
        raise IntentError("counter row missing: run `apsup migrate` to create the schema")
    return int(value) - count + 1


def get(
    conn: Connection,
    binding: str,
    scope_id: str,
    *,
    for_update: bool = False,
    skip_locked: bool = False,
) -> Intent | None:
    """The intent row; ``for_update`` locks it, ``skip_locked`` returns None at once instead of
    waiting when another transaction holds it (or when there is no row)."""
    params = {"p_binding": binding, "p_scope": scope_id}
    statement = _GET
    if for_update:
        statement = _GET_FOR_UPDATE_SKIP_LOCKED if skip_locked else _GET_FOR_UPDATE
    row = conn.execute(statement, params).first()
    return None if row is None else Intent(*row)


_GET_MANY = select(*_COLUMNS).where(
    c.binding_name == bindparam("p_binding"), c.scope_id.in_(bindparam("p_scopes", expanding=True))
)


def get_many(conn: Connection, binding: str, scope_ids: Sequence[str]) -> dict[str, Intent]:
    """The intent rows of several Scopes of one binding, in one statement (absent ones left
    out)."""
    if not scope_ids:
        return {}
    rows = conn.execute(_GET_MANY, {"p_binding": binding, "p_scopes": list(scope_ids)}).all()
    return {row[1]: Intent(*row) for row in rows}


def _advance(conn: Connection, binding: str, scope_id: str, column: str) -> int:
    binding = _check_binding(binding)
    scope_id = check_scope_id(scope_id)
    col = c[column]
    for _ in range(3):
        done = conn.execute(update(intents).where(_key(binding, scope_id)).values({col: col + 1}))
        if done.rowcount == 0:
            seq = next_pending_sequence(conn)
            try:
                with conn.begin_nested():
                    conn.execute(
                        insert(intents).values(
                            {
                                "binding_name": binding,
                                "scope_id": scope_id,
                                "pending_sequence": seq,
                                column: 1,
                            }
                        )
                    )
            except IntegrityError as exc:  # a concurrent first registration won the insert
                if not is_duplicate_key(exc):
                    raise
                continue
        value = conn.execute(select(col).where(_key(binding, scope_id))).scalar_one()
        return int(value)
    raise IntentError(f"could not register scope {scope_id!r} of binding {binding!r}")


def mark_dirty(conn: Connection, binding: str, scope_id: str) -> int:
    """Advance dirty_generation in the caller's (domain) transaction; returns the new value."""
    return _advance(conn, binding, scope_id, "dirty_generation")


def request(conn: Connection, binding: str, scope_id: str) -> int:
    """Advance requested_generation in the caller's transaction; returns G."""
    return _advance(conn, binding, scope_id, "requested_generation")


#: Scope ids per ``IN (...)`` list: far below SQLite's bound-parameter limit, large enough that
#: the statement overhead is spread over many rows.
BULK_CHUNK = 500


_CONTROL_CHARACTER = re.compile("[\x00-\x1f]")


class _Raced(Exception):
    """A concurrent transaction created or deleted one of the rows between two statements."""


def check_scope_ids(scope_ids: Iterable[str]) -> list[str]:
    """The distinct, valid Scope ids of ``scope_ids`` in order of first appearance.

    Every id is checked before anything is written, so one bad id rejects the whole call.
    """
    if isinstance(scope_ids, str | bytes):
        raise IntentError(
            f"scope_ids must be a collection of scope ids, not a single string {scope_ids!r:.80}; "
            "pass [scope_id]"
        )
    try:
        items = list(scope_ids)
    except TypeError:
        raise IntentError(
            f"scope_ids must be a collection of scope ids, got {scope_ids!r:.80}"
        ) from None
    try:
        ordered = list(dict.fromkeys(items))
    except TypeError:  # an unhashable item: the single path's error names it
        for scope_id in items:
            check_scope_id(scope_id)
        raise
    for scope_id in ordered:
        # The common case in one regex scan; anything else gets ``check_scope_id``'s own error.
        ok = isinstance(scope_id, str) and 0 < len(scope_id) <= SCOPE_LENGTH
        if not ok or _CONTROL_CHARACTER.search(scope_id):
            check_scope_id(scope_id)
    return ordered


def _advance_many(
    conn: Connection, binding: str, scope_ids: Iterable[str], column: str
) -> dict[str, int]:
    binding = _check_binding(binding)
    ordered = check_scope_ids(scope_ids)
    if not ordered:
        return {}
    try:
        # A savepoint, so that a race with another publisher is undone and the rows redone one
        # by one by the single-row path, which resolves it.
        with conn.begin_nested():
            return _advance_many_once(conn, binding, ordered, column)
    except _Raced:
        pass
    except IntegrityError as exc:  # a concurrent first registration won an insert
        if not is_duplicate_key(exc):
            raise
    return {scope_id: _advance(conn, binding, scope_id, column) for scope_id in ordered}


_LOCK_COUNTER = (
    select(counters.c.value).where(counters.c.name == PENDING_SEQUENCE_COUNTER).with_for_update()
)


def _any_missing(conn: Connection, binding: str, chunks: list[list[str]]) -> bool:
    """Whether some Scope has no row yet (a plain read: it takes no lock)."""
    for chunk in chunks:
        where = (c.binding_name == binding, c.scope_id.in_(chunk))
        if conn.execute(select(func.count()).where(*where)).scalar_one() < len(chunk):
            return True
    return False


def _advance_many_once(
    conn: Connection, binding: str, ordered: list[str], column: str
) -> dict[str, int]:
    col = c[column]
    generations: dict[str, int] = {}
    # Locks are taken in one order by every publisher: the counter row first when rows are to be
    # created (every creation needs it, so no row can appear under us), then rows in key order
    # whatever the input order. Concurrent publishers on MySQL/OceanBase then queue instead of
    # deadlocking. SQLite needs neither: its first write holds the database's write lock, and a
    # read before it would risk SQLITE_BUSY_SNAPSHOT.
    by_key = sorted(ordered)
    chunks = [by_key[i : i + BULK_CHUNK] for i in range(0, len(by_key), BULK_CHUNK)]
    if conn.dialect.name != "sqlite" and _any_missing(conn, binding, chunks):
        conn.execute(_LOCK_COUNTER)
        conn.info[_COUNTER_TXN] = conn.get_transaction()  # later reservations stay in it
    for chunk in chunks:
        where = (c.binding_name == binding, c.scope_id.in_(chunk))
        # The UPDATE comes first: on SQLite it takes the write lock (nothing changes under us
        # after it), on MySQL it locks the rows it advanced (nobody can delete them).
        advanced = conn.execute(update(intents).where(*where).values({col: col + 1})).rowcount
        found = conn.execute(select(c.scope_id, col).where(*where)).all()
        if len(found) != advanced:
            raise _Raced  # a row appeared between the two statements: not advanced by us
        generations.update((scope_id, int(value)) for scope_id, value in found)
    missing = [scope_id for scope_id in ordered if scope_id not in generations]
    if missing:
        # Reserved under the counter lock this transaction holds (MySQL: taken above to order
        # concurrent creators), so a bulk creation holds the counter until it ends: bulk
        # intake transactions should be short (docs/bulk-intake.md).
        first = _reserve(conn, len(missing))
        conn.execute(
            insert(intents),
            [
                {"binding_name": binding, "scope_id": scope_id, "pending_sequence": seq, column: 1}
                for seq, scope_id in enumerate(missing, start=first)
            ],
        )
        generations.update(dict.fromkeys(missing, 1))
    return {scope_id: generations[scope_id] for scope_id in ordered}


def mark_dirty_many(conn: Connection, binding: str, scope_ids: Iterable[str]) -> dict[str, int]:
    """``mark_dirty`` for each distinct Scope of ``scope_ids`` (first appearance order), in a few
    statements: new rows get consecutive pending sequences from one counter update and are
    inserted with one executemany. Returns each Scope's new dirty generation."""
    return _advance_many(conn, binding, scope_ids, "dirty_generation")


def request_many(conn: Connection, binding: str, scope_ids: Iterable[str]) -> dict[str, int]:
    """``request`` for each distinct Scope of ``scope_ids``, as ``mark_dirty_many``; returns G
    per Scope."""
    return _advance_many(conn, binding, scope_ids, "requested_generation")


def _raise_pair(
    conn: Connection,
    binding: str,
    scope_id: str,
    pending_sequence: int | None,
    *,
    lower: str,
    upper: str,
    target: int,
    error: str,
) -> bool:
    """Move ``lower := target`` when ``lower < target <= upper`` on the claimed incarnation.

    True if it moved; False if ``lower`` already reached ``target`` (a no-op, never lowered);
    IntentError if the row is gone/recreated or ``target`` exceeds ``upper``.
    """
    params: dict[str, object] = {"p_binding": binding, "p_scope": scope_id, "p_target": target}
    if pending_sequence is not None:
        params["p_sequence"] = pending_sequence
    stmt = _RAISE[(lower, upper, pending_sequence is not None)]
    moved = conn.execute(stmt, params).rowcount
    if moved:
        return True
    row = get(conn, binding, scope_id)
    if row is None or (pending_sequence is not None and row.pending_sequence != pending_sequence):
        raise IntentError(f"scope {scope_id!r} of {binding!r} no longer has the claimed intent row")
    if getattr(row, upper) < target:
        raise IntentError(error.format(target=target, upper=getattr(row, upper)))
    return False


def check_unmoved_acknowledgment(
    row: Sequence[Any] | None, binding: str, scope_id: str, generation: int, pending_sequence: int
) -> None:
    """Why a driver-level acknowledgment's conditional UPDATE moved no row, as
    :func:`acknowledge` decides it: ``row`` is ``(handled_generation, requested_generation,
    pending_sequence)`` read in the same transaction, or None. Returns when the generation was
    simply handled already; raises ``IntentError`` when the claimed row is gone or recreated, or
    the generation was never requested."""
    if row is None or int(row[2]) != pending_sequence:
        raise IntentError(f"scope {scope_id!r} of {binding!r} no longer has the claimed intent row")
    if int(row[1]) < generation:
        raise IntentError(
            f"cannot acknowledge generation {generation} above requested {int(row[1])}"
        )


def acknowledge(
    conn: Connection, binding: str, scope_id: str, generation: int, pending_sequence: int | None
) -> bool:
    """handled := G for exactly the claimed G. True if it moved, False if already >= G."""
    return _raise_pair(
        conn,
        binding,
        scope_id,
        pending_sequence,
        lower="handled_generation",
        upper="requested_generation",
        target=generation,
        error="cannot acknowledge generation {target} above requested {upper}",
    )


def mark_clean(
    conn: Connection,
    binding: str,
    scope_id: str,
    dirty_generation: int,
    pending_sequence: int | None,
) -> bool:
    """clean := the dirty generation the processor read in its snapshot; never lowers it."""
    return _raise_pair(
        conn,
        binding,
        scope_id,
        pending_sequence,
        lower="clean_generation",
        upper="dirty_generation",
        target=dirty_generation,
        error="cannot mark clean {target} above dirty {upper}",
    )


def delete_scope(conn: Connection, binding: str, scope_id: str) -> bool:
    """Remove a quiescent row (nothing dirty, nothing requested). Its pending_sequence is never
    reused; a recreated row gets a new one, which fences stale acknowledgments."""
    return bool(
        conn.execute(
            delete(intents).where(
                _key(binding, scope_id),
                c.requested_generation == c.handled_generation,
                c.dirty_generation == c.clean_generation,
            )
        ).rowcount
    )


def max_pending_sequence(conn: Connection, binding: str) -> int | None:
    value = conn.execute(
        select(func.max(c.pending_sequence)).where(c.binding_name == binding)
    ).scalar_one()
    return None if value is None else int(value)


def dirty_page(
    conn: Connection, binding: str, after_sequence: int, upper_sequence: int, limit: int
) -> list[tuple[str, int, int]]:
    """(scope_id, pending_sequence, last_auto_scan_generation) with dirty > clean, in order."""
    rows = conn.execute(
        select(c.scope_id, c.pending_sequence, c.last_auto_scan_generation)
        .where(
            c.binding_name == binding,
            c.dirty_pending == 1,
            c.pending_sequence > after_sequence,
            c.pending_sequence <= upper_sequence,
        )
        .order_by(c.pending_sequence)
        .limit(limit)
    )
    return [(r[0], int(r[1]), int(r[2])) for r in rows]


def request_page(
    conn: Connection,
    binding: str,
    after_sequence: int,
    limit: int,
    *,
    backoff_at: datetime | None = None,
    failed_after: datetime | None = None,
) -> list[tuple[str, int]]:
    """(scope_id, pending_sequence) with requested > handled, in order.

    ``backoff_at`` and ``failed_after`` (both database time, both or neither): leave out the
    Scopes whose recorded failure state names a next attempt later than ``backoff_at`` for a
    failure recorded after ``failed_after`` (the leader's term start): the leader holds each
    of them in memory, waiting. A Scope whose backoff an earlier term recorded is read: the
    current term may not hold it."""
    params: dict[str, Any] = {"p_binding": binding, "p_after": after_sequence, "p_limit": limit}
    if backoff_at is None or failed_after is None:
        return [(r[0], int(r[1])) for r in conn.execute(_REQUEST_PAGE, params)]
    params["p_now"], params["p_since"] = backoff_at, failed_after
    return [(r[0], int(r[1])) for r in conn.execute(_REQUEST_PAGE_NO_BACKOFF, params)]


def not_in_backoff(now: Any, since: Any) -> ColumnElement[bool]:
    """An intent row's Scope has no backoff running at ``now`` for a failure recorded after
    ``since`` (values or SQL expressions of database time): one primary-key probe of its
    failure state."""
    s = scope_states.c
    return ~(
        select(s.scope_id)
        .where(
            s.binding_name == c.binding_name,
            s.scope_id == c.scope_id,
            s.next_attempt_at > now,
            s.last_failure_at > since,
        )
        .exists()
    )


# Prebuilt like ``_GET``: the host runs it about once per few dispatches under a backlog.
_REQUEST_PAGE = (
    select(c.scope_id, c.pending_sequence)
    .where(
        c.binding_name == bindparam("p_binding"),
        c.request_pending == 1,
        c.pending_sequence > bindparam("p_after"),
    )
    .order_by(c.pending_sequence)
    .limit(bindparam("p_limit"))
)
_REQUEST_PAGE_NO_BACKOFF = _REQUEST_PAGE.where(
    not_in_backoff(
        bindparam("p_now", type_=scope_states.c.next_attempt_at.type),
        bindparam("p_since", type_=scope_states.c.last_failure_at.type),
    )
)


def count_pending_requests(conn: Connection, binding: str) -> int:
    return int(
        conn.execute(
            select(func.count()).where(c.binding_name == binding, c.request_pending == 1)
        ).scalar_one()
    )


def count_dirty(conn: Connection, binding: str) -> int:
    return int(
        conn.execute(
            select(func.count()).where(c.binding_name == binding, c.dirty_pending == 1)
        ).scalar_one()
    )
