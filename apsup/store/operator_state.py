"""Persistence of operator and failure state (tables ``scope_states`` and ``family_controls``).

Two writers share these rows. The leader records each failure of a Scope (and clears it on
success) in a fenced transaction, and clears the operator's one-shot requests once it has acted
on them. The operator (``apsup.operator``, the ``apsup scopes``/``apsup families`` commands)
parks, unparks, asks for a retry or a stop, and pauses or resumes a family, in a transaction of
its own (like a domain request, it needs no leadership); every such action advances the family's
``control_version``, which each leader reads with its request poll (one small statement for all
its families) and on every wake-up, so it acts on the change within one poll.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, Table, and_, delete, insert, or_, select, update
from sqlalchemy.exc import IntegrityError

from apsup.store.intents import not_in_backoff
from apsup.store.schema import binding_states, family_controls, intents, scope_states

#: ``last_error`` is stored cut to this many characters (already redacted by the caller).
ERROR_CHARS = 400
ERROR_TYPE_CHARS = 200


@dataclass(frozen=True)
class ScopeState:
    binding_name: str
    scope_id: str
    consecutive_failures: int
    last_error_type: str | None
    last_error: str | None
    last_failure_at: datetime | None
    next_attempt_at: datetime | None
    parked: bool
    retry_requested: bool
    stop_requested: bool


@dataclass(frozen=True)
class FamilyControl:
    binding_name: str
    paused: bool
    control_version: int


_COLUMNS = (
    scope_states.c.binding_name,
    scope_states.c.scope_id,
    scope_states.c.consecutive_failures,
    scope_states.c.last_error_type,
    scope_states.c.last_error,
    scope_states.c.last_failure_at,
    scope_states.c.next_attempt_at,
    scope_states.c.parked,
    scope_states.c.retry_requested,
    scope_states.c.stop_requested,
)


def _state(row: Any) -> ScopeState:
    r = tuple(row)
    return ScopeState(
        r[0], r[1], int(r[2]), r[3], r[4], r[5], r[6], bool(r[7]), bool(r[8]), bool(r[9])
    )


def _update_or_insert(
    conn: Connection,
    table: Table,
    key: dict[str, object],
    values: dict[str, object],
    first: dict[str, object] | None = None,
) -> None:
    """Update the row of ``key`` with ``values``, or insert it (``first``: the new row's values,
    default ``values``). A concurrent insert of the same row (MySQL: the operator and the leader
    at once) makes the insert fail; the update then finds the row."""
    where = and_(*(table.c[name] == value for name, value in key.items()))
    if conn.execute(update(table).where(where).values(**values)).rowcount:
        return
    try:
        with conn.begin_nested():
            conn.execute(insert(table).values(**key, **(values if first is None else first)))
    except IntegrityError:
        conn.execute(update(table).where(where).values(**values))


def _upsert(conn: Connection, binding: str, scope_id: str, values: dict[str, object]) -> None:
    _update_or_insert(conn, scope_states, {"binding_name": binding, "scope_id": scope_id}, values)


# --- the leader's writes (inside its fenced transactions) ---------------------------------------


def record_failure(
    conn: Connection,
    binding: str,
    scope_id: str,
    *,
    failures: int,
    error_type: str | None,
    error: str | None,
    at: datetime,
    next_attempt_at: datetime | None,
) -> None:
    _upsert(
        conn,
        binding,
        scope_id,
        {
            "consecutive_failures": failures,
            "last_error_type": None if error_type is None else error_type[:ERROR_TYPE_CHARS],
            "last_error": None if error is None else error[:ERROR_CHARS],
            "last_failure_at": at,
            "next_attempt_at": next_attempt_at,
        },
    )


def record_success(conn: Connection, binding: str, scope_id: str) -> None:
    """The Scope succeeded: it no longer fails. Its row goes unless the operator still holds it
    (parked, or a request pending); the last error stays on a parked Scope's row."""
    where = and_(scope_states.c.binding_name == binding, scope_states.c.scope_id == scope_id)
    conn.execute(
        delete(scope_states).where(
            where,
            scope_states.c.parked.is_(False),
            scope_states.c.retry_requested.is_(False),
            scope_states.c.stop_requested.is_(False),
        )
    )
    conn.execute(
        update(scope_states).where(where).values(consecutive_failures=0, next_attempt_at=None)
    )


def clear_requests(
    conn: Connection, binding: str, *, retried: Iterable[str] = (), stopped: Iterable[str] = ()
) -> None:
    """The leader acted on these Scopes' retry (``retried``) and stop (``stopped``) requests.

    Each flag is cleared only where it was read set and acted on: a stop an operator commits
    after the leader read a retry survives the retry's clearing (and its version bump makes the
    leader read it at its next poll)."""
    for flag, scopes in (("retry_requested", retried), ("stop_requested", stopped)):
        chosen = sorted(set(scopes))
        if not chosen:
            continue
        column = scope_states.c[flag]
        conn.execute(
            update(scope_states)
            .where(
                scope_states.c.binding_name == binding,
                scope_states.c.scope_id.in_(chosen),
                column.is_(True),
            )
            .values({flag: False})
        )


