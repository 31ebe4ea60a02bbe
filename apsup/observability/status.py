"""The status snapshot the Supervisor loop publishes, and readiness derived from it (RFC §12).

The loop owns the state; the HTTP server only reads a plain-dict snapshot through a
``StatusProvider`` callable, so serving ``/readyz`` or ``/status`` never touches scheduling
structures or the database. ``evaluate_readiness`` is pure so ``apsup status`` and tests apply
exactly the rules the server applies.

Readiness rules (``artifact_processing_supervisor`` aggregate):

- loop heartbeat older than the liveness limit (or unknown) -> ``down``;
- a Supervisor whose lease could not be read or renewed (``lease_error`` set) -> that Supervisor
  is ``down`` (lease lost and not re-acquired); a leader with a degraded Family -> ``degraded``;
  a healthy non-leader -> ``standby`` (ready-as-standby, RFC §8: standby is healthy);
- across Supervisors (dedicated mode has one per Family): all down -> ``down``; some down or any
  degraded -> ``degraded``; all standby -> ``standby``; otherwise ``ok``;
- no Supervisor at all: ``ok`` for role ``api`` (it schedules nothing), ``down`` otherwise.

A ``disabled`` Family (automatic admission off) is a configuration choice and does not degrade.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Literal, NotRequired, TypedDict

FamilyHealth = Literal["ok", "degraded", "disabled"]
AggregateHealth = Literal["ok", "degraded", "standby", "down"]

CHECK_NAME = "artifact_processing_supervisor"


class FamilyStatus(TypedDict):
    """One Family's scheduling partition as seen by its Supervisor."""

    status: FamilyHealth
    reason: str | None  # why degraded/disabled, e.g. "discovery failed: OperationalError"
    budget: int  # max_workers
    running: int
    ready: int
    retry_wait: int
    next_retry_at: str | None  # ISO-8601 UTC of the earliest retry, None if no key waits
    due_at: str | None  # ISO-8601 UTC of the next automatic check, None when disabled
    unacknowledged: int | None  # requested > handled count from the last DB count, None if unknown
    #: Seconds since this term first saw the oldest request still unacknowledged (parked Scopes
    #: left out; ``apsup.supervisor.request_ages``); 0 when none waits.
    oldest_request_age: NotRequired[float]
    #: Workers whose exit could not be confirmed (their forkserver died and they could not be
    #: adopted, or SIGKILL brought no status yet); each still holds a budget slot.
    unconfirmed: NotRequired[int]
    policy: NotRequired[str]  # e.g. "interval 300s", "cron '0 2 * * *' Asia/Shanghai", "disabled"
    #: Paused by an operator (``apsup families pause``): nothing new is dispatched.
    paused: NotRequired[bool]
    #: Scopes failing now (consecutive failures > 0), and the worst of them (with parked ones):
    #: scope, consecutive_failures, error_type, error (redacted), failed_at, next_attempt_at,
    #: parked.
    failing_count: NotRequired[int]
    failing: NotRequired[list[dict[str, Any]]]
    #: Running invocations, oldest first (capped): scope, age in seconds, worker_id.
    running_scopes: NotRequired[list[dict[str, Any]]]
    #: [minute since the epoch, succeeded, failed] for the minutes of the last hour with any.
    history: NotRequired[list[list[int]]]


class SupervisorStatus(TypedDict):
    """One logical Supervisor (one Lease): ``global`` or ``artifact:<family>``."""

    key: str
    leader: bool
    holder: str | None  # current lease holder id as last read, may be another replica
    generation: int | None
    families: dict[str, FamilyStatus]
    lease_error: NotRequired[str | None]  # set while the lease cannot be read/renewed
    #: Dedicated scale-out: the replica the placement rule names for this key, and the one this
    #: replica is handing it over to (its running Workers finishing), if any.
    preferred_replica: NotRequired[str | None]
    handing_off_to: NotRequired[str | None]


