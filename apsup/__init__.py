"""apsup: the Artifact Processing Supervisor.

A Supervisor decides when a family of processors may run and which Scope goes to a Worker; the
processor decides what is processed. Every write a Worker makes is fenced by the term that
dispatched it.
"""

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version

from apsup.context import ExecutionContext
from apsup.errors import (
    ApsupError,
    BackendError,
    ConfigError,
    ContextError,
    HostConflictError,
    IntentError,
    ProgressConflict,
    StaleTermError,
)
from apsup.policy import Cron, Disabled, Interval
from apsup.registry import Family, Registry, default_registry, family
from apsup.store import connect

try:
    __version__ = _version("apsup")
except PackageNotFoundError:  # pragma: no cover - running from a tree that was never installed
    __version__ = "0+unknown"

__all__ = [
    "ApsupError",
    "BackendError",
    "ConfigError",
    "ContextError",
    "Cron",
    "Disabled",
    "ExecutionContext",
    "Family",
    "HostConflictError",
    "IntentError",
    "Interval",
    "ProgressConflict",
    "Registry",
    "StaleTermError",
    "__version__",
    "connect",
    "default_registry",
    "family",
]