# --- reads -----------------------------------------------------------------------------------


def controls(conn: Connection, bindings: Iterable[str]) -> dict[str, FamilyControl]:
    chosen = sorted(set(bindings))
    if not chosen:
        return {}
    rows = conn.execute(
        select(
            family_controls.c.binding_name,
            family_controls.c.paused,
            family_controls.c.control_version,
        ).where(family_controls.c.binding_name.in_(chosen))
    )
    return {r[0]: FamilyControl(r[0], bool(r[1]), int(r[2])) for r in rows}


def poll(
    conn: Connection, bindings: Iterable[str], *, now: Any = None, since: Any = None
) -> tuple[set[str], dict[str, FamilyControl]]:
    """An elected leader's poll in one statement: which of ``bindings`` have an explicit request
    pending (one index probe each, ``ix_intents_request``) and each one's operator controls. A
    binding without its state row (not yet established) is not reported. ``now`` and
    ``since`` (database time; see ``intents.request_page``): requests of Scopes in a backoff
    of a failure recorded after ``since`` do not count (the leader holds them, waiting), so a
    family whose only requests are failing ones is not notified at every poll."""
    names = sorted(set(bindings))
    if not names:
        return set(), {}
    b, c, f = binding_states.c, intents.c, family_controls.c
    where = [c.binding_name == b.binding_name, c.request_pending == 1]
    if now is not None and since is not None:
        where.append(not_in_backoff(now, since))
    pending = select(c.binding_name).where(*where).exists()
    rows = conn.execute(
        select(b.binding_name, pending, f.paused, f.control_version)
        .select_from(binding_states.outerjoin(family_controls, f.binding_name == b.binding_name))
        .where(b.binding_name.in_(names))
    )
    with_requests: set[str] = set()
    controls: dict[str, FamilyControl] = {}
    for name, has_request, paused, version in rows:
        if has_request:
            with_requests.add(str(name))
        if version is not None:
            controls[str(name)] = FamilyControl(str(name), bool(paused), int(version))
    return with_requests, controls


def held(conn: Connection, binding: str) -> list[ScopeState]:
    """The Scopes of ``binding`` the operator holds: parked, or with a request pending."""
    rows = conn.execute(
        select(*_COLUMNS).where(
            scope_states.c.binding_name == binding,
            or_(
                scope_states.c.parked.is_(True),
                scope_states.c.retry_requested.is_(True),
                scope_states.c.stop_requested.is_(True),
            ),
        )
    )
    return [_state(r) for r in rows]


def failing(conn: Connection, binding: str, limit: int) -> list[ScopeState]:
    """Failing or parked Scopes of ``binding``, worst first (most consecutive failures)."""
    rows = conn.execute(
        select(*_COLUMNS)
        .where(
            scope_states.c.binding_name == binding,
            or_(scope_states.c.consecutive_failures > 0, scope_states.c.parked.is_(True)),
        )
        .order_by(scope_states.c.consecutive_failures.desc(), scope_states.c.scope_id)
        .limit(limit)
    )
    return [_state(r) for r in rows]


def failing_count(conn: Connection, binding: str) -> int:
    from sqlalchemy import func

    return int(
        conn.execute(
            select(func.count()).where(
                scope_states.c.binding_name == binding, scope_states.c.consecutive_failures > 0
            )
        ).scalar_one()
    )


def parked_count(conn: Connection, binding: str) -> int:
    """Parked Scopes of ``binding`` (rows of Scopes with failure or operator state only)."""
    from sqlalchemy import func

    return int(
        conn.execute(
            select(func.count()).where(
                scope_states.c.binding_name == binding, scope_states.c.parked.is_(True)
            )
        ).scalar_one()
    )


def scope_state(conn: Connection, binding: str, scope_id: str) -> ScopeState | None:
    row = conn.execute(
        select(*_COLUMNS).where(
            scope_states.c.binding_name == binding, scope_states.c.scope_id == scope_id
        )
    ).first()
    return None if row is None else _state(row)


# --- the operator's writes -------------------------------------------------------------------


def bump(conn: Connection, binding: str, *, paused: bool | None = None, at: datetime) -> int:
    """Advance the family's control version (and set its pause flag); returns the version."""
    values: dict[str, object] = {"control_version": family_controls.c.control_version + 1}
    if paused is not None:
        values["paused"] = paused
        values["paused_at"] = at if paused else None
    first: dict[str, object] = {
        "paused": bool(paused),
        "paused_at": at if paused else None,
        "control_version": 1,
    }
    _update_or_insert(conn, family_controls, {"binding_name": binding}, values, first)
    where = family_controls.c.binding_name == binding
    return int(conn.execute(select(family_controls.c.control_version).where(where)).scalar_one())


def set_scope_flags(
    conn: Connection, binding: str, scope_id: str, values: dict[str, object]
) -> None:
    _upsert(conn, binding, scope_id, values)
