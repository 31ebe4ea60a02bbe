"""How long the leader has known of each unacknowledged request, per family.

The intent table carries no timestamp (its columns are the contract's), so the age of the oldest
unacknowledged request is measured from what the leader itself saw: a request counts from the
moment this term first read its row (a request page, or the dispatch read of a Scope found by a
scan). A request that arrives while its Scope runs counts from that run's dispatch, the earliest
moment it can have been made. A new term starts every clock again, so right after a takeover the
age understates, never overstates; operators alert on it growing, not on its exact value.
"""

from __future__ import annotations

from collections.abc import Collection


class RequestAges:
    """First-seen monotonic times of the requests a term knows are unacknowledged."""

    def __init__(self) -> None:
        self._seen: dict[str, dict[str, float]] = {}

    def seen(self, family: str, scope_id: str, at: float) -> None:
        """``scope_id`` has an unacknowledged request; keep the earliest time it was seen."""
        self._seen.setdefault(family, {}).setdefault(scope_id, at)

    def handled(self, family: str, scope_id: str, more_since: float | None = None) -> None:
        """The Scope's requests up to its claimed generation are handled. ``more_since``: a
        later request is still pending, made no earlier than that run's dispatch."""
        scopes = self._seen.get(family)
        if scopes is None:
            return
        if more_since is None:
            scopes.pop(scope_id, None)
        else:
            scopes[scope_id] = more_since

    def clear(self) -> None:
        """The term is gone: what it saw is no evidence for the next one."""
        self._seen.clear()

    def oldest(self, family: str, now: float, parked: Collection[str] = ()) -> float:
        """Seconds since the oldest request still waiting was first seen (0 when none). A
        parked Scope waits for the operator and is reported as parked instead."""
        scopes = self._seen.get(family)
        if not scopes:
            return 0.0
        first = min((at for scope, at in scopes.items() if scope not in parked), default=None)
        return 0.0 if first is None else max(0.0, now - first)

    def count(self, family: str) -> int:
        return len(self._seen.get(family, ()))
