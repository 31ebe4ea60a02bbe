"""Topic Memory: an ordered Source journal per Scope folded into numbered Revisions.

Domain tables (created by migration ``0002``; the legacy PR #1490 tables share these shapes):

- ``topic_sources(scope_id, position, body)``: the ordered journal. Positions are 1, 2, 3...
  per Scope, drawn from ``topic_cursors.source_head`` in the appending transaction.
- ``topic_cursors(scope_id, source_head, source_through, head_revision, supervisor_generation)``:
  ``source_head`` is the last appended position, ``source_through`` the last position covered
  by a Revision, ``head_revision`` the current Revision number (the Head CAS guard).
- ``topic_revisions(scope_id, revision, source_from, source_through, summary,
  supervisor_generation)``: one row per committed window.
- ``topic_poison(scope_id, position)``: a test/ops hook that makes a position fail.

Domain API (each call runs inside the caller's own transaction, so input and intent commit
together or not at all): ``append_source``, ``flush``, ``read_cursor``, ``list_revisions``.

The processor reads a snapshot (dirty generation first, then the cursor), selects its own
window of at most ``WINDOW_SOURCES`` Sources / ``WINDOW_BYTES`` bytes after the cursor, builds
the Revision outside any transaction, and commits it in one short fenced transaction with a Head
CAS. It repeats for at most ``WINDOWS_PER_INVOCATION`` windows; the transaction of the last
window also acknowledges the invocation and, if everything up to the snapshot is covered, marks
the snapshot's dirty generation clean. A failing position stops progress before it: later
Sources never overtake it. Bodies are never logged nor put in exceptions.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from sqlalchemy import (
    BigInteger,
    Column,
    Connection,
    MetaData,
    String,
    Table,
    Text,
    and_,
    func,
    insert,
    select,
    text,
    update,
)

from apsup.context import ExecutionContext
from apsup.errors import ProgressConflict
from apsup.families._common import (
    DIGEST_LENGTH,
    SCOPE,
    DomainError,
    SourceFailure,
    digest,
    finish_without_work,
    int_setting,
)
from apsup.registry import Family, family
from apsup.store import intents as _intents

log = logging.getLogger(__name__)

NAME = "topic-memory"
PREFIX = "TOPIC_MEMORY"
WINDOW_SOURCES = 50
WINDOW_BYTES = 256 * 1024
WINDOWS_PER_INVOCATION = 4
RECONCILE_PAGE = 200

metadata = MetaData()

topic_sources = Table(
    "topic_sources",
    metadata,
    Column("scope_id", SCOPE, primary_key=True),
    Column("position", BigInteger, primary_key=True, autoincrement=False),
    Column("body", Text, nullable=False),
)

topic_cursors = Table(
    "topic_cursors",
    metadata,
    Column("scope_id", SCOPE, primary_key=True),
    Column("source_head", BigInteger, nullable=False, server_default=text("0")),
    Column("source_through", BigInteger, nullable=False, server_default=text("0")),
    Column("head_revision", BigInteger, nullable=False, server_default=text("0")),
    Column("supervisor_generation", BigInteger, nullable=False, server_default=text("0")),
)

topic_revisions = Table(
    "topic_revisions",
    metadata,
    Column("scope_id", SCOPE, primary_key=True),
    Column("revision", BigInteger, primary_key=True, autoincrement=False),
    Column("source_from", BigInteger, nullable=False),
    Column("source_through", BigInteger, nullable=False),
    Column("summary", String(DIGEST_LENGTH), nullable=False),
    Column("supervisor_generation", BigInteger, nullable=False),
)

topic_poison = Table(
    "topic_poison",
    metadata,
    Column("scope_id", SCOPE, primary_key=True),
    Column("position", BigInteger, primary_key=True, autoincrement=False),
)

TABLES = (topic_sources, topic_cursors, topic_revisions, topic_poison)

S, C, R, P = topic_sources.c, topic_cursors.c, topic_revisions.c, topic_poison.c


@dataclass(frozen=True)
class Cursor:
    scope_id: str
    source_head: int
    source_through: int
    head_revision: int

    @property
    def uncovered(self) -> int:
        return self.source_head - self.source_through


# -- domain API (caller's transaction) --------------------------------------------------------


def _ensure_cursor(conn: Connection, scope_id: str) -> None:
    """Create the Cursor row on first use (a concurrent creator may win: that is fine)."""
    exists = conn.execute(select(C.scope_id).where(C.scope_id == scope_id)).first()
    if exists is not None:
        return
    # Sources may predate the cursor row (legacy journals): start the head after them.
    head = conn.execute(
        select(func.coalesce(func.max(S.position), 0)).where(S.scope_id == scope_id)
    ).scalar_one()
    try:
        with conn.begin_nested():
            conn.execute(insert(topic_cursors).values(scope_id=scope_id, source_head=int(head)))
    except Exception as exc:  # lost the race for the first insert
        if "Duplicate" not in str(exc) and "UNIQUE" not in str(exc):
            raise


def read_cursor(conn: Connection, scope_id: str) -> Cursor | None:
    row = conn.execute(
        select(C.scope_id, C.source_head, C.source_through, C.head_revision).where(
            C.scope_id == scope_id
        )
    ).first()
    if row is None:
        return None
    return Cursor(row[0], int(row[1]), int(row[2]), int(row[3]))


def append_source(conn: Connection, scope_id: str, body: str) -> int:
    """Append a Source to the Scope's journal and mark the Scope dirty, in ``conn``'s
    transaction. Returns the new position."""
    if not isinstance(body, str):
        raise DomainError("topic source body must be a string")
    _intents.check_scope_id(scope_id)
    _ensure_cursor(conn, scope_id)
    # The row lock on the cursor serialises appenders of one Scope (SQLite: BEGIN IMMEDIATE).
    conn.execute(
        update(topic_cursors).where(C.scope_id == scope_id).values(source_head=C.source_head + 1)
    )
    position = int(conn.execute(select(C.source_head).where(C.scope_id == scope_id)).scalar_one())
    conn.execute(insert(topic_sources).values(scope_id=scope_id, position=position, body=body))
    process_topic_memory.mark_dirty(conn, scope_id)
    return position


def flush(conn: Connection, scope_id: str) -> str:
    """Explicit flush: ``"accepted"`` (request persisted in ``conn``'s transaction) when the
    Scope has Sources not yet covered by a Revision, else ``"idle"`` (nothing written)."""
    _intents.check_scope_id(scope_id)
    cursor = read_cursor(conn, scope_id)
    if cursor is None or cursor.uncovered <= 0:
        return "idle"
    process_topic_memory.request(conn, scope_id)
    return "accepted"


def list_revisions(conn: Connection, scope_id: str) -> list[dict[str, Any]]:
    rows = conn.execute(
        select(R.revision, R.source_from, R.source_through, R.summary, R.supervisor_generation)
        .where(R.scope_id == scope_id)
        .order_by(R.revision)
    )
    return [dict(r._mapping) for r in rows]


# -- processor --------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Window:
    source_from: int
    source_through: int
    summary: str
    poisoned_at: int | None  # a failing position right after this window, if any


def _previous_summary(conn: Connection, scope_id: str, revision: int) -> str:
    if revision == 0:
        return ""
    value = conn.execute(
        select(R.summary).where(R.scope_id == scope_id, R.revision == revision)
    ).scalar_one_or_none()
    return value or ""


def _select_window(
    conn: Connection, scope_id: str, after: int, upto: int, max_sources: int, max_bytes: int
) -> tuple[list[tuple[int, str]], int | None]:
    """Sources in (after, upto], at most ``max_sources``/``max_bytes`` (never fewer than one),
    stopping before the first poisoned position (returned separately)."""
    poison = conn.execute(
        select(func.min(P.position)).where(
            P.scope_id == scope_id, P.position > after, P.position <= upto
        )
    ).scalar_one()
    limit_through = upto if poison is None else int(poison) - 1
    rows = conn.execute(
        select(S.position, S.body)
        .where(S.scope_id == scope_id, S.position > after, S.position <= limit_through)
        .order_by(S.position)
        .limit(max_sources)
    ).all()
    window: list[tuple[int, str]] = []
    size = 0
    for position, body in rows:
        size += len(body.encode())
        if window and size > max_bytes:
            break
        window.append((int(position), body))
    if poison is None:
        return window, None
    reaches = (window[-1][0] if window else after) >= int(poison) - 1 or not rows
    return window, (int(poison) if reaches else None)


@family(NAME, interval=300, max_workers=4, timeout=600)
def process_topic_memory(scope_id: str, ctx: ExecutionContext) -> None:
    """One Scope invocation: fold up to ``WINDOWS_PER_INVOCATION`` windows into Revisions."""
    if ctx.already_handled():
        # A duplicate of an acknowledged G consumes no new input (RFC §5).
        return
    max_sources = int_setting(ctx, PREFIX, "WINDOW_SOURCES", WINDOW_SOURCES)
    max_bytes = int_setting(ctx, PREFIX, "WINDOW_BYTES", WINDOW_BYTES)
    max_windows = int_setting(ctx, PREFIX, "WINDOWS_PER_INVOCATION", WINDOWS_PER_INVOCATION)

    # Snapshot. The dirty generation is read BEFORE the cursor: a Source and its dirty mark
    # commit together, so every Source behind the generation read is visible afterwards.
    with ctx.backend.read() as conn:
        dirty_g = ctx.dirty_generation(conn)
        cursor = read_cursor(conn, scope_id)
    if cursor is None or cursor.uncovered <= 0:
        finish_without_work(ctx, dirty_g)
        return
    snapshot_head = cursor.source_head
    through, revision = cursor.source_through, cursor.head_revision

    for n in range(1, max_windows + 1):
        # Select and build outside any write transaction.
        with ctx.backend.read() as conn:
            sources, poisoned = _select_window(
                conn, scope_id, through, snapshot_head, max_sources, max_bytes
            )
            previous = _previous_summary(conn, scope_id, revision)
        if not sources:
            if poisoned is None:
                raise DomainError(f"{NAME}: scope {scope_id!r} journal has a gap after {through}")
            raise SourceFailure(NAME, scope_id, poisoned)
        window = _Window(
            source_from=sources[0][0],
            source_through=sources[-1][0],
            summary=digest((body for _, body in sources), seed=previous),
            poisoned_at=poisoned,
        )
        drained = window.source_through >= snapshot_head
        last = drained or n == max_windows or window.poisoned_at is not None
        with ctx.fenced() as conn:
            moved = conn.execute(
                update(topic_cursors)
                .where(
                    and_(
                        C.scope_id == scope_id,
                        C.head_revision == revision,
                        C.source_through == through,
                    )
                )
                .values(
                    source_through=window.source_through,
                    head_revision=revision + 1,
                    supervisor_generation=ctx.supervisor_generation,
                )
            ).rowcount
            if moved != 1:
                raise ProgressConflict(
                    f"{NAME}: scope {scope_id!r} head moved past revision {revision}"
                )
            conn.execute(
                insert(topic_revisions).values(
                    scope_id=scope_id,
                    revision=revision + 1,
                    source_from=window.source_from,
                    source_through=window.source_through,
                    summary=window.summary,
                    supervisor_generation=ctx.supervisor_generation,
                )
            )
            if drained:
                ctx.mark_clean(conn, dirty_g)
            if last and window.poisoned_at is None:
                ctx.acknowledge(conn)
        log.info(
            "topic-memory scope=%s revision=%d sources=%d..%d",
            scope_id,
            revision + 1,
            window.source_from,
            window.source_through,
        )
        through, revision = window.source_through, revision + 1
        if window.poisoned_at is not None:
            raise SourceFailure(NAME, scope_id, window.poisoned_at)
        if last:
            return


# -- reconciliation ---------------------------------------------------------------------------


@process_topic_memory.reconciler
def reconcile_topic_memory(conn: Connection, fam: Family, token: Any) -> Any:
    """One page of Scopes whose journal runs beyond the cursor -> ordinary dirty state.

    Never ``request()``: reconstruction neither accepts work nor bypasses a disabled schedule.
    Returns the last Scope of the page as the next token, or None when done.
    """
    stmt = select(C.scope_id).where(C.source_head > C.source_through)
    if token is not None:
        stmt = stmt.where(C.scope_id > str(token))
    scopes = [r[0] for r in conn.execute(stmt.order_by(C.scope_id).limit(RECONCILE_PAGE))]
    for scope_id in scopes:
        row = _intents.get(conn, fam.binding_name, scope_id)
        if row is None or not row.dirty:
            fam.mark_dirty(conn, scope_id)
    return scopes[-1] if len(scopes) == RECONCILE_PAGE else None


FAMILY = process_topic_memory
