"""Database time is UTC on MySQL/OceanBase whatever the server's time zone.

seekdb's zone defaults to +08:00 (the test server is left there on purpose): ``NOW(6)`` read as
naive UTC put every Lease expiry and schedule checkpoint eight hours in the future, so a
Profile cron of ``0 2 * * *`` Asia/Shanghai would have fired at 18:00 Shanghai.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime

import pytest
from sqlalchemy import Engine, create_engine, text

from apsup.store import scans
from apsup.store.base import SqlBackend

pytestmark = pytest.mark.mysql_only
SLACK_S = 10.0  # generous: a loaded 2-core machine


@pytest.fixture
def plain(db_url: str) -> Iterator[Engine]:
    engine = create_engine(db_url, pool_size=1, max_overflow=0)
    yield engine
    engine.dispose()


def _host_utc() -> datetime:
    return datetime.now(UTC).replace(tzinfo=None)


def test_the_test_server_is_not_utc(plain: Engine) -> None:
    """The premise of this module: the suite's server runs off UTC (seekdb's +08:00)."""
    with plain.connect() as conn:
        now, utc = conn.execute(text("SELECT NOW(6), UTC_TIMESTAMP(6)")).one()
    assert abs((now - utc).total_seconds()) > 3600, (
        "the test server runs at UTC: start it without `--variable time_zone=+00:00`"
    )


def test_backend_now_is_utc(backend: SqlBackend) -> None:
    assert abs((backend.now() - _host_utc()).total_seconds()) < SLACK_S
    with backend.engine.connect() as conn:
        zone, now, utc = conn.execute(
            text("SELECT @@session.time_zone, NOW(6), UTC_TIMESTAMP(6)")
        ).one()
    assert zone == "+00:00"
    assert abs((now - utc).total_seconds()) < 1.0


def test_lease_expiry_is_written_in_utc(backend: SqlBackend) -> None:
    term = backend.claim_term("global", "holder-a", 30.0)
    assert term is not None
    (row,) = backend.lease_rows()
    assert row.expires_at is not None
    ahead = (row.expires_at - _host_utc()).total_seconds()
    assert 30.0 - SLACK_S < ahead < 30.0 + SLACK_S, f"expires_at is {ahead:.0f} s ahead"
    assert backend.renew_term(term, 30.0)
    backend.release_term(term)
    # Released means expired now: a standby takes over at once, not eight hours later.
    assert backend.claim_term("global", "holder-b", 30.0) is not None


def test_schedule_checkpoint_is_database_utc(backend: SqlBackend) -> None:
    term = backend.claim_term("global", "holder-a", 30.0)
    assert term is not None
    checkpoint = backend.now()
    state = backend.run_fenced(term, lambda conn: scans.start_scan(conn, "b", checkpoint))
    assert state.checkpoint is not None
    assert abs((state.checkpoint - _host_utc()).total_seconds()) < SLACK_S
