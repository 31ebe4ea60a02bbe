"""Finite time limits on the host's database calls: a half-open connection, a slow statement or a
Worker holding the SQLite write lock delays one call by a bounded time, never forever."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError

from apsup.config import InvalidSettings, Settings
from apsup.errors import ApsupError, ConfigError
from apsup.registry import Registry
from apsup.store import SqlBackend, migrate, open_backend
from apsup.store.leases import new_holder_id
from apsup.store.limits import parse_limits
from tests.acceptance.families import configure
from tests.acceptance.harness import LiveHost, request
from tests.faults.proxy import FaultProxy
from tests.faults.sqlite_faults import write_lock_held

PREFIX = "POWERCONTEXT_SERVER_RUNTIME_"


def _with(url: str, **params: float) -> str:
    sep = "&" if "?" in url else "?"
    return url + sep + "&".join(f"apsup_{k}={v}" for k, v in params.items())


def _outcome(fn: Callable[[], Any], bound: float) -> tuple[float, BaseException | None]:
    """Run ``fn`` in a thread; (seconds it took, what it raised). Fails if it outlives
    ``bound``: on the code before the limits this call never returned."""
    box: dict[str, Any] = {}

    def target() -> None:
        t0 = time.monotonic()
        try:
            fn()
        except BaseException as exc:
            box["exc"] = exc
        box["took"] = time.monotonic() - t0

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(bound)
    assert not thread.is_alive(), f"database call still blocked after {bound:g}s"
    return box["took"], box.get("exc")


@pytest.fixture
def proxied(db_url: str) -> Iterator[tuple[FaultProxy, str]]:
    migrate(db_url)
    with FaultProxy.for_url(db_url) as proxy:
        yield proxy, proxy.url(db_url)


@pytest.mark.backends("mysql")
def test_half_open_connection_ends_within_the_read_timeout(
    proxied: tuple[FaultProxy, str],
) -> None:
    proxy, url = proxied
    backend = open_backend(
        _with(url, connect_timeout=1, read_timeout=1.5, query_timeout=0.5), control=True
    )
    try:
        term = backend.claim_term("global", new_holder_id(), 30)
        assert term is not None
        # Pooled connections go half-open: the renewal's reply never comes.
        proxy.blackhole()
        took, exc = _outcome(lambda: backend.renew_term(term, 30), bound=20)
        assert isinstance(exc, DBAPIError | ApsupError), exc
        assert took < 8, took
        # New connections too: the server's greeting never arrives.
        backend.engine.dispose()
        took, exc = _outcome(backend.now, bound=20)
        assert isinstance(exc, DBAPIError | ApsupError), exc
        assert took < 8, took
        proxy.heal()
        assert backend.renew_term(term, 30) is True  # service resumes on fresh connections
    finally:
        backend.dispose()


@pytest.mark.backends("mysql")
def test_the_server_ends_a_slow_statement_first(db_url: str) -> None:
    migrate(db_url)
    backend = open_backend(_with(db_url, read_timeout=5, query_timeout=0.5), control=True)
    try:

        def slow() -> None:
            with backend.read() as conn:
                conn.execute(text("SELECT SLEEP(3)")).fetchall()

        took, exc = _outcome(slow, bound=20)
        assert isinstance(exc, DBAPIError), exc
        assert exc.orig.args[0] == 4012, exc  # OceanBase: query reached ob_query_timeout
        assert took < 2.5, took
    finally:
        backend.dispose()
    # Worker connections keep the server's own limits.
    worker = open_backend(_with(db_url, read_timeout=5, query_timeout=0.5))
    try:
        with worker.read() as conn:
            assert conn.execute(text("SELECT SLEEP(1)")).scalar_one() == 0
    finally:
        worker.dispose()


@pytest.mark.backends("sqlite")
def test_sqlite_control_write_waits_a_bounded_time_behind_a_workers_lock(
    db_url: str, tmp_path: Path
) -> None:
    migrate(db_url)
    backend: SqlBackend = open_backend(_with(db_url, lock_wait=1), control=True)
    with write_lock_held(db_url.removeprefix("sqlite:///"), 30):
        # Before the limits: 6 attempts x 30 s busy wait = 3 minutes on the loop thread.
        took, exc = _outcome(lambda: backend.claim_term("global", new_holder_id(), 0), bound=60)
        assert exc is not None and "locked" in str(exc).lower() + str(exc.__cause__).lower()
        assert took < 5, took
    assert backend.claim_term("global", new_holder_id(), 0) is not None  # lock gone: it works
    backend.dispose()


def test_limits_parse_with_defaults_and_reject_bad_values() -> None:
    d = parse_limits("mysql+pymysql://u@h/db")
    assert (d.connect_timeout, d.read_timeout, d.query_timeout, d.lock_wait) == (2, 5, 4, 2)
    got = parse_limits("mysql+pymysql://u@h/db?apsup_read_timeout=3&apsup_query_timeout=0")
    assert got.read_timeout == 3 and got.query_timeout == 0
    for bad in (
        "apsup_read_timeout=soon",
        "apsup_read_timeout=0",
        "apsup_connect_timeout=-1",
        "apsup_lock_wait=inf",
        "apsup_query_timeout=6",  # not shorter than the read timeout (5)
    ):
        with pytest.raises(ConfigError, match=bad.split("=")[0]):
            parse_limits(f"mysql+pymysql://u@h/db?{bad}")


def test_bad_limit_in_the_database_url_is_a_configuration_error(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'a.db'}?apsup_lock_wait=forever"
    with pytest.raises(InvalidSettings) as err:
        Settings.load(Registry(), {PREFIX + "DATABASE_URL": url})
    assert "DATABASE_URL" in str(err.value) and "apsup_lock_wait" in str(err.value)
    out = subprocess.run(
        [sys.executable, "-m", "apsup.cli", "check-config", "--app", "apsup.families.profile"],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", PREFIX + "DATABASE_URL": url},
        timeout=120,
    )
    assert out.returncode == 2, out.stderr
    assert "apsup_lock_wait" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "a.db").exists()  # nothing created


def test_explicit_limits_must_fit_in_the_lease() -> None:
    url = "mysql+pymysql://u@h/db?apsup_read_timeout=10&apsup_connect_timeout=5"
    with pytest.raises(InvalidSettings, match="LEASE_SECONDS"):
        Settings.load(Registry(), {PREFIX + "DATABASE_URL": url, PREFIX + "LEASE_SECONDS": "15"})
    ok = Settings.load(Registry(), {PREFIX + "DATABASE_URL": url, PREFIX + "LEASE_SECONDS": "20"})
    assert ok.lease_seconds == 20


def test_discovery_yields_to_a_due_renewal(hosts: Any, store: SqlBackend) -> None:
    """A Supervisor's run of decisions stops once the renewal is due (after one decision at
    least), so renewal never waits behind a long discovery run."""
    fam = configure("acc-manual", disabled=True, max_workers=1)
    host = hosts.live_host([fam])
    host.run_until(lambda: host.supervisor.core is not None, "the term is established")
    for scope in ("ok.1", "ok.2", "ok.3"):
        request(store, fam, scope, tell=False)
    host.supervisor.notify(fam.name)  # due: a request page, then a dispatch
    assert host.supervisor.step(until=time.monotonic()) == 1
    assert host.supervisor.step() >= 1  # the rest runs at the next step


@pytest.mark.backends("mysql")
def test_a_leader_behind_a_black_hole_steps_down_and_recovers(store: SqlBackend) -> None:
    """The host loop keeps cycling while the database is unreachable: the leader whose renewal
    cannot complete steps down within the lease, and claims again once the network heals."""
    with FaultProxy.for_url(store.url) as proxy:
        url = _with(proxy.url(store.url), connect_timeout=1, read_timeout=2, query_timeout=1)
        fam = configure("acc-manual", disabled=True, max_workers=1)
        host = LiveHost(url, [fam])
        try:
            sup = host.supervisor
            host.run_until(lambda: sup.term is not None, "leader")
            first = sup.term
            assert first is not None
            proxy.blackhole()
            t0 = time.monotonic()
            longest = 0.0
            while sup.term is not None:
                assert time.monotonic() - t0 < 60, "still leading behind a black hole"
                c0 = time.monotonic()
                host.cycle(max_wait=0.1)
                longest = max(longest, time.monotonic() - c0)
            stepped_down = time.monotonic() - t0
            assert stepped_down < 15 + 10, stepped_down  # lease 15 s (harness) + slack
            assert longest < 15, longest  # no single cycle blocks for a lease
            proxy.heal()
            proxy.drop()
            host.run_until(lambda: sup.term is not None, "leader again after the heal")
            assert sup.term is not None and sup.term.generation > first.generation
            print(
                f"stepped down {stepped_down:.1f}s into the black hole; longest cycle "
                f"{longest:.1f}s"
            )
        finally:
            host.close()
