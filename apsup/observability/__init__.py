"""Observability: Family-labelled metrics, redacting structured logs, health/readiness HTTP.

Everything here is called from the scheduling loop or serves from a side thread, and is built
so that a failure in it never breaks scheduling (RFC §12).
"""

from apsup.observability.health import HealthServer, Heartbeat, fan_in
from apsup.observability.logging import (
    FAILURE_FIELDS,
    configure_logging,
    exception_fields,
    log_event,
    log_startup,
    redact,
    register_dsn,
    register_secret,
    safe_url,
)
from apsup.observability.metrics import FailureCause, SupervisorMetrics, supervisor_port
from apsup.observability.status import (
    FamilyStatus,
    Readiness,
    StatusProvider,
    StatusSnapshot,
    SupervisorStatus,
    evaluate_readiness,
)

__all__ = [
    "FAILURE_FIELDS",
    "FailureCause",
    "FamilyStatus",
    "HealthServer",
    "Heartbeat",
    "Readiness",
    "StatusProvider",
    "StatusSnapshot",
    "SupervisorMetrics",
    "SupervisorStatus",
    "configure_logging",
    "evaluate_readiness",
    "exception_fields",
    "fan_in",
    "log_event",
    "log_startup",
    "redact",
    "register_dsn",
    "register_secret",
    "safe_url",
    "supervisor_port",
]
