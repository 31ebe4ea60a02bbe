"""Observability: Family-labelled metrics, redacting structured logs, health/readiness HTTP.

Everything here is called from the scheduling loop or serves from a side thread, and is built
so that a failure in it never breaks scheduling (RFC §12).

The names below are imported from their modules on first use: a Worker imports this package
for its log relay and tracing only, and the HTTP server, Prometheus client and console the
others bring (20 MB of imports, 4 MB of memory) would otherwise be in the image every Worker
is forked from.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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

_MODULE_OF = {
    **dict.fromkeys(("HealthServer", "Heartbeat", "fan_in"), "health"),
    **dict.fromkeys(
        (
            "FAILURE_FIELDS",
            "configure_logging",
            "exception_fields",
            "log_event",
            "log_startup",
            "redact",
            "register_dsn",
            "register_secret",
            "safe_url",
        ),
        "logging",
    ),
    **dict.fromkeys(("FailureCause", "SupervisorMetrics", "supervisor_port"), "metrics"),
    **dict.fromkeys(
        (
            "FamilyStatus",
            "Readiness",
            "StatusProvider",
            "StatusSnapshot",
            "SupervisorStatus",
            "evaluate_readiness",
        ),
        "status",
    ),
}

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


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
