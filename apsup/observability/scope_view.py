"""One Scope as the console shows it, and the search that finds it (durable state only).

A Scope's page joins what the database knows (its generations: dirty/clean and
requested/handled; its failure and operator state: failures, last error, first and next
attempt, parked, stop or retry asked) with what its family's leader reports live (a running
Worker: replica, pid, age, the G it was given). Search looks within one family by exact id
and by prefix, on the intents' primary key (a range read, bounded by ``SEARCH_LIMIT``).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import select

from apsup.observability.logging import redact
from apsup.store import intents as intent_store
from apsup.store import operator_state
from apsup.store.schema import intents

#: Scope ids a search returns at most.
SEARCH_LIMIT = 50


def _iso(value: Any) -> str | None:
    return None if value is None else value.isoformat() + "Z"


def binding_of(view: dict[str, Any], family: str) -> str | None:
    fam = view.get("families", {}).get(family)
    return None if fam is None else str(fam.get("binding") or family)


def search(backend: Any, binding: str, text: str, limit: int = SEARCH_LIMIT) -> list[str]:
    """Scope ids of ``binding`` equal to ``text`` (first) or starting with it, in id order."""
    c = intents.c
    with backend.read() as conn:
        exact = conn.execute(
            select(c.scope_id).where(c.binding_name == binding, c.scope_id == text)
        ).first()
        rows = conn.execute(
            select(c.scope_id)
            .where(c.binding_name == binding, c.scope_id.startswith(text, autoescape=True))
            .order_by(c.scope_id)
            .limit(limit)
        )
        found = [str(r[0]) for r in rows]
    if exact is not None:
        found = [text, *(s for s in found if s != text)][:limit]
    return found


def scope_detail(
    backend: Any, view: dict[str, Any], family: str, scope_id: str
) -> dict[str, Any] | None:
    """The Scope's page, or None when ``family`` is not in the cluster view."""
    binding = binding_of(view, family)
    if binding is None:
        return None
    with backend.read() as conn:
        row = intent_store.get(conn, binding, scope_id)
        state = operator_state.scope_state(conn, binding, scope_id)
    fam = view["families"][family]
    running = next((r for r in fam.get("running_scopes", []) if r.get("scope") == scope_id), None)
    leader = fam.get("leader") or {}
    return {
        "family": family,
        "binding": binding,
        "scope": scope_id,
        "known": row is not None or state is not None,
        "generations": None
        if row is None
        else {
            "dirty": row.dirty_generation,
            "clean": row.clean_generation,
            "requested": row.requested_generation,
            "handled": row.handled_generation,
        },
        "running": None
        if running is None
        else {
            "replica": leader.get("replica"),
            "pid": running.get("pid"),
            "age": running.get("age"),
            "generation": running.get("generation"),
        },
        "state": None
        if state is None
        else {
            "consecutive_failures": state.consecutive_failures,
            "error_type": state.last_error_type,
            # Recorded redacted by the leader; redacted again here, whoever wrote the row.
            "error": None if state.last_error is None else redact(state.last_error),
            "last_failure_at": _iso(state.last_failure_at),
            "next_attempt_at": None if state.parked else _iso(state.next_attempt_at),
            "parked": state.parked,
            "retry_requested": state.retry_requested,
            "stop_requested": state.stop_requested,
        },
    }
