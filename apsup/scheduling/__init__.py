"""Sans-IO scheduling core: per-family partitions, fair ready queues, backoff, scan cursors.

Pure state and decisions driven by events; no sockets, processes, sleeps, threads, database or
clock reads. The IO shell in ``apsup.supervisor`` executes the decisions.
"""

from apsup.scheduling.backoff import Backoff
from apsup.scheduling.core import (
    BindingState,
    FamilySnapshot,
    FamilySpec,
    KeyInfo,
    KeyState,
    Outcome,
    RequestRow,
    ScanRow,
    Scheduler,
)
from apsup.scheduling.decisions import (
    Admit,
    Decision,
    Dispatch,
    DispatchReason,
    EndScan,
    FetchRequests,
    FetchScanPage,
    StartScan,
)

__all__ = [
    "Admit",
    "Backoff",
    "BindingState",
    "Decision",
    "Dispatch",
    "DispatchReason",
    "EndScan",
    "FamilySnapshot",
    "FamilySpec",
    "FetchRequests",
    "FetchScanPage",
    "KeyInfo",
    "KeyState",
    "Outcome",
    "RequestRow",
    "ScanRow",
    "Scheduler",
    "StartScan",
]
