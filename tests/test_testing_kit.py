"""``apsup.testing``: temporary migrated databases and one real invocation of a family in a
child process under a valid term, with its outcome read back from the database (both backends).

Each outcome below is produced by a real child process: success and acknowledgment, a
processor failure, a stale term fenced out, a duplicate delivery skipped, a SIGKILL between the
business commit and the acknowledgment (with an idempotent and a non-idempotent retry), and a
timeout.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path

import pytest
from sqlalchemy import create_engine, inspect, select

from apsup.store import open_backend
from apsup.testing import claim_term, invoke, temporary_database, temporary_mysql_database
from tests.kit_families import kit_broken, kit_ledger, kit_slow, ledger, metadata

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def url(backend_name: str, request: pytest.FixtureRequest) -> Iterator[str]:
    database: AbstractContextManager[str]
    if backend_name == "mysql":
        database = temporary_mysql_database(request.getfixturevalue("mysql_url_admin"))
    else:
        database = temporary_database()
    with database as db:
        engine = create_engine(db)
        metadata.create_all(engine)  # the application's own table
        engine.dispose()
        yield db


def rows(url: str, scope: str) -> list[int]:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return [r.g for r in conn.execute(select(ledger.c.g).where(ledger.c.scope_id == scope))]
    finally:
        engine.dispose()


def request(url: str, scope: str, fam=kit_ledger) -> int:  # type: ignore[no-untyped-def]
    engine = create_engine(url)  # the application's own engine, as in production code
    try:
        with engine.begin() as conn:
            return int(fam.request(conn, scope))
    finally:
        engine.dispose()


def test_one_invocation_succeeds_and_acknowledges(url: str) -> None:
    g = request(url, "s")
    out = invoke(kit_ledger, "s", database_url=url)
    assert (out.exit_cause, out.exit_code, out.generation) == ("SUCCESS", 0, g), out.stderr
    assert out.acknowledged and out.handled_generation == g and not out.timed_out
    assert rows(url, "s") == [g]
    # Nothing pending: the next invoke admits a new generation, as an automatic scan would.
    again = invoke(kit_ledger, "s", database_url=url)
    assert again.acknowledged and again.generation == g + 1
    assert rows(url, "s") == [g, g + 1]


def test_duplicate_delivery_is_skipped(url: str) -> None:
    g = request(url, "s")
    assert invoke(kit_ledger, "s", database_url=url).acknowledged
    dup = invoke(kit_ledger, "s", database_url=url, generation=g)
    assert dup.exit_cause == "SUCCESS" and dup.acknowledged
    assert rows(url, "s") == [g]


def test_processor_failure_is_not_acknowledged(url: str) -> None:
    request(url, "s", kit_broken)
    out = invoke(kit_broken, "s", database_url=url)
    assert out.exit_cause == "PROCESSOR_FAILURE" and not out.acknowledged
    # the type and the (redacted) message: families show why unless they opt out
    assert "RuntimeError: processor bug" in out.stderr


def test_a_stale_term_is_fenced_out(url: str) -> None:
    request(url, "s")
    backend = open_backend(url)
    try:
        old = claim_term(backend)
        claim_term(backend)  # a newer holder took over
    finally:
        backend.dispose()
    out = invoke(kit_ledger, "s", database_url=url, term=old)
    assert out.exit_cause == "STALE_TERM" and not out.acknowledged
    assert rows(url, "s") == []


@pytest.mark.parametrize("idempotent", [True, False])
def test_a_crash_between_commit_and_acknowledgment(url: str, idempotent: bool) -> None:
    g = request(url, "s")
    settings = {} if idempotent else {"KIT_SKIP_CURSOR": "1"}
    crashed = invoke(kit_ledger, "s", database_url=url, settings=settings, crash_after_commits=1)
    assert crashed.exit_cause == "KILLED_SIGKILL" and not crashed.acknowledged
    assert rows(url, "s") == [g]  # the business commit happened
    retry = invoke(kit_ledger, "s", database_url=url, settings=settings)
    assert retry.generation == g and retry.acknowledged
    assert rows(url, "s") == ([g] if idempotent else [g, g])  # the kit shows a duplicate


@pytest.mark.backends("sqlite")
def test_a_timeout_stops_the_child(url: str) -> None:
    request(url, "s", kit_slow)
    out = invoke(kit_slow, "s", database_url=url, timeout=2, grace=5)
    assert out.timed_out and out.exit_cause == "TERMINATED" and not out.acknowledged


@pytest.mark.backends("sqlite")
def test_temporary_database_is_migrated_and_removed(tmp_path: Path) -> None:
    with temporary_database(reference_families=True) as db:
        path = Path(db.removeprefix("sqlite:///"))
        engine = create_engine(db)
        names = set(inspect(engine).get_table_names())
        engine.dispose()
        assert {"pc_artifact_processing_intents", "topic_sources"} <= names
    assert not path.exists() and not path.parent.exists()


@pytest.mark.mysql_only
def test_temporary_mysql_database_is_dropped(backend_name: str, mysql_url_admin: str) -> None:
    with temporary_mysql_database(mysql_url_admin) as db:
        name = db.rsplit("/", 1)[1]
        engine = create_engine(db)
        assert "pc_artifact_processing_intents" in inspect(engine).get_table_names()
        engine.dispose()
    admin = create_engine(mysql_url_admin)
    try:
        with admin.connect() as conn:
            found = conn.exec_driver_sql("SHOW DATABASES").scalars().all()
    finally:
        admin.dispose()
    assert name not in found
