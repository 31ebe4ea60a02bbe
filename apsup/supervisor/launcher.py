"""Organises Supervisors by mode: ``global`` (one key for all families) or ``dedicated``
(one key per family, ``artifact:<family>``).

On SQLite every Supervisor lives in the single host process (the host lock refuses a second
one). On MySQL, ``global`` runs one Supervisor here; ``dedicated`` forks one Supervisor process
per family, restarts a crashed one with backoff, and stops all of them on shutdown.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from apsup.errors import ConfigError, StartupInterrupted, WorkerStartError
from apsup.observability.logging import error_fields
from apsup.registry import Family
from apsup.scheduling import Backoff
from apsup.store import SqlBackend, open_backend, worker_preload
from apsup.store.elected import bounded_fence_url
from apsup.store.leases import GLOBAL_KEY, dedicated_key
from apsup.store.sqlite import database_path, shared_mode
from apsup.supervisor.control import ControlChannel, HostLock
from apsup.supervisor.host import Host, LeasePolicy
from apsup.supervisor.notifications import NotificationListener
from apsup.supervisor.supervisor import Hooks, Supervisor
from apsup.workers.invoke import TARGET
from apsup.workers.pool import WorkerPool
from apsup.workers.warm import ENV as WARM_ENV

log = logging.getLogger("apsup.launcher")

MODES = ("global", "dedicated")


def supervisor_groups(mode: str, families: Sequence[Family]) -> list[tuple[str, list[Family]]]:
    """Lease keys and the families each one schedules; users never name groups (RFC §8)."""
    if mode == "global":
        return [(GLOBAL_KEY, list(families))]
    if mode == "dedicated":
        return [(dedicated_key(f.name), [f]) for f in families]
    raise ConfigError(f"unknown mode {mode!r}: use 'global' or 'dedicated'")


@dataclass
class HostBundle:
    """Everything one host process owns, so it can be closed in order."""

    host: Host
    backend: SqlBackend
    pool: WorkerPool
    lock: HostLock | None = None
    control: ControlChannel | None = None
    closers: list[Callable[[], None]] = field(default_factory=list)

    def close(self) -> None:
        for closer in reversed(self.closers):
            try:
                closer()
            except Exception:  # pragma: no cover - best effort on the way out
                log.exception("close step failed")
        self.pool.close()
        if self.host.listener is not None:
            self.host.listener.close()
        self.backend.dispose()
        if self.control is not None:
            self.control.close()
        if self.lock is not None:
            self.lock.release()


WARM_MODULE = "apsup.workers.warm"


#: A forkserver that failed to start for a transient reason is started again after this delay,
#: doubling up to 5 s, for as long as it takes (a stop request ends the wait).
POOL_START_BACKOFF = Backoff(base=0.2, cap=5.0, jitter=0.0)


def _start_pool_retrying(
    modules: list[str],
    database_url: str,
    grace_seconds: float,
    stopping: Callable[[], bool] | None,
) -> WorkerPool:
    """``_start_pool`` until it succeeds: a transient failure (``WorkerStartError``: a fork the
    kernel refused, the forkserver killed while it imported) is retried with backoff and logged;
    a configuration error raises at once; a stop request (``stopping()``) raises
    ``StartupInterrupted`` instead of whatever the stop itself caused (a forkserver that got the
    same Ctrl-C)."""
    attempt = 0
    while True:
        try:
            return _start_pool(modules, database_url, grace_seconds)
        except (WorkerStartError, ConfigError) as exc:
            if stopping is not None and stopping():
                raise StartupInterrupted("stopped while the Worker forkserver started") from exc
            if isinstance(exc, ConfigError):
                raise
            attempt += 1
            delay = POOL_START_BACKOFF.delay(attempt)
            log.warning(
                "worker forkserver failed to start; retrying",
                extra={**error_fields(exc), "retry_count": attempt, "retry_delay": delay},
            )
            end = time.monotonic() + delay
            while time.monotonic() < end:
                if stopping is not None and stopping():
                    raise StartupInterrupted("stopped while the Worker forkserver started") from exc
                time.sleep(min(0.05, max(0.0, end - time.monotonic())))


def _start_pool(modules: list[str], database_url: str, grace_seconds: float) -> WorkerPool:
    """Start the forkserver with the URL it warms an engine for (``apsup.workers.warm``): in a
    0600 file that the forkserver deletes after reading, so the DSN is never in an environment."""
    fd, path = tempfile.mkstemp(prefix="apsup-warm-")
    previous = os.environ.get(WARM_ENV)
    try:
        os.write(fd, database_url.encode())
        os.close(fd)
        os.environ[WARM_ENV] = path
        return WorkerPool(modules, grace_seconds=grace_seconds)
    finally:
        if previous is None:
            os.environ.pop(WARM_ENV, None)
        else:
            os.environ[WARM_ENV] = previous
        with contextlib.suppress(OSError):
            os.unlink(path)


def _warn_if_not_lean(pool: WorkerPool) -> None:
    """Tell the operator once why Workers fork the slow way: a preloaded module registered an
    at-fork hook or started a thread (``apsup.workers.fork``). Nothing is wrong, only slower."""
    if pool.fork_note is not None:
        log.warning(
            "workers fork with os.fork(), not the lean fork",
            extra={
                "reason": pool.fork_note,
                "cost": "about 0.7 ms more CPU and 190 more copied pages per invocation",
                "fix": "register at-fork hooks and start threads in the processor, not when "
                "the family module is imported (docs/authoring-families.md)",
            },
        )


def _warn_if_shared(database_url: str) -> None:
    path = database_path(database_url)
    mode = shared_mode(path) if path is not None else None
    if path is not None and mode is not None:
        log.warning(
            "database file is accessible to other users",
            extra={"path": str(path), "mode": f"{mode:o}", "fix": f"chmod 600 {path}"},
        )


def build_host(
    database_url: str,
    families: Sequence[Family],
    *,
    mode: str = "global",
    lease: LeasePolicy | None = None,
    worker_settings: dict[str, str] | None = None,
    hooks: Hooks | None = None,
    shutdown_grace: float = 10.0,
    grace_seconds: float = 5.0,
    backoff: Backoff | None = None,
    stopping: Callable[[], bool] | None = None,
) -> HostBundle:
    """A host running every Supervisor of ``mode`` for ``families`` in this process.

    ``stopping``: whether a stop was requested meanwhile (starting the Worker forkserver is
    retried until it succeeds or this says so; ``StartupInterrupted`` then)."""
    if not families:
        raise ConfigError("no family to schedule")
    backend = open_backend(database_url, control=True)  # every call time-limited
    # Workers' fenced transactions are bounded so that one of them can never hold the Lease
    # row past the leader's renew deadline (``LeasePolicy.worker_fence_seconds``).
    worker_url = database_url
    if backend.name != "sqlite":
        lease = lease or LeasePolicy()
        worker_url = bounded_fence_url(database_url, lease.worker_fence_seconds)
    lock: HostLock | None = None
    control: ControlChannel | None = None
    try:
        if backend.name == "sqlite":
            lock = HostLock(database_url)
            lock.acquire()
            control = ControlChannel(database_url)
            _warn_if_shared(database_url)
        # Everything a Worker imports is preloaded by the forkserver once: the families, the
        # invoke wrapper and the backend's dialect + driver (otherwise each launch imports them),
        # and the async engine if an ``async def`` processor may use it.
        asynchronous = any(inspect.iscoroutinefunction(f.processor) for f in families)
        preload = worker_preload(database_url, asynchronous=asynchronous)
        modules = sorted(
            {f.entry_point.split(":", 1)[0] for f in families} | {TARGET.split(":", 1)[0], *preload}
        )
        pool = _start_pool_retrying([*modules, WARM_MODULE], worker_url, grace_seconds, stopping)
        _warn_if_not_lean(pool)
    except BaseException:
        if control is not None:
            control.close()
        if lock is not None:
            lock.release()
        backend.dispose()
        raise
    supervisors = [
        Supervisor(
            key,
            group,
            backend,
            pool,
            database_url=worker_url,
            worker_settings=worker_settings,
            hooks=hooks,
            backoff=backoff,
        )
        for key, group in supervisor_groups(mode, families)
    ]
    host = Host(
        supervisors,
        backend,
        pool,
        lease=lease,
        control=control,
        shutdown_grace=shutdown_grace,
    )
    if backend.name == "postgresql":  # publishers' commits notify (LISTEN/NOTIFY)
        host.listener = NotificationListener(database_url)
    if lock is not None:
        # The lock proves this is the only host: every earlier term, of either mode and of
        # families no longer configured, is invalidated before this host claims its own (a
        # startup step: retried while the database is locked or unavailable).
        host.preflight.append(functools.partial(backend.invalidate_terms, None))
    return HostBundle(host=host, backend=backend, pool=pool, lock=lock, control=control)
