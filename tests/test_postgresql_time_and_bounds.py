"""PostgreSQL: database time taken after the lock, in UTC; every host call bounded, even against
a frozen server; transient SQLSTATEs retried; a fenced transaction left open ended by the
server, so it can never hold the Lease row past its bound.

Real server (its ``TimeZone`` is not UTC: ``tests.pg_server``), real sessions, and the fault
proxy for the server that stops answering.
"""

from __future__ import annotations

import threading
import time
from datetime import datetime, timedelta
from pathlib import Path

import psycopg
import pytest
from sqlalchemy import select, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError

from apsup.errors import DeadlinePassed, FencedTransactionTimeout, StaleTermError
from apsup.store import migrate, open_backend
from apsup.store.postgresql import PING_AFTER_IDLE_SECONDS, PostgresqlBackend, sqlstate
from apsup.store.schema import leases
from apsup.supervisor.launcher import build_host
from tests.faults.proxy import FaultProxy
from tests.liveness_families import live_work

pytestmark = pytest.mark.backends("postgresql")
KEY = "artifact:pg-bounds"


def _raw(url: str) -> psycopg.Connection:
    u = make_url(url)
    return psycopg.connect(
        host=u.host, port=u.port, user=u.username, dbname=u.database, autocommit=False
    )


def _hold_lease_row(url: str, seconds: float, locked: threading.Event) -> threading.Thread:
    """Another session locks the Lease row (as every fenced transaction does) for ``seconds``."""

    def run() -> None:
        with _raw(url) as conn:
            conn.execute(
                "SELECT 1 FROM pc_artifact_processing_leases WHERE supervisor_key = %s FOR UPDATE",
                (KEY,),
            )
            locked.set()
            time.sleep(seconds)
            conn.rollback()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert locked.wait(10)
    return t


def test_database_time_is_utc_whatever_the_server_zone(db_url: str) -> None:
    migrate(db_url)
    store = open_backend(db_url)
    try:
        with store.read() as conn:
            zone = conn.execute(text("SELECT current_setting('TimeZone')")).scalar_one()
        with _raw(db_url) as raw:
            server_zone = raw.execute("SHOW timezone").fetchone()
        assert server_zone is not None and server_zone[0] != "UTC"  # the server's own zone
        assert zone == "UTC"  # apsup's sessions say UTC at connect
        assert abs(store.now() - datetime.utcnow()) < timedelta(seconds=5)
        assert store.now().tzinfo is None  # naive UTC, as the tables store it
    finally:
        store.dispose()


def test_expiry_is_judged_after_the_lock_wait(db_url: str) -> None:
    """A renewal that waited for the Lease row past the Lease's expiry is refused: the time it
    judges by is read after the lock was granted, not when the statement began."""
    migrate(db_url)
    store = open_backend(db_url, control=True)
    try:
        term = store.claim_term(KEY, "holder-a", 1.0)
        assert term is not None
        blocker = _hold_lease_row(db_url, 2.0, threading.Event())
        assert store.renew_term(term, 30.0) is False  # began before expiry, locked after it
        blocker.join()
        with pytest.raises(StaleTermError), store.fenced(term):
            pass
    finally:
        store.dispose()


def test_a_lock_timeout_is_retried_and_the_call_still_succeeds(db_url: str) -> None:
    """55P03 (lock_timeout, 0.2 s here) is transient: the whole transaction runs again, within
    the host's budget, and takes the Lease once the other session lets go."""
    migrate(db_url)
    seen: list[str | None] = []
    store = open_backend(f"{db_url}?apsup_query_timeout=0.2&apsup_read_timeout=5", control=True)
    try:
        from sqlalchemy import event

        event.listen(
            store.engine, "handle_error", lambda ctx: seen.append(sqlstate(ctx.original_exception))
        )
        first = store.claim_term(KEY, "holder-a", 30.0)
        assert first is not None
        store.release_term(first)
        blocker = _hold_lease_row(db_url, 1.0, threading.Event())
        term = store.claim_term(KEY, "holder-b", 30.0)
        blocker.join()
        assert term is not None and term.generation == first.generation + 1
        assert "55P03" in seen
    finally:
        store.dispose()


