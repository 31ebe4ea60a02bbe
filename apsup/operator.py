"""Operator actions on Scopes and families, as a Python API (the ``apsup scopes`` and
``apsup families`` commands call these).

Each runs in the caller's SQLAlchemy transaction (like ``Family.request``) on the database apsup
runs on, needs no leadership, and is durable once committed: it survives restarts and leadership
changes. Every replica's leader sees it within one poll (MySQL/OceanBase: the request poll reads
each family's control version; SQLite: the commit wakes the host, and the CLI also notifies it)
and applies it under its term: clearing the one-shot retry/stop requests is a fenced write.

- ``retry(conn, fam, scope)``: a Scope waiting for its backoff is attempted at once (its failure
  count stays until it succeeds); a parked Scope stays parked.
- ``park`` / ``unpark``: a parked Scope is never dispatched; its requests are still accepted and
  kept, and run once it is unparked.
- ``stop``: ends the running invocation (SIGTERM, SIGKILL after the grace) and parks the Scope.
- ``pause`` / ``resume``: a paused family starts no new invocation on any replica; running ones
  finish.
- ``scopes(conn, fam, failing=...)``: what ``apsup scopes list`` shows.

Unknown Scopes (no intent row: never marked dirty nor requested) raise ``UnknownScope``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Connection, select

from apsup.errors import UnknownScope as UnknownScope
from apsup.registry import Family
from apsup.store import intents, operator_state
from apsup.store.intents import check_scope_id
from apsup.store.schema import intents as intents_table


@dataclass(frozen=True)
class ScopeRow:
    """One Scope as ``apsup scopes list`` shows it."""

    scope: str
    requested_generation: int
    handled_generation: int
    dirty_generation: int
    clean_generation: int
    consecutive_failures: int
    error_type: str | None
    error: str | None
    failed_at: str | None
    next_attempt_at: str | None
    parked: bool

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _now() -> datetime:
    return datetime.now(UTC).replace(tzinfo=None)


def _known(conn: Connection, fam: Family, scope_id: str) -> str:
    scope_id = check_scope_id(scope_id)
    if intents.get(conn, fam.binding_name, scope_id) is None:
        raise UnknownScope(
            f"family {fam.name!r} has no Scope {scope_id!r} (it was never marked dirty nor "
            "requested); `apsup scopes list FAMILY` shows its Scopes"
        )
    return scope_id


def retry(conn: Connection, fam: Family, scope_id: str) -> str:
    scope_id = _known(conn, fam, scope_id)
    state = operator_state.scope_state(conn, fam.binding_name, scope_id)
    if state is None or state.consecutive_failures == 0:  # no backoff to cut short
        return (
            f"{fam.name} {scope_id!r}: not failing; nothing to retry (its requests run as "
            "they come; `apsup trigger` asks for another invocation)"
        )
    operator_state.set_scope_flags(conn, fam.binding_name, scope_id, {"retry_requested": True})
    operator_state.bump(conn, fam.binding_name, at=_now())
    return f"{fam.name} {scope_id!r}: retry requested; the leader attempts it within one poll"


def park(conn: Connection, fam: Family, scope_id: str) -> str:
    scope_id = _known(conn, fam, scope_id)
    at = _now()
    operator_state.set_scope_flags(
        conn, fam.binding_name, scope_id, {"parked": True, "parked_at": at}
    )
    operator_state.bump(conn, fam.binding_name, at=at)
    return f"{fam.name} {scope_id!r}: parked; it is not dispatched until unparked"


def unpark(conn: Connection, fam: Family, scope_id: str) -> str:
    scope_id = _known(conn, fam, scope_id)
    state = operator_state.scope_state(conn, fam.binding_name, scope_id)
    if state is None or not state.parked:
        return f"{fam.name} {scope_id!r}: not parked; nothing changed"
    operator_state.set_scope_flags(
        conn, fam.binding_name, scope_id, {"parked": False, "parked_at": None}
    )
    operator_state.bump(conn, fam.binding_name, at=_now())
    return f"{fam.name} {scope_id!r}: unparked; its pending requests run again"


def stop(conn: Connection, fam: Family, scope_id: str) -> str:
    scope_id = _known(conn, fam, scope_id)
    at = _now()
    operator_state.set_scope_flags(
        conn,
        fam.binding_name,
        scope_id,
        {"parked": True, "parked_at": at, "stop_requested": True},
    )
    operator_state.bump(conn, fam.binding_name, at=at)
    return (
        f"{fam.name} {scope_id!r}: stop requested and parked; a running invocation gets SIGTERM "
        "within one poll (`apsup scopes unpark` to run it again)"
    )


def pause(conn: Connection, fam: Family) -> str:
    operator_state.bump(conn, fam.binding_name, paused=True, at=_now())
    return f"{fam.name}: paused; no new invocation starts on any replica (running ones finish)"


def resume(conn: Connection, fam: Family) -> str:
    operator_state.bump(conn, fam.binding_name, paused=False, at=_now())
    return f"{fam.name}: resumed"


def paused(conn: Connection, fam: Family) -> bool:
    ctl = operator_state.controls(conn, [fam.binding_name]).get(fam.binding_name)
    return bool(ctl and ctl.paused)


def scopes(
    conn: Connection, fam: Family, *, failing: bool = False, limit: int = 100
) -> list[ScopeRow]:
    """The family's Scopes (``failing``: only failing or parked ones, worst first), with their
    generations and failure state; at most ``limit``."""
    if failing:
        states = operator_state.failing(conn, fam.binding_name, limit)
        rows = []
        for s in states:
            row = intents.get(conn, fam.binding_name, s.scope_id)
            rows.append(_row(s.scope_id, row, s))
        return rows
    page = conn.execute(
        select(intents_table.c.scope_id)
        .where(intents_table.c.binding_name == fam.binding_name)
        .order_by(intents_table.c.pending_sequence)
        .limit(limit)
    ).all()
    out = []
    for (scope_id,) in page:
        out.append(
            _row(
                scope_id,
                intents.get(conn, fam.binding_name, scope_id),
                operator_state.scope_state(conn, fam.binding_name, scope_id),
            )
        )
    return out


def _iso(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat() + "Z"


def _row(
    scope_id: str, row: intents.Intent | None, state: operator_state.ScopeState | None
) -> ScopeRow:
    return ScopeRow(
        scope=scope_id,
        requested_generation=row.requested_generation if row else 0,
        handled_generation=row.handled_generation if row else 0,
        dirty_generation=row.dirty_generation if row else 0,
        clean_generation=row.clean_generation if row else 0,
        consecutive_failures=state.consecutive_failures if state else 0,
        error_type=state.last_error_type if state else None,
        error=state.last_error if state else None,
        failed_at=_iso(state.last_failure_at) if state else None,
        next_attempt_at=_iso(state.next_attempt_at) if state else None,
        parked=bool(state and state.parked),
    )


__all__ = [
    "ScopeRow",
    "UnknownScope",
    "park",
    "pause",
    "paused",
    "resume",
    "retry",
    "scopes",
    "stop",
    "unpark",
]
