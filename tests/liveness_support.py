"""Helpers for the liveness tests: a host over the liveness families, real database faults."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from sqlalchemy import text

from apsup.observability.health import Heartbeat
from apsup.observability.metrics import SupervisorMetrics
from apsup.observability.status import evaluate_readiness
from apsup.registry import Family
from apsup.scheduling import Backoff, KeyState
from apsup.store import SqlBackend, intents, migrate, open_backend
from apsup.supervisor.host import Host, LeasePolicy
from apsup.supervisor.launcher import HostBundle, build_host
from apsup.supervisor.runtime import HostObserver
from apsup.supervisor.supervisor import Hooks, Supervisor

FAST_BACKOFF = Backoff(base=0.3, factor=2.0, cap=1.2, jitter=0.1)
INTENTS = "pc_artifact_processing_intents"
BINDING_STATES = "pc_artifact_processing_binding_states"


@contextlib.contextmanager
def live_host(
    db_url: str,
    families: list[Family],
    workdir: Path,
    *,
    lease: LeasePolicy | None = None,
    hooks: Hooks | None = None,
    start: bool = True,
    backoff: Backoff = FAST_BACKOFF,
) -> Iterator[HostBundle]:
    """A migrated database and a host over ``families`` whose Workers talk through ``workdir``;
    an observer publishes the status snapshot (``readiness(bundle.host)``)."""
    migrate(db_url)
    bundle = build_host(
        db_url,
        families,
        lease=lease or LeasePolicy(3.0, 1.0, 0.5),
        worker_settings={"LIVE_DIR": str(workdir)},
        hooks=hooks,
        shutdown_grace=3.0,
        grace_seconds=2.0,
        backoff=backoff,
    )
    bundle.host.on_cycle = HostObserver(
        role="all",
        mode="global",
        metrics=SupervisorMetrics(families=[f.name for f in families]),
        heartbeat=Heartbeat(),
        lease_read_seconds=1.0,
    )
    try:
        if start:
            bundle.host.start()
        yield bundle
    finally:
        bundle.host.shutdown()
        bundle.close()


class ExitRecorder(Hooks):
    """Records the cause of every classified exit (None = success)."""

    def __init__(self) -> None:
        self.causes: list[tuple[str, str | None]] = []

    def on_exit(self, family: str, cause: str | None, duration: float) -> None:
        self.causes.append((family, cause))


def readiness(host: Host) -> dict[str, Any]:
    """What ``/readyz`` would answer from the snapshot of the host's last cycle."""
    observer = host.on_cycle
    assert isinstance(observer, HostObserver)
    return dict(evaluate_readiness(observer.status(), heartbeat_age=0.0, liveness_timeout=30.0))


def cycle_until(host: Host, predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        host.cycle(max_wait=0.05)


def cycle_for(host: Host, seconds: float, check: Callable[[], None] | None = None) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        host.cycle(max_wait=0.05)
        if check is not None:
            check()


def still_occupied(sup: Supervisor, fam: Family, scope: str) -> Callable[[], None]:
    """A check for ``cycle_for``: the Scope's exit is confirmed but not classified yet: its
    key is still occupied (no second Worker for it), its budget slot is free again (the
    Worker is gone), and nothing was counted."""

    def check() -> None:
        assert sup.core is not None
        assert sup.core.key_state(fam.name, scope) is KeyState.EXITED
        assert sup.core.running_count(fam.name) == 0
        assert sup.completed[fam.name] == 0 and sup.failed[fam.name] == 0

    return check


def request(backend: SqlBackend, fam: Family, scope: str) -> int:
    with backend.transaction() as conn:
        return fam.request(conn, scope)


def handled(backend: SqlBackend, fam: Family, scope: str, generation: int) -> bool:
    with backend.read() as conn:
        row = intents.get(conn, fam.binding_name, scope)
    return row is not None and row.handled_generation >= generation


def rename_table(db_url: str, old: str, new: str) -> None:
    """A real fault: the table disappears under its name (and comes back when renamed back)."""
    backend = open_backend(db_url)
    try:
        with backend.engine.begin() as conn:
            conn.execute(text(f"ALTER TABLE {old} RENAME TO {new}"))
    finally:
        backend.dispose()
