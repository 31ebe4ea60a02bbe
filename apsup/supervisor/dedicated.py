"""Dedicated mode on MySQL/OceanBase: one Supervisor *process* per registered family.

``DedicatedLauncher`` starts ``python -m apsup.supervisor.dedicated_child --family NAME ...``
once per family (``subprocess``: fork + exec of a fresh interpreter, so no database connection,
thread or Worker pool of the launcher leaks into a child). Each child rebuilds the registry from the
families' entry points, reloads the settings from the environment the launcher serialised for
it (the launcher's *effective* settings, so every child agrees with it exactly) and runs one host
with one Supervisor competing for ``artifact:<family>``.

- A child that exits is restarted after 1 s, doubling up to 60 s while it keeps failing; the
  delay resets once a child has stayed up for 60 s. A child exiting with the configuration-error
  code stops the launcher (restarting cannot fix configuration).
- SIGTERM/SIGINT (or ``stop()``): SIGTERM to every child (each stops its Workers within the
  shutdown grace and releases its term), SIGKILL after a bound, and every exit is confirmed with
  ``waitpid`` before the launcher returns.
- Children run in their own session (a terminal's Ctrl-C reaches only the launcher) and ask the
  kernel for SIGTERM if the launcher dies (``PR_SET_PDEATHSIG``), so none is orphaned silently.
- HTTP: with ``HTTP_PORT`` = P the launcher serves liveness and a fan-in ``/readyz``/``/status``
  on P and child *i* (sorted family names) serves its own ``/metrics``/``/status`` on P + 1 + i;
  with P = 0 every server takes an ephemeral port (children report theirs through a file).

Standby children are healthy: they keep trying to claim and never exit for not being elected.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge

from apsup.errors import ConfigError
from apsup.observability.health import HealthServer, Heartbeat, fan_in
from apsup.observability.logging import error_fields
from apsup.observability.metrics import supervisor_port
from apsup.observability.status import StatusSnapshot, SupervisorStatus
from apsup.policy import Cron, Disabled, Interval
from apsup.registry import Registry
from apsup.scheduling import Backoff
from apsup.store.membership import REPLICA_ENV

if TYPE_CHECKING:
    from apsup.config import Settings

log = logging.getLogger("apsup.dedicated")

#: The family child's entry module (the child side lives there, so that this launcher never
#: imports the Runtime that imports it).
MODULE = "apsup.supervisor.dedicated_child"
RESTART_INITIAL = 1.0
RESTART_MAX = 60.0
#: Exit code of a child whose configuration is invalid (same as the CLI's).
EXIT_CONFIG = 2
#: Extra time a child gets after SIGTERM beyond the Worker shutdown grace (release, close).
STOP_MARGIN = 15.0
CONFIRM_TIMEOUT = 10.0


def _num(value: float) -> str:
    return repr(float(value))


def child_env(
    settings: Settings, index: int, base_env: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The environment of the ``index``-th family child: ``base_env`` without any variable under
    the settings prefix, plus the launcher's effective settings written back as variables.

    Reloading them with ``Settings.load`` gives the same effective configuration (policies,
    budgets, timeouts, lease timing), with mode ``dedicated``, role ``background`` and the
    child's own HTTP port.
    """
    p = settings.prefix
    env = {k: v for k, v in (os.environ if base_env is None else base_env).items()}
    for k in list(env):
        if k.startswith(p):
            del env[k]

    def put(name: str, value: str) -> None:
        env[p + name] = value

    put("ARTIFACT_PROCESSING_SUPERVISOR_MODE", "dedicated")
    put("ARTIFACT_PROCESSING_ROLE", "background")
    put("DATABASE_URL", settings.database_url)
    put("HTTP_HOST", settings.http_host)
    if settings.http_port is None:
        put("HTTP_PORT", "off")
    else:
        put("HTTP_PORT", str(supervisor_port(settings.http_port, index)))
    put("LEASE_SECONDS", _num(settings.lease_seconds))
    put("RENEW_SECONDS", _num(settings.renew_seconds))
    put("RENEW_DEADLINE_SECONDS", _num(settings.renew_deadline_seconds))
    put("POLL_SECONDS", _num(settings.poll_seconds))
    put("SHUTDOWN_GRACE_SECONDS", _num(settings.shutdown_grace_seconds))
    put("SHUTDOWN_DRAIN_SECONDS", _num(settings.shutdown_drain_seconds))
    put("LOG_FORMAT", settings.log_format)
    put("LOG_LEVEL", settings.log_level)
    if settings.console_token_file:  # each family process serves a console of its own
        put("CONSOLE_TOKEN_FILE", settings.console_token_file)
    elif settings.console_token:
        put("CONSOLE_TOKEN", settings.console_token)
    for fam in settings.families.values():
        fp = fam.prefix + "_"
        policy = fam.policy
        if isinstance(policy, Interval):
            put(fp + "SCHEDULE_SECONDS", _num(policy.seconds))
        elif isinstance(policy, Cron):
            put(fp + "CRON", policy.expr)
            put(fp + "TIMEZONE", policy.timezone)
        elif isinstance(policy, Disabled):
            put(fp + "SCHEDULE_ENABLED", "false")
        else:  # pragma: no cover - the policy set is closed
            raise ConfigError(f"family {fam.name!r}: cannot pass policy {policy!r} to a child")
        put(fp + "MAX_WORKERS", str(fam.max_workers))
        put(fp + "WORKER_TIMEOUT_SECONDS", _num(fam.timeout))
    return env


