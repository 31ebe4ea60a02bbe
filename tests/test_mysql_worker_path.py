"""The Worker wrapper's duplicate check and acknowledgment on MySQL/OceanBase run on the pooled
PyMySQL connection (no SQLAlchemy Core), with every guarantee of the fenced Core path:

- the path is really taken (no SQLAlchemy statement) and costs few round trips: the duplicate
  check one command on OceanBase (a SELECT: no transaction to end), the acknowledgment three
  (Lease row lock, UPDATE, COMMIT), a new session one setup command;
- the Lease row is locked FOR UPDATE through COMMIT, in real concurrent transactions: an
  acknowledgment that waits for a takeover in progress commits nothing once the term is
  replaced, and a takeover waits for an acknowledgment that holds the row;
- expiry is judged on database time after the lock is held, also when the lease expires while
  the acknowledgment waits for the lock;
- the duplicate check leaves no transaction open while the processor runs, and sees every
  commit made since;
- the host's point read (autocommit read engine) returns what the Core read does, and driver
  errors surface as SQLAlchemy's.
Session setup (one statement at connect) leaves each session as the Core path expects it.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ProgrammingError

from apsup.context import ExecutionContext, dispose_backends
from apsup.errors import StaleTermError
from apsup.store import intents, migrate, open_backend
from apsup.store.base import SqlBackend
from apsup.store.leases import Term
from apsup.workers.warm import warm

pytestmark = [pytest.mark.mysql_only, pytest.mark.timeout(120)]

FAMILY = "wrapper-family"
SCOPE = "scope-1"
KEY = "artifact:wrapper"
LEASES = "pc_artifact_processing_leases"
INTENTS = "pc_artifact_processing_intents"


@pytest.fixture
def raw(db_url: str) -> Iterator[Engine]:
    """A plain engine for the other side of each race (another replica's session)."""
    engine = create_engine(db_url, isolation_level="READ COMMITTED")
    try:
        yield engine
    finally:
        engine.dispose()


@pytest.fixture(autouse=True)
def _fresh_worker_backends() -> Iterator[None]:
    dispose_backends()  # each test's contexts open their own backend, as a Worker does
    yield
    dispose_backends()


def _job(backend: SqlBackend, db_url: str, lease_seconds: float = 600) -> ExecutionContext:
    term = backend.claim_term(KEY, uuid.uuid4().hex, lease_seconds)
    assert term is not None
    with backend.transaction() as conn:
        generation = intents.request(conn, FAMILY, SCOPE)
        row = intents.get(conn, FAMILY, SCOPE)
    assert row is not None
    return ExecutionContext(
        binding_name=FAMILY,
        artifact_family=FAMILY,
        scope_id=SCOPE,
        claimed_request_generation=generation,
        supervisor_key=term.supervisor_key,
        holder_id=term.holder_id,
        supervisor_generation=term.generation,
        worker_id="worker-1",
        pending_sequence=row.pending_sequence,
        entry_point="tests._contract_ctx_child:main",
        database_url=db_url,
    )


def _handled(backend: SqlBackend) -> int:
    with backend.read() as conn:
        row = intents.get(conn, FAMILY, SCOPE)
    return 0 if row is None else row.handled_generation


def _in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def _lock_row(conn: Any, table: str, where: str, params: dict[str, Any]) -> None:
    conn.execute(text(f"SELECT 1 FROM {table} WHERE {where} FOR UPDATE"), params)


def _wait_db_time_past(backend: SqlBackend, moment: datetime, limit: float = 15.0) -> None:
    deadline = time.monotonic() + limit
    while backend.now() <= moment:
        assert time.monotonic() < deadline, "database time did not pass the moment"
        time.sleep(0.1)


class _Commands:
    """SQL commands PyMySQL sends (COM_QUERY) and statements SQLAlchemy executes, counted."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, engine: Engine) -> None:
        from pymysql.connections import Connection

        self.sent: list[str] = []
        self.core = 0
        original = Connection._execute_command

        def counted(conn: Any, command: int, sql: Any) -> Any:
            if command == 3:  # COM_QUERY
                self.sent.append(sql if isinstance(sql, str) else sql.decode(errors="replace"))
            return original(conn, command, sql)

        monkeypatch.setattr(Connection, "_execute_command", counted)

        def on_execute(*args: Any) -> None:
            self.core += 1

        event.listen(engine, "before_cursor_execute", on_execute)

    def take(self) -> list[str]:
        sent, self.sent, self.core = self.sent, [], 0
        return sent


def test_the_wrapper_path_runs_on_the_driver_in_few_round_trips(
    backend: SqlBackend, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    warm(db_url)  # as the forkserver does: Workers know the server before they connect
    job = _job(backend, db_url)
    worker = job.backend
    counter = _Commands(monkeypatch, worker.engine)
    assert not job.already_handled()
    first = counter.take()
    # A new session: one SET (PyMySQL's SET NAMES carrying the whole session setup;
    # SQLAlchemy's own SET NAMES, which would repeat it, is skipped); then the check.
    setup = [s for s in first if s.upper().startswith("SET")]
    assert len(setup) == 1 and setup[0].startswith("SET NAMES utf8mb4, time_zone"), first
    assert len(first) == len(setup) + 1 and first[-1].startswith("SELECT"), first
    assert job.already_handled() is False
    assert len(counter.take()) == 1  # the session is reused: one SELECT (no COMMIT: see below)
    assert job.acknowledge_fenced() is True
    ack = counter.take()
    assert counter.core == 0
    assert len(ack) == 3 and ack[0].endswith("FOR UPDATE") and ack[-1] == "COMMIT", ack
    assert ack[1].startswith("UPDATE") and "UTC_TIMESTAMP(6)" in ack[1], ack
    assert job.already_handled() is True
    assert job.acknowledge_fenced() is False  # already handled: nothing moves
    assert counter.core == 0  # not one statement went through SQLAlchemy Core
    assert _handled(backend) == 1


def test_an_ack_waiting_for_a_takeover_commits_nothing_after_it(
    backend: SqlBackend, db_url: str, raw: Engine
) -> None:
    """The acknowledgment waits on the Lease row lock held by a takeover in progress, then
    reads the new term and refuses: a read without the lock would have seen the old row (READ
    COMMITTED) and committed under a replaced term."""
    job = _job(backend, db_url)
    assert not job.already_handled()  # the Worker's session exists before the race
    with raw.connect() as taker:
        taker.begin()
        _lock_row(taker, LEASES, "supervisor_key = :k", {"k": KEY.encode()})
        taker.execute(
            text(
                f"UPDATE {LEASES} SET holder_id = 'new-holder', "
                "supervisor_generation = supervisor_generation + 1 WHERE supervisor_key = :k"
            ),
            {"k": KEY.encode()},
        )
        worker, out = _in_thread(job.acknowledge_fenced)
        time.sleep(1.5)
        assert worker.is_alive(), f"the acknowledgment did not wait for the Lease row: {out}"
        taker.commit()
    worker.join(15)
    assert not worker.is_alive()
    assert isinstance(out.get("error"), StaleTermError), out
    assert "superseded" in str(out["error"])
    assert _handled(backend) == 0 and not job.acknowledged


def test_a_takeover_waits_for_an_ack_holding_the_lease_row(
    backend: SqlBackend, db_url: str, raw: Engine
) -> None:
    """While the acknowledgment's UPDATE waits (here on the intent row, held by another
    session), the Lease row stays locked: the takeover waits, and the acknowledgment, which
    was valid when it took the lock, commits first."""
    job = _job(backend, db_url)
    order: list[str] = []
    with raw.connect() as holder:
        holder.begin()
        _lock_row(
            holder,
            INTENTS,
            "binding_name = :b AND scope_id = :s",
            {"b": FAMILY.encode(), "s": SCOPE.encode()},
        )
        worker, worker_out = _in_thread(lambda: (job.acknowledge_fenced(), order.append("ack")))
        time.sleep(1.0)
        assert worker.is_alive(), worker_out

        def takeover() -> Term:
            backend.invalidate_terms([KEY])
            order.append("takeover")
            term = backend.claim_term(KEY, uuid.uuid4().hex, 600)
            assert term is not None
            return term

        taker, taker_out = _in_thread(takeover)
        time.sleep(1.5)
        assert taker.is_alive() and order == [], "the takeover did not wait for the ack's lock"
        holder.commit()
    worker.join(15)
    taker.join(15)
    assert not worker.is_alive() and not taker.is_alive()
    assert "error" not in worker_out and "error" not in taker_out, (worker_out, taker_out)
    assert worker_out["value"][0] is True
    assert order == ["ack", "takeover"]
    assert _handled(backend) == 1


def test_an_ack_on_an_expired_lease_commits_nothing(backend: SqlBackend, db_url: str) -> None:
    job = _job(backend, db_url, lease_seconds=1)
    assert not job.already_handled()
    expires = backend.lease_rows()[0].expires_at
    assert expires is not None
    _wait_db_time_past(backend, expires)
    with pytest.raises(StaleTermError, match="expired"):
        job.acknowledge_fenced()
    assert _handled(backend) == 0 and not job.acknowledged


def test_expiry_is_judged_after_the_acks_lock_wait(
    backend: SqlBackend, db_url: str, raw: Engine
) -> None:
    """The lease is valid when the acknowledgment starts waiting for the Lease row and expires
    during the wait: judged on database time after the lock is held, it is refused."""
    job = _job(backend, db_url, lease_seconds=4)
    assert not job.already_handled()
    expires = backend.lease_rows()[0].expires_at
    assert expires is not None
    with raw.connect() as locker:
        locker.begin()
        _lock_row(locker, LEASES, "supervisor_key = :k", {"k": KEY.encode()})
        assert backend.now() < expires - timedelta(seconds=1), "too slow to start before expiry"
        worker, out = _in_thread(job.acknowledge_fenced)
        time.sleep(0.5)
        assert worker.is_alive(), out
        _wait_db_time_past(backend, expires)
        locker.commit()
    worker.join(15)
    assert not worker.is_alive()
    assert isinstance(out.get("error"), StaleTermError), out
    assert "expired" in str(out["error"])
    assert _handled(backend) == 0


def test_the_duplicate_check_leaves_no_transaction_open(backend: SqlBackend, db_url: str) -> None:
    """The processor runs after the duplicate check: no transaction of the check may stay open
    on the Worker's session meanwhile (on OceanBase it would count against the fence timeout
    of the acknowledgment that continues it). OceanBase opens none for a plain read under READ
    COMMITTED, which is why the check sends no COMMIT there: the server's process list shows
    the session without a transaction after the check, and with one inside a fenced write."""
    job = _job(backend, db_url)
    assert not job.already_handled()
    fairy = job.backend.engine.raw_connection()
    try:
        session = fairy.driver_connection.thread_id()  # type: ignore[union-attr]
    finally:
        fairy.close()

    def transaction_of_worker() -> int:
        with backend.read() as conn:
            row = conn.exec_driver_sql(
                "SELECT TRANS_ID FROM oceanbase.V$OB_PROCESSLIST WHERE ID = %s", (session,)
            ).one()
        return int(row[0])

    assert transaction_of_worker() == 0
    with job.fenced() as conn:  # the same pooled session, now inside a fenced write
        assert conn.connection.driver_connection.thread_id() == session  # type: ignore[union-attr]
        assert transaction_of_worker() != 0  # the probe can see an open transaction
    assert transaction_of_worker() == 0
    assert job.acknowledge_fenced() is True


def test_the_duplicate_check_sees_each_commit(backend: SqlBackend, db_url: str) -> None:
    job = _job(backend, db_url)
    assert not job.already_handled()
    with backend.transaction() as conn:  # another process acknowledges G meanwhile
        assert intents.acknowledge(conn, FAMILY, SCOPE, 1, job.pending_sequence)
    assert job.already_handled()
    with backend.transaction() as conn:
        intents.request(conn, FAMILY, SCOPE)  # G + 1 for a later invocation
    later = ExecutionContext.from_bytes(job.to_bytes())
    later.claimed_request_generation = 2
    assert not later.already_handled()


def test_the_hosts_point_read_matches_the_core_read(backend: SqlBackend, db_url: str) -> None:
    _job(backend, db_url)
    host = open_backend(db_url, control=True)
    try:
        with backend.read() as conn:
            expected = intents.get(conn, FAMILY, SCOPE)
        assert expected is not None
        assert host.read_intent(FAMILY, SCOPE) == expected
        assert host.read_intent(FAMILY, "no-such-scope") is None
        assert host.read_intent(FAMILY, "Scope-1") is None  # byte-exact identifiers
    finally:
        host.dispose()


def test_driver_errors_surface_as_sqlalchemy_errors(db_url: str) -> None:
    """On a database without apsup's tables: SQLAlchemy's ProgrammingError, as from the Core
    path; no connection stays checked out, and the same backend works once migrated."""
    host = open_backend(db_url, control=True)
    worker = open_backend(db_url)
    term = Term(KEY, "holder", 1)
    try:
        with pytest.raises(ProgrammingError):
            host.read_intent(FAMILY, SCOPE)
        with pytest.raises(ProgrammingError):
            worker.handled_generation(FAMILY, SCOPE)
        with pytest.raises(ProgrammingError):
            worker.acknowledge_fenced(term, FAMILY, SCOPE, 1, 1)
        assert host.read_engine.pool.checkedout() == 0  # type: ignore[attr-defined]
        assert worker.engine.pool.checkedout() == 0  # type: ignore[attr-defined]
        migrate(db_url)
        assert host.read_intent(FAMILY, SCOPE) is None
        assert worker.handled_generation(FAMILY, SCOPE) == 0
        with pytest.raises(StaleTermError):
            worker.acknowledge_fenced(term, FAMILY, SCOPE, 1, 1)
    finally:
        host.dispose()
        worker.dispose()


def test_sessions_are_set_up_as_the_core_path_expects(backend: SqlBackend, db_url: str) -> None:
    job = _job(backend, db_url)
    assert not job.already_handled()  # a Worker's session: bounded at connect
    host = open_backend(db_url, control=True)
    try:
        sessions = {
            "worker": job.backend.engine,
            "cli": backend.engine,
            "host": host.engine,
            "host reads": host.read_engine,
        }
        seen = {}
        for name, engine in sessions.items():
            with engine.connect() as conn:
                seen[name] = conn.exec_driver_sql(
                    "SELECT @@time_zone, @@transaction_isolation, @@autocommit, "
                    "@@ob_trx_timeout, @@ob_query_timeout, @@character_set_client, "
                    "@@character_set_connection, @@character_set_results"
                ).one()
                assert engine.dialect.default_isolation_level == "READ COMMITTED", name
            if name != "host reads":
                conn.rollback()
        for name, row in seen.items():
            assert row[0] == "+00:00", (name, row)
            assert row[1] == "READ-COMMITTED" or name == "host reads", (name, row)
            assert row[5:] == ("utf8mb4", "utf8mb4", "utf8mb4"), (name, row)
        assert [seen[n][2] for n in ("worker", "cli", "host", "host reads")] == [0, 0, 0, 1]
        assert seen["worker"][3] == 30_000_000  # bounded before its first fenced transaction
        assert seen["host"][4] == seen["host reads"][4] < 10_000_000  # the host's limits
    finally:
        host.dispose()


def test_dispose_closes_the_sessions_of_both_engines(backend: SqlBackend, db_url: str) -> None:
    """``dispose()`` closes the host's read sessions too (each with a goodbye), and the backend
    stays usable afterwards."""
    host = open_backend(db_url, control=True)
    try:
        sessions = set()
        for engine in (host.engine, host.read_engine):
            fairy = engine.raw_connection()
            sessions.add(fairy.driver_connection.thread_id())  # type: ignore[union-attr]
            fairy.close()
        assert len(sessions) == 2

        def open_sessions() -> set[int]:
            with backend.read() as conn:
                ids = conn.exec_driver_sql("SELECT ID FROM information_schema.PROCESSLIST").all()
            return {int(r[0]) for r in ids} & sessions

        assert open_sessions() == sessions
        host.dispose()
        deadline = time.monotonic() + 10
        while open_sessions() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert open_sessions() == set()
        assert host.read_intent(FAMILY, SCOPE) is None  # usable again: new sessions
        assert host.now() is not None
    finally:
        host.dispose()


def test_a_worker_says_goodbye_to_the_sessions_it_opened(backend: SqlBackend, db_url: str) -> None:
    """Before its exit a Worker closes its sessions (the server sees a goodbye, not an aborted
    client); its backend had none before its first statement, and has none after."""
    from apsup.context import backend_for, release_before_exit

    worker = backend_for(db_url)
    try:
        assert not worker.connected()
        assert worker.handled_generation(FAMILY, SCOPE) == 0  # the Worker's duplicate check
        assert worker.connected()
        fairy = worker.engine.raw_connection()
        session = fairy.driver_connection.thread_id()  # type: ignore[union-attr]
        fairy.close()

        def still_open() -> bool:
            with backend.read() as conn:
                ids = conn.exec_driver_sql("SELECT ID FROM information_schema.PROCESSLIST").all()
            return session in {int(r[0]) for r in ids}

        assert still_open()
        release_before_exit()
        assert not worker.connected()
        deadline = time.monotonic() + 10
        while still_open() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not still_open()
    finally:
        dispose_backends()


def test_sessions_are_set_up_with_a_plain_pymysql_connection_too(
    backend: SqlBackend, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without apsup's PyMySQL subclass (another PyMySQL release), the session setup that could
    not travel with SET NAMES is sent on its own: the session ends up the same."""
    from pymysql.connections import Connection

    import apsup.store.mysql as mysql_store

    monkeypatch.setattr(mysql_store, "_connection_class", lambda: Connection)
    job = _job(backend, db_url)
    worker = open_backend(db_url)
    try:
        assert worker.handled_generation(FAMILY, SCOPE) == 0  # first session: server learnt
        worker.dispose()
        assert worker.handled_generation(FAMILY, SCOPE) == 0  # a session of a known server
        with worker.engine.connect() as conn:
            assert type(conn.connection.driver_connection) is Connection
            row = conn.exec_driver_sql(
                "SELECT @@time_zone, @@transaction_isolation, @@autocommit, @@ob_trx_timeout"
            ).one()
        assert tuple(row) == ("+00:00", "READ-COMMITTED", 0, 30_000_000)
        term = Term(job.supervisor_key, job.holder_id, job.supervisor_generation)
        assert worker.acknowledge_fenced(term, FAMILY, SCOPE, 1, job.pending_sequence) is True
    finally:
        worker.dispose()


