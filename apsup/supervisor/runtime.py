"""``Runtime(settings, registry).run()``: one replica, organised by role and mode (RFC §8, §9).

Roles (``POWERCONTEXT_SERVER_RUNTIME_ARTIFACT_PROCESSING_ROLE``):

- ``all``: background processing plus the API surface of this process (health/readiness/metrics;
  the application's own domain API publishes intent with ``Family.mark_dirty``/``request`` in its
  transactions and needs no leadership).
- ``api``: serves health/readiness/metrics only. It never claims a Lease, never dispatches and
  never starts a Worker pool; domain code in the same process accepts intent as usual.
- ``background``: candidate Supervisors only.

SQLite accepts only ``all`` (one host process; the host lock refuses a second one).

Modes: ``global`` runs one Supervisor (Lease ``global``) for every family in this host process.
``dedicated`` runs one Supervisor per family (Lease ``artifact:<family>``): inside this process
on SQLite, and on MySQL/OceanBase as one child process per family, supervised by
``apsup.supervisor.dedicated`` (restart with backoff, stop all on SIGTERM/SIGINT); each child
runs ``apsup.supervisor.dedicated_child``, which drives ``Runtime.run_host`` for its family.

Standby replicas are healthy: they keep trying to claim at every renewal interval, answer
``/readyz`` with status ``standby`` (HTTP 200) and never exit for not being elected. Only the
leader of a key dispatches, so a family's Worker budget is never multiplied by replicas.

The loop is synchronous and uses PyMySQL (SQLAlchemy's ``mysql+pymysql``): one thread drives the
host; the HTTP server only reads a snapshot the loop publishes after every cycle.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy.exc import DBAPIError

from apsup.errors import ConfigError, StartupInterrupted
from apsup.observability import tracing
from apsup.observability.cluster import ClusterProvider, Own, own_processes
from apsup.observability.console import CHART_MINUTES
from apsup.observability.console_auth import ConsoleAuth
from apsup.observability.health import HealthServer, Heartbeat
from apsup.observability.logging import (
    error_fields,
    exception_message,
    log_startup,
    register_dsn,
)
from apsup.observability.metrics import SupervisorMetrics
from apsup.observability.status import FamilyStatus, StatusSnapshot, SupervisorStatus
from apsup.observability.tracing import InvocationSpans
from apsup.observability.worker_logs import WorkerLogRelay
from apsup.policy import Disabled
from apsup.registry import Family, Registry
from apsup.scheduling import Backoff
from apsup.store import SqlBackend, backend_kind, intents, membership, open_backend
from apsup.store.leases import all_leases
from apsup.supervisor.dedicated import DedicatedLauncher
from apsup.supervisor.host import Host, LeasePolicy
from apsup.supervisor.launcher import MODES, build_host
from apsup.supervisor.nudge import NudgeListener
from apsup.supervisor.placement import Balancer
from apsup.supervisor.process import configure_logs, main_thread, signals
from apsup.supervisor.startup import check_schema, needs_reference_tables
from apsup.supervisor.supervisor import Hooks, Supervisor
from apsup.supervisor.visibility import ScrapeCounter, observe_stall, publish_intervals
from apsup.workers.exit_codes import ExitCode

if TYPE_CHECKING:
    from apsup.config import Settings

log = logging.getLogger("apsup.runtime")

ROLES = ("all", "api", "background")
#: The loop wakes at least this often (no database access unless something is due), so the
#: liveness heartbeat stays fresh on an idle SQLite host that otherwise sleeps until an event.
HEARTBEAT_SECONDS = 1.0
LIVENESS_TIMEOUT = 30.0
#: Unacknowledged-request counts (a metric) are refreshed at most this often.
COUNT_INTERVAL = 10.0
#: Membership rows are read with every this many lease reads (``HostObserver``).
MEMBER_READ_EVERY = 3


def check_topology(settings: Settings) -> str:
    """Validate role x mode x backend; returns ``api``, ``host`` or ``processes``.

    ``Settings.load`` already rejects a non-``all`` role on SQLite; this re-checks for settings
    built another way, so multi-process SQLite can never be enabled by accident (RFC §8).
    """
    if settings.role not in ROLES:
        raise ConfigError(f"unknown role {settings.role!r}: use one of {', '.join(ROLES)}")
    if settings.mode not in MODES:
        raise ConfigError(f"unknown mode {settings.mode!r}: use 'global' or 'dedicated'")
    kind = backend_kind(settings.database_url)
    if kind == "sqlite" and settings.role != "all":
        raise ConfigError(
            f"role {settings.role!r} needs a shared database (MySQL/OceanBase or PostgreSQL); "
            "SQLite runs one host with role 'all' "
            f"(set {settings.prefix}ARTIFACT_PROCESSING_ROLE=all)"
        )
    if settings.role == "api":
        return "api"
    if kind != "sqlite" and settings.mode == "dedicated":
        return "processes"
    return "host"


class MetricsHooks(Hooks):
    """Supervisor hooks forwarded to ``SupervisorMetrics`` (whose hooks never raise)."""

    def __init__(self, metrics: SupervisorMetrics, relay: WorkerLogRelay | None = None) -> None:
        self.metrics = metrics
        self.relay = relay
        self.spans = InvocationSpans() if tracing.enabled() else None

    def invocation_started(self, worker_id: str, fields: dict[str, Any]) -> dict[str, str]:
        if self.spans is None:
            return {}
        attrs = {f"apsup.{k}": v for k, v in fields.items() if k != "duration" and v is not None}
        return self.spans.start(worker_id, attrs)

    def launch_streams(self, worker_id: str, fields: dict[str, Any]) -> tuple[int, ...]:
        return () if self.relay is None else self.relay.open_streams(fields)

    def invocation_ended(self, worker_id: str, cause: str | None) -> None:
        if self.spans is not None:
            self.spans.end(worker_id, cause)

    def exit_details(self, worker_id: str, exitcode: int) -> dict[str, Any]:
        if self.relay is None:
            return {}
        failed = exitcode in (ExitCode.PROCESSOR_FAILURE, ExitCode.BAD_CONTEXT)
        return self.relay.take_exception(worker_id, None if failed else 0.0)

    def on_dispatch(self, family: str) -> None:
        self.metrics.on_dispatch(family)

    def on_exit(self, family: str, cause: str | None, duration: float) -> None:
        self.metrics.on_exit(family, cause, duration)

    def on_scan_started(self, family: str) -> None:
        self.metrics.on_scan_started(family)

    def on_scan_completed(self, family: str) -> None:
        self.metrics.on_scan_completed(family)

    def observe_discovery(self, family: str, seconds: float) -> None:
        self.metrics.observe_discovery(family, seconds)

    def on_storage_error(self, family: str, kind: str) -> None:
        self.metrics.on_storage_error(family, kind)


def _iso(value: Any) -> str | None:
    return None if value is None else value.isoformat() + "Z"


class HostObserver:
    """Runs on the loop thread after every cycle: beats the heartbeat, publishes the status
    snapshot the HTTP thread serves, and updates gauges. Never raises into the loop."""

    def __init__(
        self,
        *,
        role: str,
        mode: str,
        metrics: SupervisorMetrics,
        heartbeat: Heartbeat,
        lease_read_seconds: float,
        count_seconds: float = COUNT_INTERVAL,
    ) -> None:
        self.role = role
        self.mode = mode
        self.metrics = metrics
        self.heartbeat = heartbeat
        self.lease_read_seconds = lease_read_seconds
        self.count_seconds = count_seconds
        self.snapshot: StatusSnapshot = {
            "role": role,
            "mode": mode,
            "supervisors": [],
            "heartbeat_age": 0.0,
        }
        self._host: Host | None = None
        self._replicas: list[dict[str, Any]] = []
        self._members: list[membership.Member] = []
        self._totals: dict[str, tuple[int, int]] = {}
        self._history: dict[str, deque[list[int]]] = {}
        self._lease_reads = 0
        self._next_lease_read = 0.0
        self._lease_view: dict[str, tuple[str, int]] = {}
        self._lease_error: str | None = None
        self._next_count = 0.0
        self._activity = -1
        self._unacked: dict[str, int] = {}
        self._ages: dict[str, tuple[float, float]] = {}  # family -> (when computed, age)
        #: The scheduler's clamp count per family, as last exported (a new term's scheduler
        #: counts from 0 again; the exported counter only ever grows).
        self._rewinds: dict[str, int] = {}

    def __call__(self, host: Host) -> None:
        self.heartbeat.beat()
        self._host = host
        try:
            self._observe(host)
        except Exception:  # observability must never break scheduling
            log.debug("status snapshot failed", exc_info=True)

    def status(self) -> StatusSnapshot:
        """The loop's last snapshot, with leadership judged now: a term past its renew deadline
        is not reported as leading even while the loop is still blocked, nor is a term the host
        has since replaced by a newer one it claimed (one leader in sight)."""
        snap, host = self.snapshot, self._host
        if host is None or not host.elected:
            return snap
        sups = snap["supervisors"]

        def leads(e: SupervisorStatus) -> bool:
            return e["leader"] and host.keeper.valid(e["key"], e["generation"])

        if all(leads(e) == e["leader"] for e in sups):
            return snap
        return {**snap, "supervisors": [{**e, "leader": leads(e)} for e in sups]}

    def _history_of(self, family: str, completed: int, failed: int) -> list[list[int]]:
        """Invocations per minute (succeeded, failed) over the last hour, for the console's
        chart: the growth of the Supervisor's counters, bucketed by wall-clock minute."""
        minute = int(time.time() // 60)
        last = self._totals.get(family, (completed, failed))
        ok, bad = max(0, completed - last[0]), max(0, failed - last[1])
        self._totals[family] = (completed, failed)
        buckets = self._history.setdefault(family, deque(maxlen=CHART_MINUTES))
        if buckets and buckets[-1][0] == minute:
            buckets[-1][1] += ok
            buckets[-1][2] += bad
        elif ok or bad:
            buckets.append([minute, ok, bad])
        return [list(b) for b in buckets if b[0] > minute - CHART_MINUTES]

    def _request_age(self, sup: Supervisor, family: str) -> float:
        # The oldest of possibly many known requests: looked for at most once a second.
        now = time.monotonic()
        at, age = self._ages.get(family, (0.0, 0.0))
        if now - at >= 1.0:
            age = sup.request_ages.oldest(family, now, sup.controls.parked.get(family, ()))
            self._ages[family] = (now, age)
        return age

    def _read_leases(self, host: Host, now: float) -> None:
        # Elected backends only: a cheap read of the Lease table at the renewal cadence tells a
        # standby who leads, and reports an unreachable database as a lease error.
        if not host.elected or now < self._next_lease_read:
            return
        self._next_lease_read = now + self.lease_read_seconds
        # Membership changes slowly: read with every third lease read (an idle leader's
        # statements are counted; the lease read alone already tells who leads).
        self._lease_reads += 1
        members: list[membership.Member] | None = None
        try:
            with host.backend.read() as conn:
                rows = list(all_leases(conn))
                if self._lease_reads % MEMBER_READ_EVERY == 1:
                    members = membership.members(conn)
        except Exception as exc:
            self._lease_error = (
                f"lease table unreadable: {type(exc).__name__}: {exception_message(exc)}"
            )
            return
        self._lease_error = None
        self._lease_view = {r.supervisor_key: (r.holder_id, r.generation) for r in rows}
        db_now = host.supervisors[0].now() if host.supervisors else datetime.utcnow()
        lease_seconds = host.lease.lease_seconds
        leads: dict[str, list[str]] = {}
        for r in rows:
            if r.holder_id and r.expires_at is not None and r.expires_at > db_now:
                leads.setdefault(r.holder_id, []).append(r.supervisor_key)
        if members is not None:
            self._members = members
        self._replicas = [
            {
                **m.as_dict(),
                "leads": sorted(leads.get(m.holder_id, [])),
                "this": m.holder_id == host.holder_id,
            }
            for m in self._members
            if m.alive(db_now, lease_seconds)
        ]

    def _count(self, host: Host, now: float) -> None:
        # Requested > handled per family, for leaders only. On SQLite only after Worker activity
        # (at most once a second), so an idle host performs no database reads at all (RFC §8).
        if now < self._next_count:
            return
        activity = sum(
            sum(s.completed.values()) + sum(s.failed.values()) + len(s.running)
            for s in host.supervisors
        )
        if not host.elected and activity == self._activity:
            return
        self._next_count = now + (self.count_seconds if host.elected else 1.0)
        self._activity = activity
        leaders = [s for s in host.supervisors if s.term is not None]
        if not leaders:
            return
        try:
            with host.backend.read() as conn:
                for sup in leaders:
                    for fam in sup.families.values():
                        n = intents.count_pending_requests(conn, fam.binding_name)
                        self._unacked[fam.name] = n
                        self.metrics.set_unacknowledged(fam.name, n)
        except Exception:
            log.debug("counting unacknowledged requests failed", exc_info=True)

    def _observe(self, host: Host) -> None:
        now = time.monotonic()
        self._read_leases(host, now)
        self._count(host, now)
        observe_stall(self.metrics, host)
        sups: list[SupervisorStatus] = []
        for sup in host.supervisors:
            snaps = sup.core.snapshot() if sup.core is not None else {}
            unconfirmed = sup.unconfirmed()
            families: dict[str, FamilyStatus] = {}
            for name, fam in sup.families.items():
                snap = snaps.get(name)
                reason: str | None = None
                status: Any = "ok"
                if isinstance(fam.policy, Disabled):
                    status, reason = "disabled", "automatic admission disabled"
                failed = (
                    name in sup.degraded
                    or name in sup.storage_unavailable
                    or name in sup.unreconciled
                    or (snap is not None and snap.degraded)
                )
                if sup.term is not None and failed:
                    status = "degraded"
                    reason = (
                        sup.storage_unavailable.get(name)
                        or sup.degraded.get(name)
                        or sup.unreconciled.get(name)
                        or (snap.last_error_stage if snap is not None else None)
                    )
                if sup.term is not None and sup.core is None:
                    # The Lease is held but the term is not established: nothing dispatches.
                    status, reason = "degraded", sup.establish_error or "establishing term"
                elif sup.term is not None and name in sup.reconciling:
                    pages = sup.reconciling[name].pages
                    status, reason = "degraded", f"reconciling ({pages} pages so far)"
                failing, failing_count = sup.controls.view(name)
                paused = sup.controls.paused.get(name, False)
                if paused and reason is None:  # a choice, like a disabled policy: not degraded
                    reason = "paused by the operator (apsup families resume)"
                age = self._request_age(sup, name)
                running = snap.running if snap is not None else 0
                ready = snap.ready if snap is not None else 0
                retry_wait = snap.retry_wait if snap is not None else 0
                families[name] = {
                    "status": status,
                    "reason": reason,
                    "budget": fam.max_workers,
                    "running": running,
                    "ready": ready,
                    "retry_wait": retry_wait,
                    "next_retry_at": _iso(snap.next_retry_at) if snap is not None else None,
                    "due_at": _iso(snap.due_at) if snap is not None else None,
                    "unacknowledged": self._unacked.get(name),
                    "oldest_request_age": round(age, 1),
                    "unconfirmed": unconfirmed.get(name, 0),
                    "policy": fam.policy.describe(),
                    "paused": paused,
                    "failing_count": failing_count,
                    "failing": failing,
                    "running_scopes": _running_scopes(sup, name),
                }
                self.metrics.update_family(name, fam.max_workers, running, ready, retry_wait)
                if snap is not None:
                    seen, last = snap.clock_rewinds, self._rewinds.get(name, 0)
                    self.metrics.on_clock_rewinds(name, seen - last if seen >= last else seen)
                    self._rewinds[name] = seen
                self.metrics.set_unconfirmed(name, unconfirmed.get(name, 0))
                self.metrics.set_oldest_request_age(name, age)
                families[name]["history"] = self._history_of(
                    name, sup.completed.get(name, 0), sup.failed.get(name, 0)
                )
            term = sup.term
            holder, generation = self._lease_view.get(sup.key, (None, None))  # type: ignore[arg-type]
            if term is not None:
                holder, generation = term.holder_id, term.generation
            if generation is not None:
                self.metrics.set_leadership(
                    sup.key, sup.established, generation, lease_held=term is not None
                )
            entry: SupervisorStatus = {
                "key": sup.key,
                "leader": sup.leader,
                "holder": holder,
                "generation": generation,
                "families": families,
            }
            if host.balancer is not None:
                entry["preferred_replica"] = host.balancer.preferred(sup.key)
                entry["handing_off_to"] = sup.handing_off
            if self._lease_error is not None:
                entry["lease_error"] = self._lease_error
            elif host.startup_error is not None:
                entry["lease_error"] = host.startup_error
            sups.append(entry)
        self.snapshot = {
            "role": self.role,
            "mode": self.mode,
            "supervisors": sups,
            "heartbeat_age": 0.0,
        }
        if host.elected:
            self.snapshot["replicas"] = self._replicas


def _check_schema(backend: SqlBackend, families: Sequence[Family] = ()) -> bool:
    """Fail fast with a clear message on a configuration error (schema missing or at another
    revision, credentials refused, no such database); an infrastructure error is logged and
    returns False: the host runs the check again before its first claim, retrying until the
    database answers (a standby must not exit because the database is briefly away)."""
    try:
        check_schema(backend, reference_families=needs_reference_tables(families))
    except DBAPIError as exc:
        log.warning(
            "database check failed at startup; will keep trying",
            extra={**error_fields(exc)},
        )
        return False
    return True


class Runtime:
    """One replica of apsup: see the module docstring.

    ``backoff`` replaces the RFC §7 failure backoff (tests and embedders that need quick
    retries); ``heartbeat_seconds`` bounds how long the loop sleeps without beating.
    ``configure_logs``: install apsup's log handler with the settings' ``LOG_FORMAT`` and
    ``LOG_LEVEL``; by default only when ``run()`` is called on the main thread (a process entry
    point such as ``apsup run``), never for a Runtime embedded on another thread.
    """

    def __init__(
        self,
        settings: Settings,
        registry: Registry,
        *,
        backoff: Backoff | None = None,
        heartbeat_seconds: float = HEARTBEAT_SECONDS,
        liveness_timeout: float = LIVENESS_TIMEOUT,
        configure_logs: bool | None = None,
    ) -> None:
        self.settings = settings
        self.registry = registry
        self.backoff = backoff
        self.heartbeat_seconds = heartbeat_seconds
        self.liveness_timeout = liveness_timeout
        self.configure_logs = configure_logs
        self.topology = check_topology(settings)
        self._stopping = threading.Event()
        self._host: Host | None = None
        self._launcher: DedicatedLauncher | None = None
        self._health: HealthServer | None = None
        self._cluster_backend: SqlBackend | None = None
        #: Set once the HTTP server (if any) is bound and the loop is running.
        self.started = threading.Event()

    # -- public -----------------------------------------------------------------------------
    def families(self) -> list[Family]:
        fams = [self.settings.families[name] for name in sorted(self.settings.families)]
        if not fams:
            raise ConfigError("no family is registered; pass --app with the module defining them")
        return fams

    @property
    def http_port(self) -> int | None:
        """The bound health/metrics port (None when HTTP is off or not started yet)."""
        if self._launcher is not None:
            port: int | None = self._launcher.http_port
            return port
        if self._health is None:
            return None
        try:
            return self._health.port
        except RuntimeError:
            return None

    @property
    def host(self) -> Host | None:
        return self._host

    def stop(self) -> None:
        """Graceful stop, from any thread or a signal handler."""
        self._stopping.set()
        if self._host is not None:
            self._host.stop()
        if self._launcher is not None:
            self._launcher.stop()

    def run(self) -> None:
        """Run until SIGTERM/SIGINT (main thread) or ``stop()``."""
        s = self.settings
        register_dsn(s.database_url)  # any log line that quotes the DSN or its password is masked
        configure = main_thread() if self.configure_logs is None else self.configure_logs
        if configure:
            configure_logs(s.log_format, s.log_level)
        log.info(
            "runtime starting",
            extra={
                "role": s.role,
                "mode": s.mode,
                "backend": s.backend,
                "topology": self.topology,
            },
        )
        with signals(self.stop):
            if self.topology == "api":
                self._run_api()
            elif self.topology == "processes":
                backend = open_backend(s.database_url, control=True)  # time-limited calls
                try:
                    _check_schema(backend, self.families())
                finally:
                    backend.dispose()  # no connection survives into the children's spawn
                self._launcher = DedicatedLauncher(s, self.registry, backoff=self.backoff)
                if self._stopping.is_set():
                    return
                self._launcher.run(on_started=self.started.set)
            else:
                self.run_host(self.families(), s.mode)

    # -- roles ------------------------------------------------------------------------------
    def _start_http(
        self,
        status: Callable[[], StatusSnapshot],
        metrics: Any,
        heartbeat: Heartbeat | None,
        own: Own = None,
    ) -> None:
        port = self.settings.http_port
        if port is None:
            return
        s = self.settings
        # Its own pool: the cluster view is read on the listener's threads, never on the loop's
        # connections (whose calls are bounded by the loop's renew deadlines).
        self._cluster_backend = open_backend(s.database_url, control=True)
        cluster = ClusterProvider(
            self._cluster_backend,
            s.database_url,
            lease_seconds=s.lease_seconds,
            local=status,
            own=own,
            families={f.name: f for f in self.families()},
        )
        self._health = HealthServer(
            metrics=metrics,
            status=status,
            cluster=cluster,
            auth=ConsoleAuth(s.console_token),
            heartbeat=heartbeat,
            liveness_timeout=self.liveness_timeout,
            host=self.settings.http_host,
            port=port,
        )
        self._health.start()
        log.info("http listening", extra={"host": self.settings.http_host, "port": self.http_port})

    def _stop_http(self) -> None:
        if self._health is not None:
            self._health.stop()
        if self._cluster_backend is not None:
            self._cluster_backend.dispose()
            self._cluster_backend = None

    def _run_api(self) -> None:
        """Serve health and metrics; claim nothing, dispatch nothing, start no Workers."""
        s = self.settings
        backend = open_backend(s.database_url, control=True)  # time-limited calls
        try:
            _check_schema(backend, self.families())
        finally:
            backend.dispose()
        log_startup(
            log,
            mode=s.mode,
            role=s.role,
            families=_any(self.families()),
            aliases=s.aliases_in_use,
            database_url=s.database_url,
        )
        heartbeat = Heartbeat()
        metrics = SupervisorMetrics(families=[f.name for f in self.families()])
        snapshot: StatusSnapshot = {
            "role": "api",
            "mode": s.mode,
            "supervisors": [],
            "heartbeat_age": 0.0,
        }
        self._start_http(lambda: snapshot, metrics, heartbeat)
        self.started.set()
        try:
            while not self._stopping.wait(self.heartbeat_seconds):
                heartbeat.beat()
        finally:
            self._stop_http()
            log.info("runtime stopped", extra={"role": "api"})

    def run_host(self, families: Sequence[Family], mode: str) -> None:
        """One host process running every Supervisor of ``mode`` for ``families``.

        Used for ``global`` (any backend), ``dedicated`` on SQLite, and by each per-family child
        of the dedicated launcher on MySQL.
        """
        s = self.settings
        lease = LeasePolicy(
            s.lease_seconds, s.renew_seconds, s.poll_seconds, s.renew_deadline_seconds or None
        )
        metrics = SupervisorMetrics(families=[f.name for f in families])
        publish_intervals(metrics, families)
        worker_env = s.worker_env(families[0].name) if len(families) == 1 else s.worker_env()
        backend = open_backend(s.database_url, control=True)  # time-limited calls
        try:
            schema_checked = _check_schema(backend, families)
        finally:
            backend.dispose()
        relay = WorkerLogRelay()  # Worker logging, print and stderr join this process's log
        worker_env.update(relay.env())
        try:
            bundle = build_host(
                s.database_url,
                list(families),
                mode=mode,
                lease=lease,
                worker_settings=worker_env,
                hooks=MetricsHooks(metrics, relay),
                shutdown_grace=s.shutdown_grace_seconds,
                backoff=self.backoff,
                stopping=self._stopping.is_set,
            )
        except StartupInterrupted:
            relay.close()
            log.info("runtime stopped during startup", extra={"mode": mode, "role": s.role})
            return
        host = bundle.host
        host.shutdown_drain = s.shutdown_drain_seconds
        if not schema_checked:  # checked again before the first claim, until it can run
            host.preflight.insert(
                0,
                functools.partial(
                    check_schema,
                    bundle.backend,
                    reference_families=needs_reference_tables(families),
                ),
            )
        heartbeat = Heartbeat()
        observer = HostObserver(
            role=s.role,
            mode=s.mode,
            metrics=metrics,
            heartbeat=heartbeat,
            lease_read_seconds=s.renew_seconds,
        )
        host.on_cycle = observer
        metrics.add_refresher(ScrapeCounter(host, metrics, observer._unacked))
        self._host = host
        if self._stopping.is_set():
            host.stop()
        try:
            self._start_http(
                observer.status, metrics, heartbeat, own_processes(holder=host.holder_id)
            )
            if bundle.control is not None and self.http_port is not None:
                bundle.control.publish_listener(self.settings.http_host, self.http_port)
            host.member = _member(host, s, self.http_port)
            if host.elected and host.listener is None and self.http_port is not None:
                try:  # publishers nudge the leaders here (``apsup.supervisor.nudge``)
                    host.nudges = NudgeListener(s.http_host, self.http_port)
                except OSError as exc:
                    log.warning(
                        "nudges not received: the poll alone finds requests",
                        extra=error_fields(exc),
                    )
            if mode == "dedicated" and host.elected:
                host.balancer = Balancer(
                    replica_id=host.member.replica_id,
                    families=sorted(s.families),
                    lease_seconds=s.lease_seconds,
                    refresh_seconds=s.lease_seconds / 2,
                )
                # A handover waits for running Workers at most as long as a shutdown would,
                # and no longer than a Lease and a renewal (balance follows within bounds).
                host.handoff_drain = min(
                    s.shutdown_drain_seconds, s.lease_seconds + s.renew_seconds
                )
            host.start()
            observer(host)
            log_startup(
                log,
                mode=s.mode,
                role=s.role,
                families=_any(families),
                terms={
                    sup.key: sup.term.generation for sup in host.supervisors if sup.term is not None
                },
                aliases=s.aliases_in_use,
                database_url=s.database_url,
            )
            self.started.set()
            while not host.stopping.is_set():
                host.cycle(max_wait=self.heartbeat_seconds)
        finally:
            try:
                host.shutdown()
            finally:
                if host.nudges is not None:
                    host.nudges.close()
                bundle.close()
                self._stop_http()
                relay.close()
                self._host = None
                log.info("runtime stopped", extra={"mode": mode, "role": s.role})


def _member(host: Host, s: Settings, port: int | None) -> membership.Member:
    now = datetime.now(UTC).replace(tzinfo=None)  # replaced by database time when written
    from apsup import __version__

    return membership.Member(
        holder_id=host.holder_id,
        replica_id=os.environ.get(membership.REPLICA_ENV) or s.replica_id or host.holder_id,
        host_name=socket.gethostname(),
        pid=os.getpid(),
        version=__version__,
        role=s.role,
        mode=s.mode,
        http_address=None if port is None else f"http://{_advertised(s.http_host)}:{port}",
        started_at=now,
        last_seen=now,
    )


def _advertised(host: str) -> str:
    """The address others reach this host's listener at: the bind address, or for a wildcard
    bind the address this machine's name resolves to (a pod's or container's own IP)."""
    if host in ("0.0.0.0", "::", ""):
        try:
            host = socket.gethostbyname(socket.gethostname())
        except OSError:
            host = "127.0.0.1"
    return _url_host(host)


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _running_scopes(sup: Any, family: str, limit: int = 20) -> list[dict[str, Any]]:
    """The running invocations of ``family`` (oldest first, capped): Scope, age, Worker id."""
    now = time.monotonic()
    runs = sorted(
        (inv for inv in list(sup.running.values()) if inv.family.name == family),
        key=lambda inv: inv.started,
    )
    pids: dict[str, int] = {}
    with contextlib.suppress(Exception):  # the pool is the loop's; a racing read shows no pid
        pids = {h.worker_id: h.pid for h in sup.pool.running() if h.pid}
    return [
        {
            "scope": inv.scope_id,
            "age": round(now - inv.started, 3),
            "worker_id": inv.worker_id,
            "pid": pids.get(inv.worker_id),
            "generation": inv.generation,
        }
        for inv in runs[:limit]
    ]


def _any(families: Sequence[Family]) -> list[Any]:
    # log_startup's protocol declares settable attributes; Family is a frozen record.
    return list(families)


__all__ = ["ROLES", "HostObserver", "MetricsHooks", "Runtime", "check_topology"]
