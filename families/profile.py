"""Profile: a daily cron turns new Sources into a Candidate that awaits Review.

Domain tables (migration ``0002``; the pre-Supervisor Profile shipped the same shapes):

- ``profile_sources(scope_id, position, body)``: observations about the Scope, ordered.
- ``profile_cursors(scope_id, source_head, source_through, last_fire, supervisor_generation)``:
  ``source_through`` is the last position captured by a Candidate, ``last_fire`` the cron fire
  that produced it. ``(source_through, last_fire)`` is the progress CAS.
- ``profile_policies(scope_id, enabled)``: the Scope's Policy; no row means enabled.
- ``profile_candidates(candidate_id, scope_id, cron_fire, status, source_from, source_through,
  content, supervisor_generation, created_at, reviewed_at)``: ``status`` is ``pending_review``,
  ``approved`` or ``rejected``; UNIQUE ``(scope_id, cron_fire)``: one fire never yields two
  Candidates, whatever restarts or duplicate invocations happen.
- ``profile_published(scope_id, version, candidate_id, content, published_at)``: the published
  profile; written only by an approving ``review``.
- ``profile_access(scope_id, allowed)``: authorization of the trusted background Principal for
  the Scope; ``allowed = false`` makes the processor raise ``AuthorizationDenied`` (no row means
  allowed).

The fire an invocation works for is durable state, not the wall clock of the Worker: the
binding's ``last_schedule_checkpoint_at`` (the cron fire the Supervisor admitted, RFC §4), or, for
an invocation before any automatic check, the latest fire of the family's cron at database time.
A Scope with a pending Candidate produces nothing new until Review; ``review`` marks the Scope
dirty again when Sources arrived meanwhile.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    Connection,
    MetaData,
    String,
    Table,
    Text,
    UniqueConstraint,
    insert,
    select,
    text,
    true,
    update,
)

from apsup.context import ExecutionContext
from apsup.errors import ProgressConflict
from apsup.families._common import (
    DIGEST_LENGTH,
    SCOPE,
    AuthorizationDenied,
    DomainError,
    Timestamp,
    digest,
    finish_without_work,
    int_setting,
    utcnow,
)
from apsup.policy import Cron
from apsup.registry import family
from apsup.store import intents as _intents
from apsup.store import scans as _scans

log = logging.getLogger(__name__)

NAME = "profile"
PREFIX = "PROFILE"
CRON = "0 2 * * *"
TIMEZONE = "Asia/Shanghai"
MAX_SOURCES = 200

PENDING = "pending_review"
APPROVED = "approved"
REJECTED = "rejected"

metadata = MetaData()

profile_sources = Table(
    "profile_sources",
    metadata,
    Column("scope_id", SCOPE, primary_key=True),
    Column("position", BigInteger, primary_key=True, autoincrement=False),
    Column("body", Text, nullable=False),
)

profile_cursors = Table(
    "profile_cursors",
    metadata,
    Column("scope_id", SCOPE, primary_key=True),
    Column("source_head", BigInteger, nullable=False, server_default=text("0")),
    Column("source_through", BigInteger, nullable=False, server_default=text("0")),
    Column("last_fire", Timestamp, nullable=True),
    Column("supervisor_generation", BigInteger, nullable=False, server_default=text("0")),
)

profile_policies = Table(
    "profile_policies",
    metadata,
    Column("scope_id", SCOPE, primary_key=True),
    Column("enabled", Boolean, nullable=False, server_default=true()),
)

profile_candidates = Table(
    "profile_candidates",
    metadata,
    Column("candidate_id", String(DIGEST_LENGTH), primary_key=True),
    Column("scope_id", SCOPE, nullable=False),
    Column("cron_fire", Timestamp, nullable=False),
    Column("status", String(32), nullable=False),
    Column("source_from", BigInteger, nullable=False),
    Column("source_through", BigInteger, nullable=False),
    Column("content", String(DIGEST_LENGTH), nullable=False),
    Column("supervisor_generation", BigInteger, nullable=False),
    Column("created_at", Timestamp, nullable=False),
    Column("reviewed_at", Timestamp, nullable=True),
    UniqueConstraint("scope_id", "cron_fire", name="uq_profile_candidates_fire"),
)

profile_published = Table(
    "profile_published",
    metadata,
    Column("scope_id", SCOPE, primary_key=True),
    Column("version", BigInteger, nullable=False),
    Column("candidate_id", String(DIGEST_LENGTH), nullable=False),
    Column("content", String(DIGEST_LENGTH), nullable=False),
    Column("published_at", Timestamp, nullable=False),
)

profile_access = Table(
    "profile_access",
    metadata,
    Column("scope_id", SCOPE, primary_key=True),
    Column("allowed", Boolean, nullable=False),
)

TABLES = (
    profile_sources,
    profile_cursors,
    profile_policies,
    profile_candidates,
    profile_published,
    profile_access,
)

S, C, PO = profile_sources.c, profile_cursors.c, profile_policies.c
K, PU, A = profile_candidates.c, profile_published.c, profile_access.c


@dataclass(frozen=True)
class Cursor:
    scope_id: str
    source_head: int
    source_through: int
    last_fire: datetime | None


def read_cursor(conn: Connection, scope_id: str) -> Cursor | None:
    row = conn.execute(
        select(C.scope_id, C.source_head, C.source_through, C.last_fire).where(
            C.scope_id == scope_id
        )
    ).first()
    return None if row is None else Cursor(row[0], int(row[1]), int(row[2]), row[3])


def policy_enabled(conn: Connection, scope_id: str) -> bool:
    value = conn.execute(select(PO.enabled).where(PO.scope_id == scope_id)).scalar_one_or_none()
    return True if value is None else bool(value)


def access_allowed(conn: Connection, scope_id: str) -> bool:
    value = conn.execute(select(A.allowed).where(A.scope_id == scope_id)).scalar_one_or_none()
    return True if value is None else bool(value)


def pending_candidate(conn: Connection, scope_id: str) -> str | None:
    return conn.execute(
        select(K.candidate_id).where(K.scope_id == scope_id, K.status == PENDING).limit(1)
    ).scalar_one_or_none()


def _upsert(conn: Connection, table: Any, key: dict[str, Any], values: dict[str, Any]) -> None:
    cond = [table.c[k] == v for k, v in key.items()]
    if conn.execute(update(table).where(*cond).values(values)).rowcount == 0:
        conn.execute(insert(table).values({**key, **values}))


# -- domain API (caller's transaction) --------------------------------------------------------


def add_source(conn: Connection, scope_id: str, body: str) -> int:
    """Append a profile Source and mark the Scope dirty; returns its position."""
    if not isinstance(body, str):
        raise DomainError("profile source body must be a string")
    _intents.check_scope_id(scope_id)
    if read_cursor(conn, scope_id) is None:
        try:
            with conn.begin_nested():
                conn.execute(insert(profile_cursors).values(scope_id=scope_id))
        except Exception as exc:
            if "Duplicate" not in str(exc) and "UNIQUE" not in str(exc):
                raise
    conn.execute(
        update(profile_cursors).where(C.scope_id == scope_id).values(source_head=C.source_head + 1)
    )
    position = int(conn.execute(select(C.source_head).where(C.scope_id == scope_id)).scalar_one())
    conn.execute(insert(profile_sources).values(scope_id=scope_id, position=position, body=body))
    process_profile.mark_dirty(conn, scope_id)
    return position


def _redirty_if_uncovered(conn: Connection, scope_id: str) -> None:
    cursor = read_cursor(conn, scope_id)
    if cursor is not None and cursor.source_head > cursor.source_through:
        process_profile.mark_dirty(conn, scope_id)


def set_policy(conn: Connection, scope_id: str, enabled: bool) -> None:
    """Enable/disable automatic profile generation for a Scope (re-enabling re-marks dirty)."""
    _intents.check_scope_id(scope_id)
    _upsert(conn, profile_policies, {"scope_id": scope_id}, {"enabled": bool(enabled)})
    if enabled:
        _redirty_if_uncovered(conn, scope_id)


def set_access(conn: Connection, scope_id: str, allowed: bool) -> None:
    """Grant or revoke the background Principal's access to a Scope."""
    _intents.check_scope_id(scope_id)
    _upsert(conn, profile_access, {"scope_id": scope_id}, {"allowed": bool(allowed)})
    if allowed:
        _redirty_if_uncovered(conn, scope_id)