def test_a_lock_wait_timeout_retries_the_whole_acknowledgment(
    backend: SqlBackend, db_url: str, raw: Engine
) -> None:
    """A lock wait ended by the server (1205: only the statement is rolled back) is not
    continued: the session is discarded and the whole transaction retried on a new one, Lease
    lock first. Here the server ends each wait after 1 s while another session holds the Lease
    row for about 2.5 s: a later attempt acknowledges."""
    job = _job(backend, db_url)
    url = make_url(db_url).update_query_dict(
        {"apsup_query_timeout": "1", "apsup_read_timeout": "20"}
    )
    store = open_backend(url.render_as_string(hide_password=False), control=True)
    term = Term(job.supervisor_key, job.holder_id, job.supervisor_generation)
    errors: list[int] = []

    @event.listens_for(store.engine.pool, "invalidate")
    def _on_invalidate(dbapi_conn: Any, rec: Any, exc: BaseException | None) -> None:
        orig = getattr(exc, "orig", exc)
        errors.append(int(orig.args[0]) if orig is not None and orig.args else 0)

    try:
        with raw.connect() as locker:
            locker.begin()
            _lock_row(locker, LEASES, "supervisor_key = :k", {"k": KEY.encode()})
            worker, out = _in_thread(
                lambda: store.acknowledge_fenced(term, FAMILY, SCOPE, 1, job.pending_sequence)
            )
            time.sleep(2.5)
            assert worker.is_alive(), out
            locker.commit()
        worker.join(20)
        assert not worker.is_alive()
        assert out.get("value") is True, out
        assert errors and set(errors) <= {1205, 4012}, errors  # waits the server ended
        assert _handled(backend) == 1
    finally:
        store.dispose()
