"""Handoff: explicit requests only (automatic admission disabled) -> one Handoff Report each.

Domain tables (migration ``0002``):

- ``handoff_requests(scope_id, request_generation, payload_ref, principal, requested_at)``: the
  input reference, stored in the same transaction that advances the requested generation, so the
  accepted request and its input commit together (RFC §3, §5).
- ``handoff_reports(scope_id, request_generation, payload_ref, report, supervisor_generation,
  created_at)``: PRIMARY KEY ``(scope_id, request_generation)`` is the idempotency key: a
  retried or duplicated invocation can never produce a second report for one request.
- ``handoff_access(scope_id, principal, allowed)``: which principals may request a Handoff of a
  Scope. The API checks it before accepting anything (the authorization boundary).

Handoff Reports are results, not a new Artifact Family: the family here is the processor that
produces them.
"""

from __future__ import annotations

import logging
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    Connection,
    MetaData,
    String,
    Table,
    insert,
    select,
)

from apsup.context import ExecutionContext
from apsup.families._common import (
    DIGEST_LENGTH,
    SCOPE,
    AuthorizationDenied,
    DomainError,
    Timestamp,
    digest,
    int_setting,
    utcnow,
)
from apsup.registry import family
from apsup.store import intents as _intents
from apsup.store.schema import Identifier

log = logging.getLogger(__name__)

NAME = "handoff"
PREFIX = "HANDOFF"
PAGE = 50
PAYLOAD_REF_LENGTH = 512
PRINCIPAL_LENGTH = 128
#: Byte-exact on MySQL too: a grant to ``Alice`` must not admit ``alice`` or ``"alice "``.
PRINCIPAL = Identifier(PRINCIPAL_LENGTH)

metadata = MetaData()

handoff_requests = Table(
    "handoff_requests",
    metadata,
    Column("scope_id", SCOPE, primary_key=True),
    Column("request_generation", BigInteger, primary_key=True, autoincrement=False),
    Column("payload_ref", String(PAYLOAD_REF_LENGTH), nullable=False),
    Column("principal", PRINCIPAL, nullable=True),
    Column("requested_at", Timestamp, nullable=False),
)

handoff_reports = Table(
    "handoff_reports",
    metadata,
    Column("scope_id", SCOPE, primary_key=True),
    Column("request_generation", BigInteger, primary_key=True, autoincrement=False),
    Column("payload_ref", String(PAYLOAD_REF_LENGTH), nullable=False),
    Column("report", String(DIGEST_LENGTH), nullable=False),
    Column("supervisor_generation", BigInteger, nullable=False),
    Column("created_at", Timestamp, nullable=False),
)

handoff_access = Table(
    "handoff_access",
    metadata,
    Column("scope_id", SCOPE, primary_key=True),
    Column("principal", PRINCIPAL, primary_key=True),
    Column("allowed", Boolean, nullable=False),
)

TABLES = (handoff_requests, handoff_reports, handoff_access)

Q, RP, A = handoff_requests.c, handoff_reports.c, handoff_access.c


def grant(conn: Connection, scope_id: str, principal: str, allowed: bool = True) -> None:
    """Allow (or explicitly deny) ``principal`` to request Handoffs of ``scope_id``."""
    cond = (A.scope_id == scope_id) & (A.principal == principal)
    if conn.execute(handoff_access.update().where(cond).values(allowed=allowed)).rowcount == 0:
        conn.execute(
            insert(handoff_access).values(scope_id=scope_id, principal=principal, allowed=allowed)
        )


def _authorize(conn: Connection, scope_id: str, principal: str) -> None:
    allowed = conn.execute(
        select(A.allowed).where(A.scope_id == scope_id, A.principal == principal)
    ).scalar_one_or_none()
    if not allowed:
        raise AuthorizationDenied(
            f"{NAME}: principal {principal!r} may not request a handoff of scope {scope_id!r}"
        )


def request_handoff(
    conn: Connection, scope_id: str, payload_ref: str, *, principal: str | None = None
) -> int:
    """Accept a Handoff request in ``conn``'s transaction; returns its request generation.

    ``principal`` is the caller to authorise against ``handoff_access`` (deny by default);
    ``None`` means the trusted Runtime service identity, which the deployment already
    authorised. A denial raises ``AuthorizationDenied`` before anything is written.
    """
    _intents.check_scope_id(scope_id)
    if not isinstance(payload_ref, str) or not payload_ref or len(payload_ref) > PAYLOAD_REF_LENGTH:
        raise DomainError(
            f"payload_ref must be a non-empty reference of at most {PAYLOAD_REF_LENGTH} characters"
        )
    if principal is not None:
        _authorize(conn, scope_id, principal)
    generation = process_handoff.request(conn, scope_id)
    conn.execute(
        insert(handoff_requests).values(
            scope_id=scope_id,
            request_generation=generation,
            payload_ref=payload_ref,
            principal=principal,
            requested_at=utcnow(),
        )
    )
    return generation


def reports(conn: Connection, scope_id: str) -> list[dict[str, Any]]:
    rows = conn.execute(
        select(RP.request_generation, RP.payload_ref, RP.report, RP.supervisor_generation)
        .where(RP.scope_id == scope_id)
        .order_by(RP.request_generation)
    )
    return [dict(r._mapping) for r in rows]


def _unreported(conn: Connection, scope_id: str, upto: int, limit: int) -> list[tuple[int, str]]:
    """Requests with generation <= ``upto`` that have no report yet, oldest first."""
    done = select(RP.request_generation).where(
        RP.scope_id == scope_id, RP.request_generation == Q.request_generation
    )
    rows = conn.execute(
        select(Q.request_generation, Q.payload_ref)
        .where(Q.scope_id == scope_id, Q.request_generation <= upto, ~done.exists())
        .order_by(Q.request_generation)
        .limit(limit)
    )
    return [(int(g), ref) for g, ref in rows]


@family(NAME, max_workers=2, timeout=600)
def process_handoff(scope_id: str, ctx: ExecutionContext) -> None:
    """Produce the Handoff Report of every request up to the claimed generation G."""
    if ctx.already_handled():
        return
    page = int_setting(ctx, PREFIX, "PAGE", PAGE)
    upto = ctx.claimed_request_generation
    while True:
        with ctx.backend.read() as conn:
            todo = _unreported(conn, scope_id, upto, page)
        # Build outside the transaction (deterministic stand-in for preparing a handoff).
        built = [
            (g, ref, digest([scope_id, str(g), ref], seed="handoff-report")) for g, ref in todo
        ]
        last = len(todo) < page
        with ctx.fenced() as conn:
            existing = {
                int(g)
                for (g,) in conn.execute(
                    select(RP.request_generation).where(
                        RP.scope_id == scope_id,
                        RP.request_generation.in_([g for g, _, _ in built] or [-1]),
                    )
                )
            }
            now = utcnow()
            for g, ref, report in built:
                if g in existing:
                    continue  # an earlier (possibly stale) attempt already reported it
                conn.execute(
                    insert(handoff_reports).values(
                        scope_id=scope_id,
                        request_generation=g,
                        payload_ref=ref,
                        report=report,
                        supervisor_generation=ctx.supervisor_generation,
                        created_at=now,
                    )
                )
            if last:
                ctx.acknowledge(conn)
        if built:
            log.info(
                "handoff scope=%s reports for generations %d..%d",
                scope_id,
                built[0][0],
                built[-1][0],
            )
        if last:
            return


FAMILY = process_handoff
