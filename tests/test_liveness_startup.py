"""A host whose database does not answer at startup stays up, reports not ready, says why in the
log and starts dispatching once the database answers; a configuration error still ends it at
once with ``ConfigError`` (exit code 2 from ``apsup run``).

Real faults: on SQLite another connection holds the write lock (``BEGIN IMMEDIATE``) while the
host starts, so its first write (invalidating earlier terms, bumping the term) fails with
"database is locked"; on MySQL the host connects through the fault proxy, which accepts
connections but forwards nothing until it is healed (the server is unreachable).
"""

from __future__ import annotations

import contextlib
import logging
import sqlite3
import threading
import time
from collections.abc import Iterator

import pytest
from sqlalchemy.engine import make_url

from apsup.errors import ConfigError
from apsup.store import migrate, open_backend
from apsup.store.sqlite import database_path
from apsup.supervisor.runtime import Runtime
from tests import liveness_families as lf
from tests.faults.proxy import FaultProxy
from tests.liveness_support import handled, request
from tests.replicas.support import http_get, running, settings_for, wait_for

pytestmark = pytest.mark.timeout(180)

#: How long the database stays unavailable after the host was started.
OUTAGE = 4.0


class _Outage:
    """The database unavailable to the host until ``end()``; ``url`` is what the host uses."""

    def __init__(self, db_url: str, backend_name: str) -> None:
        self.db_url = db_url
        self.backend_name = backend_name
        self.url = db_url
        self._lock: sqlite3.Connection | None = None
        self._proxy: FaultProxy | None = None

    def begin(self) -> None:
        if self.backend_name == "sqlite":
            path = database_path(self.db_url)
            assert path is not None
            self._lock = sqlite3.connect(str(path), isolation_level=None, timeout=0)
            self._lock.execute("BEGIN IMMEDIATE")  # holds the write lock: writers get BUSY
        else:
            self._proxy = FaultProxy.for_url(self.db_url).start()
            self._proxy.blackhole()
            self.url = self._proxy.url(self.db_url)

    def end(self) -> None:
        if self._lock is not None:
            self._lock.rollback()
            self._lock.close()
            self._lock = None
        if self._proxy is not None:
            self._proxy.heal()

    def close(self) -> None:
        self.end()
        if self._proxy is not None:
            self._proxy.stop()


@contextlib.contextmanager
def outage(db_url: str, backend_name: str) -> Iterator[_Outage]:
    o = _Outage(db_url, backend_name)
    o.begin()
    try:
        yield o
    finally:
        o.close()


def test_host_waits_for_the_database_at_startup(
    db_url: str, backend_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="apsup")
    migrate(db_url)
    backend = open_backend(db_url)
    try:
        g = request(backend, lf.live_work, "ok.startup")
        with outage(db_url, backend_name) as fault:
            runtime = Runtime(settings_for(fault.url, registry=lf.registry), lf.registry)
            with running(runtime, timeout=90):
                port = runtime.http_port
                assert port is not None
                deadline = time.monotonic() + OUTAGE
                samples = 0
                while time.monotonic() < deadline:
                    code, body = http_get(port, "/readyz")
                    assert body["status"] != "ok", body  # not ready while it cannot claim
                    assert code == 503, body
                    samples += 1
                    time.sleep(0.2)
                assert samples > 0
                assert not handled(backend, lf.live_work, "ok.startup", g)
                retries = [
                    r for r in caplog.records if r.getMessage() == "startup step failed; retrying"
                ]
                assert retries, [r.getMessage() for r in caplog.records]
                assert all(getattr(r, "exception_type", None) for r in retries)

                fault.end()
                t0 = time.monotonic()
                wait_for(
                    lambda: handled(backend, lf.live_work, "ok.startup", g),
                    60,
                    "the request is handled once the database answers",
                )
                recovered = time.monotonic() - t0
                wait_for(lambda: http_get(port, "/readyz")[1]["status"] == "ok", 30, "ready")
                print(
                    f"\n{backend_name}: {len(retries)} startup retries logged during the outage; "
                    f"request handled {recovered:.2f}s after the database answered"
                )
    finally:
        backend.dispose()


def _run_until_exit(runtime: Runtime, limit: float) -> BaseException | None:
    """Run ``runtime`` on a thread; return what it raised (None: still running after
    ``limit`` seconds, then stopped)."""
    errors: list[BaseException] = []

    def target() -> None:
        try:
            runtime.run()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(limit)
    if thread.is_alive():
        runtime.stop()
        thread.join(60)
        return None
    return errors[0] if errors else None


@pytest.mark.mysql_only
@pytest.mark.parametrize("fault", ["unknown_database", "bad_password"])
def test_a_wrong_database_url_ends_the_host_at_once(db_url: str, fault: str) -> None:
    """A URL naming a missing database, or refused credentials, is no outage to wait out."""
    url = make_url(db_url)
    if fault == "unknown_database":
        url = url.set(database=(url.database or "apsup") + "_missing_db")
    else:
        url = url.set(password="definitely-not-the-password")
    bad = url.render_as_string(hide_password=False)
    t0 = time.monotonic()
    raised = _run_until_exit(Runtime(settings_for(bad, registry=lf.registry), lf.registry), 30)
    assert isinstance(raised, ConfigError), raised
    assert time.monotonic() - t0 < 30
    assert "DATABASE_URL" in str(raised)


@pytest.mark.mysql_only
def test_a_schema_missing_once_the_database_answers_ends_the_host(db_url: str) -> None:
    """The schema check that could not run at startup (server unreachable) runs before the first
    claim: a database without the schema then ends the host instead of retrying for ever."""
    with outage(db_url, "mysql") as fault:  # db_url is empty: never migrated
        runtime = Runtime(settings_for(fault.url, registry=lf.registry), lf.registry)
        errors: list[BaseException] = []

        def target() -> None:
            try:
                runtime.run()
            except BaseException as exc:
                errors.append(exc)

        thread = threading.Thread(target=target, daemon=True)
        thread.start()
        wait_for(lambda: runtime.started.is_set() or errors, 60, "the runtime started")
        assert not errors, errors  # an unreachable server is no reason to exit
        fault.end()
        thread.join(60)
        if thread.is_alive():
            runtime.stop()
            thread.join(60)
            raise AssertionError("the host kept running on a database without the schema")
    assert errors and isinstance(errors[0], ConfigError), errors
    assert "apsup migrate" in str(errors[0])
