"""Decisions the scheduling core hands to the IO shell (one at a time).

Each decision is a plain frozen record: the shell executes it synchronously (a short fenced
transaction, a bounded query or a Worker launch) and reports the result back through the matching
``Scheduler.on_*`` event before it asks for the next decision. Keeping them as data, not
callbacks, is what lets the same core run under the real loop and under the simulation.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Literal

DispatchReason = Literal["request", "scan", "retry", "successor", "conflict"]
"""Why a key entered the ready queue; logged with the invocation (RFC §12)."""


@dataclass(frozen=True)
class StartScan:
    """Commit start_scan (fenced): bump scan_generation, record ``checkpoint``, set in-progress and
    the upper pending_sequence, then call ``on_scan_started``.

    The store never moves the checkpoint backwards, except over ``rewound_from``: the future
    checkpoint the core clamped after database time went back (docs/scheduling-time.md).
    """

    family: str
    checkpoint: datetime
    rewound_from: datetime | None = None


@dataclass(frozen=True)
class FetchScanPage:
    """Read one page of ``dirty > clean`` rows with ``after_sequence < pending_sequence <=
    upper_sequence`` in pending_sequence order (at most ``limit``), then call ``on_scan_page``."""

    family: str
    scan_generation: int
    after_sequence: int
    upper_sequence: int
    limit: int


@dataclass(frozen=True)
class Admit:
    """Durable admission of one Scope for this scan generation (fenced), then ``on_admitted``."""

    family: str
    scope_id: str
    scan_generation: int


@dataclass(frozen=True)
class EndScan:
    """Clear scan-in-progress for this generation (fenced), then call ``on_scan_ended``."""

    family: str
    scan_generation: int


@dataclass(frozen=True)
class FetchRequests:
    """Read one page of rows with ``requested > handled`` and ``pending_sequence >
    after_sequence`` in pending_sequence order (at most ``limit``), then ``on_request_page``."""

    family: str
    after_sequence: int
    limit: int
    #: Leave out Scopes whose recorded backoff has not ended (their failure state names a
    #: next attempt later than now): the core holds each of them in memory, waiting, so
    #: reading them again would only be skipped, and a notification would cost a page per
    #: hundred failing Scopes instead of the new requests' pages. False after restore.
    skip_backoff: bool = False


@dataclass(frozen=True)
class Dispatch:
    """Read the latest requested generation G and launch a Worker, then ``on_dispatched``.

    ``token`` identifies this dispatch; the shell may pass it back to ``on_dispatched`` and
    ``on_worker_exit`` so that a late report about an older invocation is ignored.
    """

    family: str
    scope_id: str
    reason: DispatchReason
    token: int = 0


Decision = StartScan | FetchScanPage | Admit | EndScan | FetchRequests | Dispatch
