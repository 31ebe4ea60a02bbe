"""Prometheus metrics for the Supervisor, labelled by Family only (RFC §12).

Why hooks instead of handing out metric objects: the hook signatures accept a Family name (and a
bounded ``cause`` enum, and a ``supervisor_key`` which is bounded by the number of Families), so
a Scope, Worker or request id cannot become a label by accident. Every hook swallows its own
exceptions: a metrics failure must never break scheduling.

Each ``SupervisorMetrics`` owns a private ``CollectorRegistry`` (not the process-global default),
so two instances in one process (tests, ``global`` with several Supervisors) never collide.

Dedicated mode (one Supervisor process per Family): **one endpoint per process**. Each
per-Family Supervisor process owns its ``SupervisorMetrics`` and serves it from its own
``HealthServer`` on ``supervisor_port(base_port, index)`` = ``base_port + 1 + index`` (``index``
= position of the Family in the sorted registered names, identical on every replica); the
launcher keeps ``base_port`` for its own liveness and a fan-in ``/readyz``/``/status``
(``apsup.observability.health.fan_in``). Prometheus scrapes ``base_port+1 .. base_port+N``.
Chosen over ``PROMETHEUS_MULTIPROC_DIR`` because multiprocess mode decides its value storage when
``prometheus_client`` is first imported (a forked child inherits the parent's choice), needs the
directory wiped at startup and ``mark_process_dead`` on every restart, and shares mmap files
between processes; per-process endpoints share nothing, a crashed child only loses its own
counters (Prometheus ``rate()`` handles the reset) and the restarted child rebinds the same port.
With ``base_port == 0`` every server takes an ephemeral port (tests).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterable
from enum import StrEnum
from typing import ParamSpec

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from apsup.observability.health import HealthServer
from apsup.observability.stall import StallCollector, install_default_collectors

_log = logging.getLogger(__name__)

P = ParamSpec("P")

UNKNOWN_FAMILY = "_unknown"

DISCOVERY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 120, 300, 600, 1200, 1800, 3600)


class FailureCause(StrEnum):
    """Why an invocation ended unsuccessfully; the only values of the ``cause`` label.

    ``conflict`` (ProgressConflict) is redispatched without counting a backoff failure (RFC §7)
    but is still an unsuccessful exit worth counting.
    """

    FAILURE = "failure"  # processor raised / non-zero exit
    TIMEOUT = "timeout"  # deadline passed, Worker stopped
    CONFLICT = "conflict"  # processor's own progress CAS lost a race
    STALE_TERM = "stale_term"  # fenced commit refused: the term changed
    NO_ACK = "no_ack"  # exit 0 without durable acknowledgment
    CRASH = "crash"  # killed by a signal / vanished
    STORAGE = "storage"  # the database refused the write (disk full, read-only, I/O error)


def supervisor_port(base_port: int, index: int | None) -> int:
    """Port for the launcher (``index=None``) or the ``index``-th dedicated Supervisor."""
    if base_port == 0:
        return 0
    return base_port if index is None else base_port + 1 + index


def _never_raises(fn: Callable[P, None]) -> Callable[P, None]:
    """Hooks run inside the scheduling loop: log a failure once per hook and carry on."""
    warned = False

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> None:
        nonlocal warned
        try:
            fn(*args, **kwargs)
        except Exception:
            if not warned:
                warned = True
                _log.warning("metrics hook %s failed; further failures are silent", fn.__name__)

    return wrapper


class SupervisorMetrics:
    """All ``apsup_*`` series of one process, plus the hooks the Supervisor loop calls.

    ``families``, when given, pre-creates every series at zero (dashboards see a Family before
    its first event) and maps any other name to ``_unknown``: a mistaken Scope id passed as a
    Family cannot add a series.
    """

    def __init__(
        self, registry: CollectorRegistry | None = None, *, families: Iterable[str] | None = None
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._families = frozenset(families) if families is not None else None
        self._generations: dict[str, int] = {}
        self._server: HealthServer | None = None
        r = self.registry
        fam = ("family",)
        self.capacity_budget = Gauge(
            "apsup_capacity_budget", "Worker budget (max_workers) per Family.", fam, registry=r
        )
        self.capacity_used = Gauge(
            "apsup_capacity_used", "Workers currently running per Family.", fam, registry=r
        )
        self.ready = Gauge("apsup_ready_scopes", "Scopes in the ready queue.", fam, registry=r)
        self.retry_wait = Gauge(
            "apsup_retry_wait_scopes", "Scopes waiting for their retry time.", fam, registry=r
        )
        self.unacknowledged = Gauge(
            "apsup_unacknowledged_requests",
            "Requests not yet acknowledged (requested > handled), read from the database.",
            fam,
            registry=r,
        )
        self.oldest_request_age = Gauge(
            "apsup_oldest_request_age_seconds",
            "Age of the oldest unacknowledged request the leader knows of (parked Scopes left "
            "out), counted from when its term first read it.",
            fam,
            registry=r,
        )
        self.unconfirmed = Gauge(
            "apsup_workers_unconfirmed",
            "Workers whose exit cannot be confirmed yet; they keep holding capacity.",
            fam,
            registry=r,
        )
        self.storage_errors = Counter(
            "apsup_storage_errors",
            "Database writes refused by the storage (disk full, read-only, I/O error).",
            ("family", "kind"),
            registry=r,
        )
        self.discovery_seconds = Histogram(
            "apsup_discovery_latency_seconds",
            "Duration of one bounded discovery query/page.",
            fam,
            buckets=DISCOVERY_BUCKETS,
            registry=r,
        )
        self.invocation_seconds = Histogram(
            "apsup_invocation_duration_seconds",
            "Worker invocation wall time, launch to confirmed exit.",
            fam,
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.successes = Counter(
            "apsup_invocation_successes", "Invocations acknowledged successfully.", fam, registry=r
        )
        self.failures = Counter(
            "apsup_invocation_failures",
            "Unsuccessful invocations by cause.",
            ("family", "cause"),
            registry=r,
        )
        self.scans_started = Counter(
            "apsup_scans_started", "Automatic scans started.", fam, registry=r
        )
        self.scans_completed = Counter(
            "apsup_scans_completed", "Automatic scans completed.", fam, registry=r
        )
        self.dispatches = Counter("apsup_dispatches", "Workers launched.", fam, registry=r)
        self.clock_rewinds = Counter(
            "apsup_clock_rewinds",
            "Schedule checkpoints clamped because database time went back.",
            fam,
            registry=r,
        )
        key = ("supervisor_key",)
        self.leader = Gauge(
            "apsup_supervisor_leader",
            "1 while this process leads the key (term established, dispatching), else 0.",
            key,
            registry=r,
        )
        self.lease_held = Gauge(
            "apsup_supervisor_lease_held",
            "1 while this process holds the key's Lease, established or not, else 0.",
            key,
            registry=r,
        )
        self.generation = Gauge(
            "apsup_supervisor_generation", "Last observed lease generation.", key, registry=r
        )
        self.term_changes = Counter(
            "apsup_supervisor_term_changes", "Observed lease generation changes.", key, registry=r
        )
        self.stall = StallCollector(r)
        install_default_collectors(r)
        self._refreshers: list[Callable[[], None]] = []
        for name in self._families or ():
            self._init_family(name)

    def _init_family(self, name: str) -> None:
        for metric in (
            self.capacity_budget,
            self.capacity_used,
            self.ready,
            self.retry_wait,
            self.unacknowledged,
            self.oldest_request_age,
            self.unconfirmed,
            self.discovery_seconds,
            self.invocation_seconds,
            self.successes,
            self.scans_started,
            self.scans_completed,
            self.dispatches,
            self.clock_rewinds,
        ):
            metric.labels(name)
        for cause in FailureCause:
            self.failures.labels(name, cause.value)
        self.stall.init_family(name)

    def _family(self, family: str) -> str:
        if self._families is not None and family not in self._families:
            return UNKNOWN_FAMILY
        return str(family)

    # --- hooks (cheap, never raise) -----------------------------------------------------------

    @_never_raises
    def on_dispatch(self, family: str) -> None:
        self.dispatches.labels(self._family(family)).inc()

    @_never_raises
    def on_exit(self, family: str, cause: FailureCause | str | None, duration: float) -> None:
        """Record a confirmed Worker exit; ``cause=None`` is success. Unknown causes -> failure."""
        f = self._family(family)
        self.invocation_seconds.labels(f).observe(max(0.0, float(duration)))
        if cause is None:
            self.successes.labels(f).inc()
            self.stall.last_success.labels(f).set(time.time())
            return
        try:
            c = FailureCause(cause)
        except ValueError:
            c = FailureCause.FAILURE
        self.failures.labels(f, c.value).inc()

    @_never_raises
    def on_scan_started(self, family: str) -> None:
        self.scans_started.labels(self._family(family)).inc()

    @_never_raises
    def on_scan_completed(self, family: str) -> None:
        self.scans_completed.labels(self._family(family)).inc()

    @_never_raises
    def on_clock_rewinds(self, family: str, count: int) -> None:
        if count > 0:
            self.clock_rewinds.labels(self._family(family)).inc(count)

    @_never_raises
    def observe_discovery(self, family: str, seconds: float) -> None:
        self.discovery_seconds.labels(self._family(family)).observe(max(0.0, float(seconds)))

    @_never_raises
    def set_leadership(
        self, key: str, leader: bool, generation: int, *, lease_held: bool | None = None
    ) -> None:
        """Publish this process's view of one lease; a new generation counts as a term change.

        ``leader``: the term is established (the Supervisor dispatches). ``lease_held``: the
        Lease is held, established or not (default: same as ``leader``). They differ while a
        claimed term is being established: such a replica is not a working leader, and alerts
        on ``apsup_supervisor_leader`` must see it as none."""
        k = str(key)
        self.leader.labels(k).set(1 if leader else 0)
        held = leader if lease_held is None else lease_held
        self.lease_held.labels(k).set(1 if held else 0)
        self.generation.labels(k).set(int(generation))
        if self._generations.get(k) != generation:
            self._generations[k] = generation
            self.term_changes.labels(k).inc()

    @_never_raises
    def update_family(
        self, family: str, budget: int, running: int, ready: int, retry_wait: int
    ) -> None:
        f = self._family(family)
        self.capacity_budget.labels(f).set(budget)
        self.capacity_used.labels(f).set(running)
        self.ready.labels(f).set(ready)
        self.retry_wait.labels(f).set(retry_wait)

    @_never_raises
    def set_unconfirmed(self, family: str, n: int) -> None:
        self.unconfirmed.labels(self._family(family)).set(n)

    @_never_raises
    def on_storage_error(self, family: str, kind: str) -> None:
        self.storage_errors.labels(self._family(family), kind).inc()

    @_never_raises
    def set_unacknowledged(self, family: str, n: int) -> None:
        self.unacknowledged.labels(self._family(family)).set(n)

    @_never_raises
    def set_oldest_request_age(self, family: str, seconds: float) -> None:
        self.oldest_request_age.labels(self._family(family)).set(round(seconds, 1))

    @_never_raises
    def set_stall(
        self, family: str, oldest_started: float | None, max_consecutive_failures: int
    ) -> None:
        """Oldest running invocation (``time.monotonic()`` at launch) and the highest
        consecutive-failure count of the Family's keys."""
        self.stall.set(self._family(family), oldest_started, max_consecutive_failures)

    @_never_raises
    def set_family_timing(self, family: str, interval: float, timeout: float) -> None:
        """The Family's check interval (0 for cron or disabled) and Worker timeout, which the
        stall alerts compare ages with."""
        f = self._family(family)
        self.stall.interval.labels(f).set(max(0.0, float(interval)))
        self.stall.timeout.labels(f).set(max(0.0, float(timeout)))

    def add_refresher(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` before each scrape (values only the database knows, read on demand)."""
        self._refreshers.append(fn)

    def refresh(self) -> None:
        """Called by the HTTP server before encoding ``/metrics``; never raises."""
        for fn in self._refreshers:
            try:
                fn()
            except Exception:
                _log.debug("metrics refresher failed", exc_info=True)

    # --- standalone exposition -----------------------------------------------------------------

    def serve(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Serve ``/metrics`` (and ``/healthz``) alone; returns the bound port.

        Prefer one ``HealthServer(metrics=...)`` per process, which serves this too.
        """
        if self._server is None:
            self._server = HealthServer(metrics=self, host=host, port=port)
            self._server.start()
        return self._server.port

    def close(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None