def child_command(
    settings: Settings,
    family: str,
    *,
    port_file: Path | None = None,
    backoff: Backoff | None = None,
    python: str | None = None,
) -> list[str]:
    """argv of one family child. Only names cross argv: never the DSN (it is in the env)."""
    cmd = [python or sys.executable, "-m", MODULE, "--family", family, "--prefix", settings.prefix]
    for fam in sorted(settings.families.values(), key=lambda f: f.name):
        cmd += ["--entry", fam.entry_point]
    cmd += ["--parent", str(os.getpid())]
    if port_file is not None:
        cmd += ["--port-file", str(port_file)]
    if backoff is not None:
        cmd += [
            "--backoff",
            f"{backoff.base}:{backoff.factor}:{backoff.cap}:{backoff.jitter}",
        ]
    return cmd


def default_replica_id(http_port: int | None) -> str:
    """A replica id stable across restarts where the deployment gives one: the host name
    with the fixed HTTP port (several replicas on one machine differ by port); with no fixed
    port, the host name and a random suffix (unique, but new at each start)."""
    host = socket.gethostname() or "replica"
    suffix = str(http_port) if http_port else uuid.uuid4().hex[:12]
    return f"{host[: 63 - len(suffix)]}:{suffix}"


@dataclass
class _Child:
    family: str
    index: int
    port_file: Path
    proc: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    next_start: float = 0.0
    delay: float = RESTART_INITIAL
    restarts: int = 0
    exits: list[int] = field(default_factory=list)

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def port(self) -> int | None:
        try:
            return int(self.port_file.read_text().strip())
        except (OSError, ValueError):
            return None


