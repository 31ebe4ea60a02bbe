"""Experience: consumes recorded items in bounded batches (partial progress per invocation).

Domain tables (migration ``0002``):

- ``experience_items(scope_id, position, payload)``: recorded interactions, ordered per Scope.
- ``experience_progress(scope_id, item_head, consumed_through, batch_count,
  supervisor_generation)``: the Cursor; ``(consumed_through, batch_count)`` is the progress CAS.
- ``experience_records(scope_id, batch_no, item_from, item_through, digest,
  supervisor_generation)``: one distilled record per batch. ``(scope_id, batch_no)`` is the
  idempotency key: a repeated invocation can never write a batch twice.

An invocation consumes at most ``BATCH_ITEMS`` items (``EXPERIENCE_BATCH_ITEMS``), commits the
record, the progress and the acknowledgment in one fenced transaction, and marks the snapshot
clean only when the batch drained everything up to the snapshot. Remaining items stay ordinary
dirty work for the next interval (RFC acceptance 4).
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
    digest,
    finish_without_work,
    int_setting,
)
from apsup.registry import Family, family
from apsup.store import intents as _intents

log = logging.getLogger(__name__)

NAME = "experience"
PREFIX = "EXPERIENCE"
BATCH_ITEMS = 20
RECONCILE_PAGE = 200

metadata = MetaData()

experience_items = Table(
    "experience_items",
    metadata,
    Column("scope_id", SCOPE, primary_key=True),
    Column("position", BigInteger, primary_key=True, autoincrement=False),
    Column("payload", Text, nullable=False),
)

experience_progress = Table(
    "experience_progress",
    metadata,
    Column("scope_id", SCOPE, primary_key=True),
    Column("item_head", BigInteger, nullable=False, server_default=text("0")),
    Column("consumed_through", BigInteger, nullable=False, server_default=text("0")),
    Column("batch_count", BigInteger, nullable=False, server_default=text("0")),
    Column("supervisor_generation", BigInteger, nullable=False, server_default=text("0")),
)

experience_records = Table(
    "experience_records",
    metadata,
    Column("scope_id", SCOPE, primary_key=True),
    Column("batch_no", BigInteger, primary_key=True, autoincrement=False),
    Column("item_from", BigInteger, nullable=False),
    Column("item_through", BigInteger, nullable=False),
    Column("digest", String(DIGEST_LENGTH), nullable=False),
    Column("supervisor_generation", BigInteger, nullable=False),
)

TABLES = (experience_items, experience_progress, experience_records)

IT, G, X = experience_items.c, experience_progress.c, experience_records.c


@dataclass(frozen=True)
class Progress:
    scope_id: str
    item_head: int
    consumed_through: int
    batch_count: int


def read_progress(conn: Connection, scope_id: str) -> Progress | None:
    row = conn.execute(
        select(G.scope_id, G.item_head, G.consumed_through, G.batch_count).where(
            G.scope_id == scope_id
        )
    ).first()
    return None if row is None else Progress(row[0], int(row[1]), int(row[2]), int(row[3]))


def record_item(conn: Connection, scope_id: str, payload: str) -> int:
    """Record an item and mark the Scope dirty in ``conn``'s transaction; returns its position."""
    if not isinstance(payload, str):
        raise DomainError("experience payload must be a string")
    _intents.check_scope_id(scope_id)
    if conn.execute(select(G.scope_id).where(G.scope_id == scope_id)).first() is None:
        try:
            with conn.begin_nested():
                conn.execute(insert(experience_progress).values(scope_id=scope_id))
        except Exception as exc:  # a concurrent first recorder won
            if "Duplicate" not in str(exc) and "UNIQUE" not in str(exc):
                raise
    conn.execute(
        update(experience_progress).where(G.scope_id == scope_id).values(item_head=G.item_head + 1)
    )
    position = int(conn.execute(select(G.item_head).where(G.scope_id == scope_id)).scalar_one())
    conn.execute(
        insert(experience_items).values(scope_id=scope_id, position=position, payload=payload)
    )
    process_experience.mark_dirty(conn, scope_id)
    return position


def list_records(conn: Connection, scope_id: str) -> list[dict[str, Any]]:
    rows = conn.execute(
        select(X.batch_no, X.item_from, X.item_through, X.digest, X.supervisor_generation)
        .where(X.scope_id == scope_id)
        .order_by(X.batch_no)
    )
    return [dict(r._mapping) for r in rows]


@family(NAME, interval=900, max_workers=2, timeout=1800)
def process_experience(scope_id: str, ctx: ExecutionContext) -> None:
    """Consume at most one batch of ``BATCH_ITEMS`` items; clean only when drained."""
    if ctx.already_handled():
        return
    limit = int_setting(ctx, PREFIX, "BATCH_ITEMS", BATCH_ITEMS)
    with ctx.backend.read() as conn:
        dirty_g = ctx.dirty_generation(conn)  # before the domain facts (see topic_memory)
        progress = read_progress(conn, scope_id)
        items: list[tuple[int, str]] = []
        if progress is not None and progress.item_head > progress.consumed_through:
            items = [
                (int(p), body)
                for p, body in conn.execute(
                    select(IT.position, IT.payload)
                    .where(
                        IT.scope_id == scope_id,
                        IT.position > progress.consumed_through,
                        IT.position <= progress.item_head,
                    )
                    .order_by(IT.position)
                    .limit(limit)
                )
            ]
    if progress is None or not items:
        finish_without_work(ctx, dirty_g)
        return

    # Distil outside the transaction (deterministic stand-in for a model call).
    through = items[-1][0]
    batch_no = progress.batch_count + 1
    record_digest = digest((body for _, body in items), seed=f"{scope_id}:{batch_no}")
    with ctx.fenced() as conn:
        moved = conn.execute(
            update(experience_progress)
            .where(
                G.scope_id == scope_id,
                G.consumed_through == progress.consumed_through,
                G.batch_count == progress.batch_count,
            )
            .values(
                consumed_through=through,
                batch_count=batch_no,
                supervisor_generation=ctx.supervisor_generation,
            )
        ).rowcount
        if moved != 1:
            raise ProgressConflict(f"{NAME}: scope {scope_id!r} progress moved past {batch_no - 1}")
        conn.execute(
            insert(experience_records).values(
                scope_id=scope_id,
                batch_no=batch_no,
                item_from=items[0][0],
                item_through=through,
                digest=record_digest,
                supervisor_generation=ctx.supervisor_generation,
            )
        )
        if through >= progress.item_head:
            ctx.mark_clean(conn, dirty_g)
        ctx.acknowledge(conn)
    log.info("experience scope=%s batch=%d items=%d..%d", scope_id, batch_no, items[0][0], through)


@process_experience.reconciler
def reconcile_experience(conn: Connection, fam: Family, token: Any) -> Any:
    """One page of Scopes with unconsumed items -> dirty (never a request)."""
    stmt = select(G.scope_id).where(G.item_head > G.consumed_through)
    if token is not None:
        stmt = stmt.where(G.scope_id > str(token))
    scopes = [r[0] for r in conn.execute(stmt.order_by(G.scope_id).limit(RECONCILE_PAGE))]
    for scope_id in scopes:
        row = _intents.get(conn, fam.binding_name, scope_id)
        if row is None or not row.dirty:
            fam.mark_dirty(conn, scope_id)
    return scopes[-1] if len(scopes) == RECONCILE_PAGE else None


def count_items(conn: Connection, scope_id: str) -> int:
    return int(conn.execute(select(func.count()).where(IT.scope_id == scope_id)).scalar_one())


FAMILY = process_experience