class StatusSnapshot(TypedDict):
    """What ``StatusProvider`` returns and ``/status`` serves (orjson-serialisable)."""

    role: str  # all | api | background
    mode: str  # global | dedicated
    supervisors: list[SupervisorStatus]
    heartbeat_age: float | None  # seconds since the loop's last heartbeat; None if unknown
    #: Live replicas (elected backends): holder_id, replica_id, host, pid, version, role, mode,
    #: http, started_at, last_seen, leads (Supervisor keys whose Lease it holds), this.
    replicas: NotRequired[list[dict[str, Any]]]


StatusProvider = Callable[[], StatusSnapshot]


class SupervisorReadiness(TypedDict):
    key: str
    status: AggregateHealth
    leader: bool
    generation: int | None
    reason: str | None


class FamilyReadiness(TypedDict):
    status: FamilyHealth
    reason: str | None
    supervisor_key: str


class Readiness(TypedDict):
    """Body of ``/readyz``."""

    check: str
    status: AggregateHealth
    reason: str | None
    role: str | None
    mode: str | None
    heartbeat_age: float | None
    supervisors: list[SupervisorReadiness]
    families: dict[str, FamilyReadiness]


def _supervisor_readiness(sup: SupervisorStatus) -> SupervisorReadiness:
    lease_error = sup.get("lease_error")
    status: AggregateHealth
    if lease_error:
        status, reason = "down", f"lease unavailable: {lease_error}"
    elif not sup["leader"]:
        status, reason = "standby", None
    else:
        degraded = sorted(n for n, f in sup["families"].items() if f["status"] == "degraded")
        if degraded:
            status, reason = "degraded", "degraded families: " + ", ".join(degraded)
        else:
            status, reason = "ok", None
    return {
        "key": sup["key"],
        "status": status,
        "leader": sup["leader"],
        "generation": sup["generation"],
        "reason": reason,
    }


def combine(statuses: Iterable[AggregateHealth]) -> AggregateHealth:
    """Fold per-Supervisor states into the aggregate (see module docstring)."""
    states = list(statuses)
    if not states:
        return "ok"
    if all(s == "down" for s in states):
        return "down"
    if any(s in ("down", "degraded") for s in states):
        return "degraded"
    if all(s == "standby" for s in states):
        return "standby"
    return "ok"


def evaluate_readiness(
    snapshot: StatusSnapshot | None,
    *,
    heartbeat_age: float | None,
    liveness_timeout: float,
    error: str | None = None,
) -> Readiness:
    """Readiness from a snapshot; ``error`` says why no snapshot could be taken."""
    if snapshot is None:
        return {
            "check": CHECK_NAME,
            "status": "down",
            "reason": error or "no status available",
            "role": None,
            "mode": None,
            "heartbeat_age": heartbeat_age,
            "supervisors": [],
            "families": {},
        }
    sups = [_supervisor_readiness(s) for s in snapshot["supervisors"]]
    families: dict[str, FamilyReadiness] = {
        name: {"status": fam["status"], "reason": fam["reason"], "supervisor_key": sup["key"]}
        for sup in snapshot["supervisors"]
        for name, fam in sup["families"].items()
    }
    status: AggregateHealth
    reason: str | None
    if heartbeat_age is None or heartbeat_age > liveness_timeout:
        status = "down"
        reason = (
            "no loop heartbeat yet"
            if heartbeat_age is None
            else f"loop heartbeat stale ({heartbeat_age:.1f}s > {liveness_timeout:.1f}s)"
        )
    elif not sups:
        api_only = snapshot["role"] == "api"
        status = "ok" if api_only else "down"
        reason = "role=api schedules nothing" if api_only else "no supervisor running"
    else:
        status = combine(s["status"] for s in sups)
        reason = "; ".join(f"{s['key']}: {s['reason']}" for s in sups if s["reason"]) or None
    return {
        "check": CHECK_NAME,
        "status": status,
        "reason": reason,
        "role": snapshot["role"],
        "mode": snapshot["mode"],
        "heartbeat_age": heartbeat_age,
        "supervisors": sups,
        "families": families,
    }
