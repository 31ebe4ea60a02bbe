"""Adds what this host's Supervisors did to the per-minute activity table (``store.activity``).

Elected backends only: there, a takeover moves a family to another replica and its chart must
come along; a SQLite host is the only one, its chart is its own memory (and the write would
compete with the Workers for the database's one write lock). Nothing is written while nothing
ran, so an idle leader's statement count does not grow.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from sqlalchemy import Connection

from apsup.observability.logging import error_fields
from apsup.store import activity

if TYPE_CHECKING:
    from apsup.store import SqlBackend
    from apsup.supervisor.supervisor import Supervisor

log = logging.getLogger("apsup.activity")

#: Seconds between two writes (the chart is per minute; the console refreshes every few s).
RECORD_SECONDS = 10.0
#: Writes between two deletions of rows older than ``activity.KEPT_MINUTES``.
PRUNE_EVERY = 30


class ActivityRecorder:
    """Counts sent so far per family; each ``record`` adds the growth since the last one."""

    def __init__(self, backend: SqlBackend) -> None:
        self.backend = backend
        self._sent: dict[str, tuple[int, int]] = {}
        self._next = 0.0
        self._writes = 0

    def due(self, now: float) -> bool:
        return now >= self._next

    def record(self, supervisors: Sequence[Supervisor]) -> None:
        """Write the counts that grew since the last successful write, under this minute
        (database time). A failed write keeps them for the next one."""
        self._next = time.monotonic() + RECORD_SECONDS
        if not supervisors:
            return
        minute = activity.epoch_minute(supervisors[0].now())
        grown: dict[tuple[str, int], tuple[int, int]] = {}
        totals: dict[str, tuple[int, int]] = {}
        for sup in supervisors:
            for name, fam in sup.families.items():
                now = (sup.completed.get(name, 0), sup.failed.get(name, 0))
                sent = self._sent.setdefault(name, now)  # counted from the first look on
                ok, bad = max(0, now[0] - sent[0]), max(0, now[1] - sent[1])
                totals[name] = now
                if ok or bad:
                    grown[(fam.binding_name, minute)] = (ok, bad)
        if not grown:
            return
        self._writes += 1
        prune = self._writes % PRUNE_EVERY == 1

        def body(conn: Connection) -> None:
            activity.add(conn, grown)
            if prune:
                activity.prune(conn, minute - activity.KEPT_MINUTES)

        try:
            self.backend.run(body)
        except Exception as exc:
            log.warning("activity not recorded", extra=error_fields(exc))
            return
        self._sent.update(totals)
