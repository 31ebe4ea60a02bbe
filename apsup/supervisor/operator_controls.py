"""A Supervisor's side of operator actions and failure state.

The operator's actions are durable rows (``apsup.store.operator_state``); this module mirrors
them into the scheduling core of the term that leads: a paused family dispatches nothing new, a
parked Scope is never dispatched, a retry makes a waiting Scope due now, a stop ends the running
invocation and parks the Scope. It reads them when the term is established and again whenever a
family's ``control_version`` moved (checked with every request poll and every wake-up), so an
action takes effect on whichever replica leads within one poll, and survives restarts and
leadership changes.

It also keeps each Scope's failure state: every failed invocation records its consecutive
failure count, the error's type and redacted message, when it failed and when it is next
attempted, in a fenced write of the leading term; a success clears it. ``view`` serves
``/status`` from memory (no query per scrape); ``apsup status --db`` reads the same rows.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from sqlalchemy import Connection

from apsup.observability.logging import error_fields
from apsup.registry import Family
from apsup.scheduling import Scheduler
from apsup.store import SqlBackend, operator_state
from apsup.store.leases import Term
from apsup.store.operator_state import FamilyControl, ScopeState

log = logging.getLogger("apsup.supervisor")

#: Failing Scopes listed per family in ``/status`` (worst first).
STATUS_LIMIT = 10
#: Failing Scopes kept in memory per family for that list (the rest are still recorded).
MEMORY_LIMIT = 200


@dataclass(frozen=True)
class FailingScope:
    scope_id: str
    consecutive_failures: int
    error_type: str | None
    error: str | None
    failed_at: datetime | None
    next_attempt_at: datetime | None
    parked: bool

    @classmethod
    def of(cls, s: ScopeState) -> FailingScope:
        return cls(
            s.scope_id,
            s.consecutive_failures,
            s.last_error_type,
            s.last_error,
            s.last_failure_at,
            s.next_attempt_at,
            s.parked,
        )

    def as_status(self) -> dict[str, Any]:
        return {
            "scope": self.scope_id,
            "consecutive_failures": self.consecutive_failures,
            "error_type": self.error_type,
            "error": self.error,
            "failed_at": _iso(self.failed_at),
            "next_attempt_at": _iso(self.next_attempt_at),
            "parked": self.parked,
        }


def _clear(conn: Connection, *, binding: str, retried: list[str], stopped: list[str]) -> None:
    operator_state.clear_requests(conn, binding, retried=retried, stopped=stopped)


def _iso(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat() + "Z"


class OperatorControls:
    def __init__(self, families: dict[str, Family], backend: SqlBackend) -> None:
        self.families = families
        self.backend = backend
        self.versions: dict[str, int] = {}
        self.paused: dict[str, bool] = dict.fromkeys(families, False)
        self.parked: dict[str, set[str]] = {name: set() for name in families}
        self.failing: dict[str, dict[str, FailingScope]] = {name: {} for name in families}
        #: The database may record failing Scopes that ``failing`` does not hold (more than
        #: ``MEMORY_LIMIT`` fail): a success then clears its Scope's state whatever memory says.
        self.truncated: dict[str, bool] = dict.fromkeys(families, False)

    # -- establishment --------------------------------------------------------------------------
    def load(self, conn: Connection) -> None:
        """Read every family's controls, held Scopes and failing Scopes (a new term's view)."""
        bindings = {f.binding_name: name for name, f in self.families.items()}
        controls = operator_state.controls(conn, bindings)
        for binding, name in bindings.items():
            ctl = controls.get(binding)
            self.versions[name] = ctl.control_version if ctl else 0
            self.paused[name] = bool(ctl and ctl.paused)
            held = operator_state.held(conn, binding)
            self.parked[name] = {s.scope_id for s in held if s.parked}
            self.failing[name] = {
                s.scope_id: FailingScope.of(s)
                for s in operator_state.failing(conn, binding, MEMORY_LIMIT)
            }
            self.truncated[name] = len(self.failing[name]) >= MEMORY_LIMIT

    def apply(self, core: Scheduler) -> None:
        for name in self.families:
            core.set_paused(name, self.paused[name])
            core.set_parked(name, self.parked[name])

    # -- actions seen by a poll or a wake-up ---------------------------------------------------
    def refresh(
        self,
        controls: dict[str, FamilyControl],
        core: Scheduler,
        term: Term,
        now: datetime,
        stop: Callable[[str, str], bool],
    ) -> None:
        """Apply the families whose control version moved: pause, parked set, then the pending
        retries (due now) and stops (``stop(family, scope)`` ends a running invocation), and
        clear those one-shot requests in a fenced write."""
        for name, fam in self.families.items():
            ctl = controls.get(fam.binding_name)
            version = ctl.control_version if ctl else 0
            paused = bool(ctl and ctl.paused)
            if paused != self.paused[name]:
                log.warning(
                    "family paused by the operator" if paused else "family resumed",
                    extra={"family": name, "binding": fam.binding_name},
                )
            self.paused[name] = paused
            core.set_paused(name, paused)
            if version == self.versions.get(name):
                continue
            with self.backend.read() as conn:
                held = operator_state.held(conn, fam.binding_name)
            self.parked[name] = {s.scope_id for s in held if s.parked}
            core.set_parked(name, self.parked[name])
            for scope_id, view in list(self.failing[name].items()):
                self.failing[name][scope_id] = replace(view, parked=scope_id in self.parked[name])
            retried: list[str] = []
            stopped: list[str] = []
            for s in held:
                if s.retry_requested:
                    core.retry_now(name, s.scope_id, now)
                    retried.append(s.scope_id)
                    log.warning(
                        "retry requested by the operator",
                        extra={"family": name, "scope": s.scope_id, "parked": s.parked},
                    )
                if s.stop_requested:
                    running = stop(name, s.scope_id)
                    stopped.append(s.scope_id)
                    log.warning(
                        "stop requested by the operator",
                        extra={"family": name, "scope": s.scope_id, "running": running},
                    )
            if retried or stopped:
                # Only what was read and acted on is cleared (see ``clear_requests``).
                clear = functools.partial(
                    _clear, binding=fam.binding_name, retried=retried, stopped=stopped
                )
                self.backend.run_fenced(term, clear)
            self.versions[name] = version

    # -- failure state ----------------------------------------------------------------------------
    def on_failure(
        self,
        term: Term,
        family: str,
        scope_id: str,
        *,
        failures: int,
        error_type: str | None,
        error: str | None,
        at: datetime,
        next_attempt_at: datetime | None,
    ) -> None:
        fam = self.families[family]
        view = FailingScope(
            scope_id,
            failures,
            error_type,
            error,
            at,
            next_attempt_at,
            scope_id in self.parked[family],
        )
        table = self.failing[family]
        table[scope_id] = view
        if len(table) > MEMORY_LIMIT:  # keep the worst; the database keeps every one
            worst = sorted(table.values(), key=lambda v: -v.consecutive_failures)[:MEMORY_LIMIT]
            self.failing[family] = {v.scope_id: v for v in worst}
            self.truncated[family] = True
        try:
            self.backend.run_fenced(
                term,
                lambda c: operator_state.record_failure(
                    c,
                    fam.binding_name,
                    scope_id,
                    failures=failures,
                    error_type=error_type,
                    error=error,
                    at=at,
                    next_attempt_at=next_attempt_at,
                ),
            )
        except Exception as exc:  # the in-memory view still shows it; the next failure retries
            log.warning(
                "failure state not recorded",
                extra={"family": family, "scope": scope_id, **error_fields(exc)},
            )

    def prior_failures(self, family: str, scope_id: str) -> int:
        """The Scope's consecutive failures as recorded (by this term or an earlier one): from
        memory when it is among the failing Scopes held there, else one point read. 0 when it
        cannot be read: the count then restarts, as it did before it was kept."""
        view = self.failing[family].get(scope_id)
        if view is not None:
            return view.consecutive_failures
        try:
            with self.backend.read() as conn:
                state = operator_state.scope_state(
                    conn, self.families[family].binding_name, scope_id
                )
        except Exception as exc:
            log.warning(
                "failure state not read",
                extra={"family": family, "scope": scope_id, **error_fields(exc)},
            )
            return 0
        return 0 if state is None else state.consecutive_failures

    def on_success(self, term: Term, family: str, scope_id: str) -> bool:
        """Clear a Scope that was failing (no write for one known not to fail). False when its
        recorded state could not be cleared: it may still name a backoff that has not ended,
        and request passes that leave such Scopes out would not see its next request."""
        if self.failing[family].pop(scope_id, None) is None and not self.truncated[family]:
            return True
        fam = self.families[family]
        try:
            self.backend.run_fenced(
                term, lambda c: operator_state.record_success(c, fam.binding_name, scope_id)
            )
        except Exception as exc:
            log.warning(
                "failure state not cleared",
                extra={"family": family, "scope": scope_id, **error_fields(exc)},
            )
            return False
        return True

    def view(self, family: str) -> tuple[list[dict[str, Any]], int]:
        """The failing (and parked) Scopes for ``/status``, worst first, and how many fail."""
        table = dict(self.failing[family])
        for scope_id in self.parked[family]:
            table.setdefault(scope_id, FailingScope(scope_id, 0, None, None, None, None, True))
        ordered = sorted(table.values(), key=lambda v: (-v.consecutive_failures, v.scope_id))
        failing = sum(1 for v in table.values() if v.consecutive_failures > 0)
        return [v.as_status() for v in ordered[:STATUS_LIMIT]], failing
