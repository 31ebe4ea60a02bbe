"""A full disk under the SQLite database is an infrastructure condition: readiness degrades, the
log and a metric say so, no Scope's backoff grows, and work resumes promptly once writes succeed.

The database lives on a real tmpfs with a size limit (mounted here as root), filled to the last
byte by a filler file: SQLite itself returns SQLITE_FULL, nothing is simulated.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from apsup.observability.health import Heartbeat
from apsup.observability.metrics import SupervisorMetrics
from apsup.observability.status import evaluate_readiness
from apsup.store import SqlBackend, migrate, open_backend
from apsup.store.storage import storage_error_kind
from apsup.supervisor.runtime import HostObserver, MetricsHooks
from tests.acceptance import families as fams
from tests.acceptance.families import configure
from tests.acceptance.harness import handled, request, scope_events
from tests.faults.conftest import Hosts
from tests.faults.sqlite_faults import fill, small_tmpfs

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def small_volume(tmp_path: Path) -> Iterator[Path]:
    """A 6 MiB tmpfs; skipped (saying why) where this process may not mount."""
    with small_tmpfs(tmp_path / "vol") as vol:
        if vol is None:
            pytest.skip("cannot mount a size-limited tmpfs here (needs root)")
        yield vol


@pytest.fixture
def full_store(small_volume: Path) -> Iterator[SqlBackend]:
    url = f"sqlite:///{small_volume / 'apsup.db'}"
    migrate(url)
    backend = open_backend(url)
    fams.create_tables(backend.engine)
    try:
        yield backend
    finally:
        backend.dispose()


@pytest.mark.backends("sqlite")
def test_full_disk_degrades_readiness_without_backoff_and_recovers(
    full_store: SqlBackend, small_volume: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = full_store
    fam = configure("acc-manual", disabled=True, max_workers=3)
    hosts = Hosts(store.url, tmp_path)
    try:
        host = hosts.live_host([fam], worker_settings={"ACC_SLEEP": "1.5"})
        metrics = SupervisorMetrics(families=[fam.name])
        observer = HostObserver(
            role="all", mode="global", metrics=metrics, heartbeat=Heartbeat(), lease_read_seconds=1
        )
        host.host.on_cycle = observer
        sup = host.supervisor
        sup.hooks = MetricsHooks(metrics)
        scopes = ["ok.1", "ok.2", "ok.3"]
        for scope in scopes:
            request(store, fam, scope)
        host.run_until(lambda: all(scope_events(store, fam, s) for s in scopes), "Workers start")
        caplog.set_level(logging.WARNING, logger="apsup.supervisor")
        filler = fill(small_volume)  # the Workers' acknowledgments now hit a full disk
        host.run_until(lambda: fam.name in sup.storage_unavailable, "the host sees a full disk")
        host.run_for(3.0)  # several retries against the full disk
        assert not any(handled(store, fam, s) for s in scopes)
        # Infrastructure, not the processor: no failure counted, no Scope's backoff grows.
        assert sup.failed[fam.name] == 0
        core = sup.core
        assert core is not None
        for scope in scopes:
            info = core.key_info(fam.name, scope)
            assert info is None or info.consecutive_failures == 0, info
        ready = evaluate_readiness(observer.status(), heartbeat_age=0.0, liveness_timeout=30)
        assert ready["status"] == "degraded", ready
        assert ready["families"][fam.name]["reason"] == "storage: disk full", ready
        scraped = generate_latest(metrics.registry).decode()
        count = [
            line
            for line in scraped.splitlines()
            if line.startswith("apsup_storage_errors_total{") and 'kind="full"' in line
        ]
        assert count and float(count[0].rsplit(" ", 1)[1]) >= 1, count
        said = [r for r in caplog.records if r.getMessage().startswith("storage unavailable")]
        assert said and said[0].__dict__.get("error_code") == "full"
        # Space comes back: work resumes promptly (the short fixed retry delay, no backoff).
        filler.unlink()
        freed = time.monotonic()
        host.run_until(lambda: all(handled(store, fam, s) for s in scopes), "work resumes")
        resumed = time.monotonic() - freed
        host.run_until(lambda: not sup.storage_unavailable, "the condition clears")
        host.cycle()
        ready = evaluate_readiness(observer.status(), heartbeat_age=0.0, liveness_timeout=30)
        assert ready["status"] == "ok", ready
        assert sup.failed[fam.name] == 0
        print(f"work resumed {resumed:.2f}s after space returned")
        assert resumed < 20, resumed
    finally:
        hosts.close()


def test_storage_errors_are_recognised_from_the_real_drivers(tmp_path: Path) -> None:
    import sqlite3

    conn = sqlite3.connect(tmp_path / "ro.db")
    conn.execute("CREATE TABLE t (x)")
    conn.commit()
    conn.close()
    ro = sqlite3.connect(f"file:{tmp_path / 'ro.db'}?mode=ro", uri=True)
    with pytest.raises(sqlite3.OperationalError) as err:
        ro.execute("INSERT INTO t VALUES (1)")
    assert storage_error_kind(err.value) == "read_only"
    with (
        contextlib.closing(sqlite3.connect(tmp_path / "ok.db")) as ok,
        pytest.raises(sqlite3.OperationalError) as err2,
    ):
        ok.execute("SELECT * FROM missing")
    assert storage_error_kind(err2.value) is None  # an ordinary error stays ordinary


@pytest.mark.backends("mysql")
def test_read_only_refusal_from_the_server_is_a_storage_error(backend: SqlBackend) -> None:
    """A real refusal from the MySQL-compatible server (a write in a READ ONLY transaction,
    error 1792) is recognised through SQLAlchemy's wrapping; an ordinary error is not."""
    from sqlalchemy import text
    from sqlalchemy.exc import DBAPIError

    with backend.engine.connect() as conn:
        conn.exec_driver_sql("CREATE TABLE IF NOT EXISTS ro_probe (id INT PRIMARY KEY)")
        conn.commit()
        conn.exec_driver_sql("START TRANSACTION READ ONLY")
        with pytest.raises(DBAPIError) as err:
            conn.execute(text("INSERT INTO ro_probe VALUES (1)"))
        conn.rollback()
        with pytest.raises(DBAPIError) as err2:
            conn.execute(text("SELECT * FROM no_such_table"))
        conn.rollback()
    assert storage_error_kind(err.value) == "read_only"
    assert storage_error_kind(err2.value) is None
