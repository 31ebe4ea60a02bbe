"""Host-side wiring of the stall series and the scrape-time request count (kept out of the loop
modules so that they only gain one call each).

``apsup_unacknowledged_requests`` is read from the database when ``/metrics`` is scraped (at
most once a second), by the HTTP thread: the loop only counts after Worker activity, so a request
that no event announced (a SQLite host does not poll) would otherwise read 0 while
``apsup status``, which reads the same rows, shows it. Only Families whose Supervisor leads here
are counted, exactly as before, so replicas do not report the same requests twice.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from apsup.observability.metrics import SupervisorMetrics
from apsup.policy import Interval
from apsup.store import intents

if TYPE_CHECKING:
    from apsup.registry import Family
    from apsup.supervisor.host import Host

log = logging.getLogger("apsup.runtime")

#: A scrape reads the request counts at most this often.
SCRAPE_COUNT_SECONDS = 0.5


def observe_stall(metrics: SupervisorMetrics, host: Host) -> None:
    """Publish each Family's oldest running launch and highest consecutive-failure count."""
    for sup in host.supervisors:
        oldest: dict[str, float] = {}
        for inv in list(sup.running.values()):
            name = inv.family.name
            oldest[name] = min(oldest.get(name, inv.started), inv.started)
        snaps = sup.core.snapshot() if sup.core is not None else {}
        for name in sup.families:
            snap = snaps.get(name)
            failures = snap.max_consecutive_failures if snap is not None else 0
            metrics.set_stall(name, oldest.get(name), failures)


def publish_intervals(metrics: SupervisorMetrics, families: Sequence[Family]) -> None:
    for fam in families:
        policy = fam.policy
        interval = policy.seconds if isinstance(policy, Interval) else 0.0
        metrics.set_family_timing(fam.name, interval, fam.timeout)


class ScrapeCounter:
    """Counts unacknowledged requests per led Family when ``/metrics`` is scraped."""

    def __init__(self, host: Host, metrics: SupervisorMetrics, unacked: dict[str, int]) -> None:
        self.host = host
        self.metrics = metrics
        self.unacked = unacked  # the status snapshot's view: both show the same number
        self._lock = threading.Lock()
        self._next = 0.0

    def __call__(self) -> None:
        now = time.monotonic()
        with self._lock:
            if now < self._next:
                return
            self._next = now + SCRAPE_COUNT_SECONDS
        sups = list(self.host.supervisors)
        led: list[Any] = [
            fam for sup in sups if sup.term is not None for fam in sup.families.values()
        ]
        for sup in sups:  # a standby (or a former leader) reports none: sums stay right
            if sup.term is None:
                for name in sup.families:
                    self.metrics.set_unacknowledged(name, 0)
        if not led:
            return
        with self.host.backend.read() as conn:
            for fam in led:
                n = intents.count_pending_requests(conn, fam.binding_name)
                self.unacked[fam.name] = n
                self.metrics.set_unacknowledged(fam.name, n)