def review(conn: Connection, candidate_id: str, approve: bool) -> str:
    """Review a pending Candidate: approve publishes it, reject only records the decision.

    Repeating the same decision is a no-op returning the status; a conflicting one raises.
    Nothing is published without approval (the Review boundary).
    """
    row = conn.execute(
        select(K.scope_id, K.status, K.content)
        .where(K.candidate_id == candidate_id)
        .with_for_update()
    ).first()
    if row is None:
        raise DomainError(f"profile candidate {candidate_id!r} does not exist")
    scope_id, status, content = row
    decided = APPROVED if approve else REJECTED
    if status != PENDING:
        if status == decided:
            return str(status)
        raise DomainError(f"profile candidate {candidate_id!r} was already {status}")
    now = utcnow()
    moved = conn.execute(
        update(profile_candidates)
        .where(K.candidate_id == candidate_id, K.status == PENDING)
        .values(status=decided, reviewed_at=now)
    ).rowcount
    if moved != 1:  # pragma: no cover - the row lock above makes this unreachable
        raise DomainError(f"profile candidate {candidate_id!r} changed during review")
    if approve:
        current = conn.execute(
            select(PU.version).where(PU.scope_id == scope_id).with_for_update()
        ).scalar_one_or_none()
        _upsert(
            conn,
            profile_published,
            {"scope_id": scope_id},
            {
                "version": (current or 0) + 1,
                "candidate_id": candidate_id,
                "content": content,
                "published_at": now,
            },
        )
    _redirty_if_uncovered(conn, scope_id)
    return decided