class DedicatedLauncher:
    """Supervises one child process per family; see the module docstring."""

    def __init__(
        self,
        settings: Settings,
        registry: Registry | None = None,
        *,
        backoff: Backoff | None = None,
        restart_initial: float = RESTART_INITIAL,
        restart_max: float = RESTART_MAX,
        liveness_timeout: float = 30.0,
        python: str | None = None,
    ) -> None:
        if not settings.families:
            raise ConfigError("no family is registered; pass --app with the module defining them")
        self.settings = settings
        self.registry = registry
        self.backoff = backoff
        self.restart_initial = restart_initial
        self.restart_max = restart_max
        self.liveness_timeout = liveness_timeout
        self.python = python
        #: This replica's id in membership, shared by its per-family Supervisor processes.
        self.replica_id = settings.replica_id or default_replica_id(settings.http_port)
        self.stop_timeout = (
            settings.shutdown_drain_seconds + settings.shutdown_grace_seconds + STOP_MARGIN
        )
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._tmp: Path | None = None
        self.children: list[_Child] = []
        self.fatal: str | None = None
        self._health: HealthServer | None = None
        self.metrics = CollectorRegistry()
        self._running_gauge = Gauge(
            "apsup_dedicated_children_running",
            "Per-family Supervisor processes currently running.",
            registry=self.metrics,
        )
        self._restarts = Counter(
            "apsup_dedicated_child_restarts",
            "Restarts of a per-family Supervisor process.",
            ("family",),
            registry=self.metrics,
        )
        for name in settings.families:
            self._restarts.labels(name)

    # -- control ------------------------------------------------------------------------------
    def stop(self) -> None:
        if self._stopping.is_set():  # a second SIGTERM/SIGINT: the children skip their drain
            for child in list(self.children):
                if child.proc is not None:
                    with contextlib.suppress(OSError):
                        child.proc.send_signal(signal.SIGTERM)
        self._stopping.set()

    @property
    def http_port(self) -> int | None:
        return None if self._health is None else self._health.port

    def pids(self) -> dict[str, int | None]:
        with self._lock:
            return {c.family: c.pid for c in self.children}

    # -- loop ---------------------------------------------------------------------------------
    def run(self, on_started: Callable[[], None] | None = None) -> None:
        """Start every child, keep them running until stopped, then stop them all."""
        self._tmp = Path(tempfile.mkdtemp(prefix="apsup-dedicated-"))
        names = sorted(self.settings.families)
        self.children = [_Child(n, i, self._tmp / f"{i}.port") for i, n in enumerate(names)]
        heartbeat = Heartbeat()
        cluster_backend = None
        try:
            if self.settings.http_port is not None:
                from apsup.observability.cluster import ClusterProvider, own_processes
                from apsup.observability.console_auth import ConsoleAuth
                from apsup.store import open_backend

                # The cluster view's own pool (read on the listener's threads); this replica's
                # family processes are in ``_status`` already.
                cluster_backend = open_backend(self.settings.database_url, control=True)
                self._health = HealthServer(
                    metrics=self.metrics,
                    status=self._status,
                    cluster=ClusterProvider(
                        cluster_backend,
                        self.settings.database_url,
                        lease_seconds=self.settings.lease_seconds,
                        local=self._status,
                        own=own_processes(replica=self.replica_id),
                        families=self.settings.families,
                    ),
                    auth=ConsoleAuth(self.settings.console_token),
                    heartbeat=heartbeat,
                    liveness_timeout=self.liveness_timeout,
                    host=self.settings.http_host,
                    port=self.settings.http_port,
                )
                self._health.start()
            log.info(
                "dedicated launcher starting",
                extra={"families": names, "http_port": self.http_port},
            )
            now = time.monotonic()
            for child in self.children:
                child.next_start = now
            started = False
            while not self._stopping.is_set():
                self._reap()
                if self.fatal is not None:
                    break
                self._start_due()
                heartbeat.beat()
                if not started:
                    started = True
                    if on_started is not None:
                        on_started()
                self._stopping.wait(self._sleep_for())
        finally:
            self._stop_children()
            if self._health is not None:
                self._health.stop()
            if cluster_backend is not None:
                cluster_backend.dispose()
            shutil.rmtree(self._tmp, ignore_errors=True)
            log.info("dedicated launcher stopped")
        if self.fatal is not None:
            raise ConfigError(self.fatal)

    def _sleep_for(self) -> float:
        now = time.monotonic()
        waits = [c.next_start - now for c in self.children if c.proc is None]
        return max(0.05, min([0.5, *waits]))

    def _spawn(self, child: _Child) -> None:
        with contextlib.suppress(FileNotFoundError):
            child.port_file.unlink()
        cmd = child_command(
            self.settings,
            child.family,
            port_file=child.port_file,
            backoff=self.backoff,
            python=self.python,
        )
        env = child_env(self.settings, child.index)
        env[REPLICA_ENV] = self.replica_id  # its children are one replica in membership
        try:
            proc = subprocess.Popen(  # our own interpreter and module
                cmd, env=env, stdin=subprocess.DEVNULL, start_new_session=True, close_fds=True
            )
        except OSError as exc:
            log.error(
                "could not start family Supervisor process",
                extra={"family": child.family, **error_fields(exc)},
            )
            self._schedule_restart(child, time.monotonic(), uptime=0.0)
            return
        with self._lock:
            child.proc = proc
            child.started = time.monotonic()
        log.info(
            "family Supervisor process started",
            extra={"family": child.family, "pid": proc.pid, "restarts": child.restarts},
        )
        self._running_gauge.set(sum(1 for c in self.children if c.proc is not None))

    def _start_due(self) -> None:
        now = time.monotonic()
        for child in self.children:
            if child.proc is None and now >= child.next_start and not self._stopping.is_set():
                self._spawn(child)

    def _schedule_restart(self, child: _Child, now: float, uptime: float) -> None:
        if uptime >= self.restart_max:
            child.delay = self.restart_initial  # it ran fine for a while: start the sequence over
        child.next_start = now + child.delay
        child.delay = min(child.delay * 2, self.restart_max)
        child.restarts += 1
        self._restarts.labels(child.family).inc()

    def _reap(self) -> None:
        now = time.monotonic()
        for child in self.children:
            proc = child.proc
            if proc is None:
                continue
            code = proc.poll()  # waitpid(WNOHANG): a confirmed exit, never a pid probe
            if code is None:
                continue
            uptime = now - child.started
            with self._lock:
                child.proc = None
                child.exits.append(code)
            self._running_gauge.set(sum(1 for c in self.children if c.proc is not None))
            if code == EXIT_CONFIG:
                self.fatal = (
                    f"the Supervisor process of family {child.family!r} rejected its "
                    "configuration (see its log); not restarting it"
                )
                log.error("family Supervisor configuration error", extra={"family": child.family})
                return
            self._schedule_restart(child, now, uptime)
            log.warning(
                "family Supervisor process exited; restarting",
                extra={
                    "family": child.family,
                    "exit_code": code,
                    "uptime": round(uptime, 3),
                    "retry_delay": round(child.next_start - now, 3),
                },
            )

    def _stop_children(self) -> None:
        running = [c for c in self.children if c.proc is not None]
        for child in running:
            assert child.proc is not None
            with contextlib.suppress(ProcessLookupError):
                child.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.stop_timeout
        for child in running:
            assert child.proc is not None
            try:
                child.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.error(
                    "family Supervisor process did not stop in time; killing it",
                    extra={"family": child.family, "pid": child.proc.pid},
                )
                with contextlib.suppress(ProcessLookupError):
                    child.proc.kill()
        for child in running:
            assert child.proc is not None
            try:
                code = child.proc.wait(timeout=CONFIRM_TIMEOUT)
            except subprocess.TimeoutExpired:
                log.error(
                    "family Supervisor process exit could not be confirmed",
                    extra={"family": child.family, "pid": child.proc.pid},
                )
                continue
            with self._lock:
                child.exits.append(code)
                child.proc = None
            log.info(
                "family Supervisor process stopped",
                extra={"family": child.family, "exit_code": code},
            )
        self._running_gauge.set(sum(1 for c in self.children if c.proc is not None))

    # -- status -------------------------------------------------------------------------------
    def _status(self) -> StatusSnapshot:
        urls: list[str] = []
        missing: list[SupervisorStatus] = []
        host = self.settings.http_host
        if host in ("0.0.0.0", "::", ""):
            host = "127.0.0.1"
        elif ":" in host:
            host = f"[{host}]"
        for child in list(self.children):
            port = child.port() if child.proc is not None else None
            if port is None:
                missing.append(
                    {
                        "key": f"artifact:{child.family}",
                        "leader": False,
                        "holder": None,
                        "generation": None,
                        "families": {},
                        "lease_error": "family Supervisor process not running (restarting)"
                        if child.proc is None
                        else "family Supervisor process starting",
                    }
                )
            else:
                urls.append(f"http://{host}:{port}")
        merged = fan_in(urls, liveness_timeout=self.liveness_timeout)() if urls else None
        sups = ([] if merged is None else merged["supervisors"]) + missing
        snap: StatusSnapshot = {
            "role": self.settings.role,
            "mode": "dedicated",
            "supervisors": sups,
            "heartbeat_age": None,
        }
        if merged is not None and "replicas" in merged:
            snap["replicas"] = merged["replicas"]
        return snap
