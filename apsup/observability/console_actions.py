"""The console's actions: the operator writes of ``apsup scopes`` / ``apsup families``.

Each action is the same function the CLI calls (``apsup.operator``), in one transaction of
the replica's own: durable once committed, applied by the family's leader under its term
within one poll (SQLite: the host is also notified at once, as the CLI does). "Retry all
failing" retries every failing Scope of the family that is not parked, in one transaction
(at most ``RETRY_ALL_LIMIT``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

from apsup import operator
from apsup.errors import ActionRefused as ActionRefused
from apsup.registry import Family
from apsup.store import backend_kind, operator_state

SCOPE_ACTIONS = ("retry", "park", "unpark", "stop")
FAMILY_ACTIONS = ("pause", "resume", "retry-failing")
#: Failing Scopes one "retry all failing" retries at most.
RETRY_ALL_LIMIT = 1000


def perform(
    backend: Any, db_url: str, families: Mapping[str, Family], action: str, family: str, scope: str
) -> str:
    """Carry out ``action``; returns the message to show (what changed, or that nothing did)."""
    fam = families.get(family)
    if fam is None:
        raise ActionRefused(
            f"this replica does not load family {family!r} (its --app): act from a replica "
            "that runs it, or with the CLI"
        )
    if action in SCOPE_ACTIONS and not scope:
        raise ActionRefused(f"{action} needs a Scope id")
    if action not in SCOPE_ACTIONS and action not in FAMILY_ACTIONS:
        raise ActionRefused(f"unknown action {action!r}")
    try:
        with backend.transaction() as conn:
            if action in SCOPE_ACTIONS:
                message = str(getattr(operator, action)(conn, fam, scope))
            elif action == "pause":
                message = operator.pause(conn, fam)
            elif action == "resume":
                message = operator.resume(conn, fam)
            else:
                failing = operator_state.failing(conn, fam.binding_name, RETRY_ALL_LIMIT)
                count = 0
                for state in failing:
                    if not state.parked and state.consecutive_failures > 0:
                        operator.retry(conn, fam, state.scope_id)
                        count += 1
                message = f"{fam.name}: retry requested for {count} failing Scope(s)"
    except operator.UnknownScope as exc:
        raise ActionRefused(str(exc)) from None
    if backend_kind(db_url) == "sqlite":
        from apsup.supervisor.control import notify

        with contextlib.suppress(Exception):  # the host applies it now, not at its next poll
            notify(db_url, fam.name)
    return message
