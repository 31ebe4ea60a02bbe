"""The MySQL-compatible test server behaves as the store assumes (DESIGN.md §6-7).

Real connections (SQLAlchemy over PyMySQL) against the server `./run test` / `.ci/run` start:
READ COMMITTED, UTC database time, FOR UPDATE blocking between connections, NOWAIT and
SKIP LOCKED. If one of these fails, the fencing built on top of them cannot be trusted.
Ordering is proven from the server's own process list, not from sleeps.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import OperationalError

pytestmark = [pytest.mark.mysql_only, pytest.mark.timeout(60)]

LOCK_WAIT_TIMEOUT_ERRNO = 1205  # seekdb reports a NOWAIT conflict with this code too
NOWAIT_ERRNOS = {LOCK_WAIT_TIMEOUT_ERRNO, 3572}  # 3572: ER_LOCK_NOWAIT on MySQL 8


@pytest.fixture
def engine(db_url: str) -> Iterator[Engine]:
    eng = create_engine(db_url, pool_size=4, max_overflow=0)
    with eng.begin() as conn:
        conn.execute(text("CREATE TABLE sem_rows (id INT PRIMARY KEY, v INT NOT NULL)"))
        conn.execute(text("INSERT INTO sem_rows (id, v) VALUES (1, 1), (2, 2)"))
    try:
        yield eng
    finally:
        eng.dispose()


def _value(conn: Connection, row_id: int = 1, suffix: str = "") -> int:
    return int(
        conn.execute(
            text(f"SELECT v FROM sem_rows WHERE id = :id {suffix}"), {"id": row_id}
        ).scalar_one()
    )


def _connection_id(conn: Connection) -> int:
    return int(conn.execute(text("SELECT CONNECTION_ID()")).scalar_one())


def _wait_until_statement_running(eng: Engine, conn_id: int, fragment: str) -> None:
    """Poll the server's process list until connection ``conn_id`` is executing ``fragment``."""
    deadline = time.monotonic() + 8.0  # below the server's 10 s lock wait timeout
    with eng.connect() as observer:
        while time.monotonic() < deadline:
            info = observer.execute(
                text("SELECT info FROM information_schema.processlist WHERE id = :id"),
                {"id": conn_id},
            ).scalar()
            observer.rollback()
            if info is not None and fragment.lower() in str(info).lower():
                return
            time.sleep(0.02)
    pytest.fail(f"connection {conn_id} never showed {fragment!r} in the process list")


def test_database_starts_empty(engine: Engine, db_url: str) -> None:
    with engine.connect() as conn:
        tables = {str(r[0]).lower() for r in conn.execute(text("SHOW TABLES"))}
    assert tables == {"sem_rows"}, f"{db_url} was not a fresh database: {tables}"


def test_isolation_is_read_committed(engine: Engine) -> None:
    with engine.connect() as reader, engine.connect() as writer:
        assert reader.get_isolation_level() == "READ COMMITTED"
        assert _value(reader) == 1  # the reader's transaction is now open with a first read
        writer.execute(text("UPDATE sem_rows SET v = 5 WHERE id = 1"))
        writer.commit()
        # Same reader transaction: READ COMMITTED sees the new commit (REPEATABLE READ would not).
        assert _value(reader) == 5
        reader.rollback()


def test_utc_timestamp_is_utc_and_now6_follows_the_session_zone(engine: Engine) -> None:
    """apsup reads ``UTC_TIMESTAMP(6)`` and sets each session to +00:00: the server's own zone
    (seekdb defaults to +08:00; the test server is left there) must not matter."""
    with engine.connect() as conn:
        utc6 = conn.execute(text("SELECT UTC_TIMESTAMP(6)")).scalar_one()
        conn.exec_driver_sql("SET time_zone = '+00:00'")
        now6, sysdate6, tz = conn.execute(
            text("SELECT NOW(6), SYSDATE(6), @@session.time_zone")
        ).one()
    host_utc = datetime.now(UTC).replace(tzinfo=None)
    assert tz == "+00:00"
    assert isinstance(now6, datetime) and now6.microsecond is not None
    assert abs((utc6 - host_utc).total_seconds()) < 5.0, (utc6, host_utc)
    assert abs((sysdate6 - host_utc).total_seconds()) < 5.0, (sysdate6, host_utc)
    assert abs((now6 - host_utc).total_seconds()) < 5.0, (now6, host_utc)


def test_for_update_blocks_second_connection_until_commit(engine: Engine) -> None:
    events: list[str] = []
    seen: dict[str, object] = {}
    with engine.connect() as holder, engine.connect() as waiter:
        waiter_id = _connection_id(waiter)
        waiter.rollback()
        assert _value(holder, suffix="FOR UPDATE") == 1  # holder owns the row lock

        def contend() -> None:
            try:
                seen["value"] = _value(waiter, suffix="FOR UPDATE")
                events.append("waiter acquired")
                waiter.commit()
            except Exception as exc:  # surfaced by the main thread
                seen["error"] = exc

        thread = threading.Thread(target=contend, daemon=True)
        thread.start()
        _wait_until_statement_running(engine, waiter_id, "for update")
        # The waiter is inside its FOR UPDATE on the server and has not returned.
        assert events == []
        holder.execute(text("UPDATE sem_rows SET v = 7 WHERE id = 1"))
        events.append("holder committing")
        holder.commit()
        thread.join(timeout=9.0)
        assert not thread.is_alive(), "waiter still blocked after the holder committed"
    assert "error" not in seen, seen.get("error")
    assert events == ["holder committing", "waiter acquired"]
    assert seen["value"] == 7  # a locking read returns the value committed by the holder


def test_for_update_nowait_fails_fast_while_locked(engine: Engine) -> None:
    with engine.connect() as holder, engine.connect() as other:
        assert _value(holder, suffix="FOR UPDATE") == 1
        started = time.monotonic()
        with pytest.raises(OperationalError) as info:
            _value(other, suffix="FOR UPDATE NOWAIT")
        elapsed = time.monotonic() - started
        other.rollback()
        # Generous bound: far below the server's 10 s lock wait timeout, i.e. it did not wait.
        assert elapsed < 5.0, f"NOWAIT took {elapsed:.1f} s"
        assert info.value.orig.args[0] in NOWAIT_ERRNOS, info.value.orig
        holder.rollback()
        # Once released, NOWAIT succeeds.
        assert _value(other, suffix="FOR UPDATE NOWAIT") == 1
        other.rollback()


def test_skip_locked_passes_over_locked_rows(engine: Engine) -> None:
    with engine.connect() as holder, engine.connect() as other:
        assert _value(holder, suffix="FOR UPDATE") == 1
        ids = [
            int(r[0])
            for r in other.execute(
                text("SELECT id FROM sem_rows ORDER BY id FOR UPDATE SKIP LOCKED")
            )
        ]
        assert ids == [2]
        other.rollback()
        holder.rollback()