def test_a_call_to_a_frozen_server_ends_by_its_bound(db_url: str) -> None:
    """psycopg has no read timeout: the watchdog shuts the socket down, so a call into a black
    hole ends by the read limit, and by the leader's renew deadline when that comes first."""
    migrate(db_url)
    with FaultProxy.for_url(db_url) as proxy:
        url = proxy.url(db_url) + "?apsup_read_timeout=1.5&apsup_query_timeout=1"
        store = open_backend(url, control=True)
        assert isinstance(store, PostgresqlBackend)
        try:
            assert store.claim_term(KEY, "holder-a", 30.0) is not None
            store.now()  # both engines hold a pooled connection now
            proxy.blackhole()
            started = time.monotonic()
            with pytest.raises(DBAPIError):
                store.now()
            assert time.monotonic() - started < 1.5 + 2.0  # ended by the watchdog, not hung
            assert store._watchdog is not None and store._watchdog.fired == 1
            store.call_deadline = time.monotonic() + 0.3
            started = time.monotonic()
            with pytest.raises((DBAPIError, DeadlinePassed)):
                store.now()  # a fresh connection: connect_timeout, then the deadline
            assert time.monotonic() - started < 1.5 + 2.0
            store.call_deadline = time.monotonic() - 1
            with pytest.raises(DeadlinePassed):
                store.now()  # no time left: not even tried
            store.call_deadline = None
            proxy.heal()
            assert abs(store.now() - datetime.utcnow()) < timedelta(seconds=5)  # recovers
        finally:
            store.dispose()


def test_a_fenced_transaction_left_open_is_ended_by_the_server(db_url: str) -> None:
    """A Worker stopped inside ``fenced()`` holds the Lease row lock; the server ends its
    session after the fence bound, nothing of it commits, and the Lease is free to take."""
    migrate(db_url)
    store = open_backend(db_url)
    worker = open_backend(f"{db_url}?apsup_fence_timeout=1")
    try:
        term = store.claim_term(KEY, "holder-a", 2.0)
        assert term is not None
        with pytest.raises(FencedTransactionTimeout), worker.fenced(term) as conn:
            conn.execute(text("CREATE TEMP TABLE scratch (x int)"))
            time.sleep(2.0)  # idle in the transaction, Lease row locked
            conn.execute(text("INSERT INTO scratch VALUES (1)"))
        time.sleep(1.2)  # the Lease ran out meanwhile
        taken = store.claim_term(KEY, "holder-b", 30.0)
        assert taken is not None and taken.generation == term.generation + 1
        with store.read() as conn:
            holder = conn.execute(
                select(leases.c.holder_id).where(leases.c.supervisor_key == KEY)
            ).scalar_one()
        assert holder == "holder-b"
    finally:
        worker.dispose()
        store.dispose()


def test_the_workers_fork_lean_on_postgresql(db_url: str, tmp_path: Path) -> None:
    """The forkserver's warm-up opens a control backend to see whether the database answers;
    its watchdog thread must be gone when that backend is disposed, or the forkserver holds a
    second thread and every Worker forks the slow way (``apsup.workers.fork``)."""
    migrate(db_url)
    before = threading.active_count()  # xdist's own threads, if any
    probe = open_backend(db_url, control=True)
    probe.now()
    assert threading.active_count() == before + 1  # the watchdog ran for that call
    probe.dispose()
    assert threading.active_count() == before
    bundle = build_host(db_url, [live_work], worker_settings={"LIVE_DIR": str(tmp_path)})
    try:
        assert bundle.pool.fork_note is None
    finally:
        bundle.close()


@pytest.mark.parametrize("control", [True, False], ids=["host", "worker"])
def test_a_pooled_connection_the_server_ended_is_replaced_before_use(
    db_url: str, control: bool
) -> None:
    """Pooled connections are pinged only once idle for a while (a ping per checkout is a
    round trip per transaction): one the server ended meanwhile is replaced, not used."""
    migrate(db_url)
    store = open_backend(db_url, control=control)
    try:
        with store.read() as conn:
            pid = conn.execute(text("SELECT pg_backend_pid()")).scalar_one()
        with _raw(db_url) as raw:
            raw.execute("SELECT pg_terminate_backend(%s)", (pid,))
            raw.commit()
        time.sleep(PING_AFTER_IDLE_SECONDS + 0.2)
        with store.read() as conn:  # the dead one failed its ping: a fresh one serves
            assert conn.execute(text("SELECT pg_backend_pid()")).scalar_one() != pid
    finally:
        store.dispose()