def candidates(conn: Connection, scope_id: str) -> list[dict[str, Any]]:
    rows = conn.execute(
        select(
            K.candidate_id,
            K.cron_fire,
            K.status,
            K.source_from,
            K.source_through,
            K.content,
            K.supervisor_generation,
        )
        .where(K.scope_id == scope_id)
        .order_by(K.cron_fire)
    )
    return [dict(r._mapping) for r in rows]


def published(conn: Connection, scope_id: str) -> dict[str, Any] | None:
    row = conn.execute(
        select(PU.version, PU.candidate_id, PU.content).where(PU.scope_id == scope_id)
    ).first()
    return None if row is None else dict(row._mapping)


def candidate_id_for(scope_id: str, fire: datetime) -> str:
    return digest([scope_id, fire.isoformat()], seed="profile-candidate")


# -- processor --------------------------------------------------------------------------------


def current_fire(conn: Connection, ctx: ExecutionContext) -> datetime:
    """The cron fire this invocation works for, from durable state (see module docstring)."""
    state = _scans.get_state(conn, ctx.binding_name)
    if state is not None and state.checkpoint is not None:
        return state.checkpoint.replace(tzinfo=None)
    now = ctx.backend.now()
    policy = process_profile.policy
    if isinstance(policy, Cron):
        fire = policy.latest_fire_at_or_before(now)
        if fire is not None:
            return fire
    return now.replace(microsecond=0)


@family(NAME, cron=CRON, timezone=TIMEZONE, max_workers=4, timeout=600)
def process_profile(scope_id: str, ctx: ExecutionContext) -> None:
    """Produce at most one pending Candidate per (Scope, cron fire)."""
    if ctx.already_handled():
        return
    limit = int_setting(ctx, PREFIX, "MAX_SOURCES", MAX_SOURCES)
    with ctx.backend.read() as conn:
        dirty_g = ctx.dirty_generation(conn)  # before the domain facts
        # The trusted background Principal is authorised per actual Scope, every invocation.
        if not access_allowed(conn, scope_id):
            raise AuthorizationDenied(
                f"{NAME}: the background principal may not process scope {scope_id!r}"
            )
        enabled = policy_enabled(conn, scope_id)
        cursor = read_cursor(conn, scope_id)
        waiting = pending_candidate(conn, scope_id)
        fire = current_fire(conn, ctx)
        # A Candidate for this fire may exist without the cursor saying so (a pre-migration
        # scheduler that crashed between its writes): the fire is spent either way.
        fire_spent = (
            cursor is not None and cursor.last_fire is not None and cursor.last_fire >= fire
        ) or (
            conn.execute(
                select(K.candidate_id).where(K.scope_id == scope_id, K.cron_fire == fire)
            ).first()
            is not None
        )
        sources: list[tuple[int, str]] = []
        if enabled and waiting is None and cursor and cursor.source_head > cursor.source_through:
            sources = [
                (int(p), b)
                for p, b in conn.execute(
                    select(S.position, S.body)
                    .where(
                        S.scope_id == scope_id,
                        S.position > cursor.source_through,
                        S.position <= cursor.source_head,
                    )
                    .order_by(S.position)
                    .limit(limit)
                )
            ]

    if cursor is None or not sources:
        # Nothing to generate: disabled Policy, a Candidate awaiting Review (review re-marks
        # dirty), or no uncovered Source. Acknowledge only the snapshot's dirty generation.
        finish_without_work(ctx, dirty_g)
        return
    if fire_spent:
        # This fire already produced its Candidate: the new Sources wait for the next fire.
        with ctx.fenced() as conn:
            ctx.acknowledge(conn)
        return

    through = sources[-1][0]
    content = digest((b for _, b in sources), seed=f"{scope_id}:{cursor.source_through}")
    candidate_id = candidate_id_for(scope_id, fire)
    with ctx.fenced() as conn:
        guard = [C.scope_id == scope_id, C.source_through == cursor.source_through]
        guard.append(
            C.last_fire.is_(None) if cursor.last_fire is None else C.last_fire == cursor.last_fire
        )
        moved = conn.execute(
            update(profile_cursors)
            .where(*guard)
            .values(
                source_through=through,
                last_fire=fire,
                supervisor_generation=ctx.supervisor_generation,
            )
        ).rowcount
        if moved != 1:
            raise ProgressConflict(f"{NAME}: scope {scope_id!r} cursor moved concurrently")
        conn.execute(
            insert(profile_candidates).values(
                candidate_id=candidate_id,
                scope_id=scope_id,
                cron_fire=fire,
                status=PENDING,
                source_from=sources[0][0],
                source_through=through,
                content=content,
                supervisor_generation=ctx.supervisor_generation,
                created_at=utcnow(),
            )
        )
        if through >= cursor.source_head:
            ctx.mark_clean(conn, dirty_g)
        ctx.acknowledge(conn)
    log.info(
        "profile scope=%s candidate for fire %s sources=%d..%d",
        scope_id,
        fire.isoformat(),
        sources[0][0],
        through,
    )


FAMILY = process_profile
