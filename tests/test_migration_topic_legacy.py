"""Acceptance 12: a Topic Memory PR #1490 deployment migrates onto the Supervisor contract.

Each test builds the documented legacy schema (migration 0003's docstring) in a fresh database,
runs ``apsup migrate`` and checks that uncovered Sources, unacknowledged flushes, running waves,
Cursors and ``last_auto_wave_completed_at`` are preserved, as is the Topic API's behaviour.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime
from typing import Any

import pytest
from sqlalchemy import (
    BigInteger,
    Column,
    DateTime,
    MetaData,
    String,
    Table,
    Text,
    create_engine,
    func,
    inspect,
    select,
)
from sqlalchemy.dialects import mysql

from apsup.context import dispose_backends
from apsup.families import topic_memory as tm
from apsup.store import migrate, open_backend, scans
from apsup.testing import claim_term, intent, make_context

FAM = tm.FAMILY
T0 = datetime(2026, 11, 30, 8, 0, 0, 123456)
Ts = DateTime().with_variant(mysql.DATETIME(fsp=6), "mysql")

legacy = MetaData()
pending = Table(
    "pc_artifact_processing_pending",
    legacy,
    Column("binding_name", String(128), primary_key=True),
    Column("scope_id", String(255), primary_key=True),
    Column("source_through", BigInteger, nullable=False),
    Column("flush_requested_generation", BigInteger, nullable=False, server_default="0"),
    Column("flush_handled_generation", BigInteger, nullable=False, server_default="0"),
    Column("updated_at", Ts, nullable=True),
)
states = Table(
    "pc_artifact_processing_binding_states",
    legacy,
    Column("binding_name", String(128), primary_key=True),
    Column("last_auto_wave_completed_at", Ts, nullable=True),
)
waves = Table(
    "pc_artifact_processing_auto_wave_targets",
    legacy,
    Column("binding_name", String(128), primary_key=True),
    Column("wave_id", String(64), primary_key=True),
    Column("scope_id", String(255), primary_key=True),
    Column("status", String(16), nullable=False),
)
sources = Table(
    "topic_sources",
    legacy,
    Column("scope_id", String(255), primary_key=True),
    Column("position", BigInteger, primary_key=True, autoincrement=False),
    Column("body", Text, nullable=False),
)
cursors = Table(
    "topic_cursors",
    legacy,
    Column("scope_id", String(255), primary_key=True),
    Column("source_through", BigInteger, nullable=False),
    Column("head_revision", BigInteger, nullable=False),
)
revisions = Table(
    "topic_revisions",
    legacy,
    Column("scope_id", String(255), primary_key=True),
    Column("revision", BigInteger, primary_key=True, autoincrement=False),
    Column("source_from", BigInteger, nullable=False),
    Column("source_through", BigInteger, nullable=False),
    Column("summary", String(64), nullable=False),
)


@pytest.fixture(autouse=True)
def _dispose() -> Iterator[None]:
    yield
    dispose_backends()


def build_legacy(
    url: str, *, wave_running: bool = True, extra: dict[str, Any] | None = None
) -> None:
    """The PR #1490 shape with one Scope per situation."""
    engine = create_engine(url)
    try:
        legacy.create_all(engine)
        with engine.begin() as conn:

            def journal(scope: str, n: int) -> None:
                for p in range(1, n + 1):
                    conn.execute(sources.insert().values(scope_id=scope, position=p, body=f"b{p}"))

            def cursor(scope: str, through: int, rev: int) -> None:
                conn.execute(
                    cursors.insert().values(
                        scope_id=scope, source_through=through, head_revision=rev
                    )
                )
                for r in range(1, rev + 1):
                    conn.execute(
                        revisions.insert().values(
                            scope_id=scope,
                            revision=r,
                            source_from=r,
                            source_through=through if r == rev else r,
                            summary="0" * 64,
                        )
                    )

            def pend(scope: str, through: int, req: int = 0, handled: int = 0) -> None:
                conn.execute(
                    pending.insert().values(
                        binding_name="topic-memory",
                        scope_id=scope,
                        source_through=through,
                        flush_requested_generation=req,
                        flush_handled_generation=handled,
                    )
                )

            # covered: everything folded, every flush acknowledged -> no scheduling state
            journal("covered", 2)
            cursor("covered", 2, 1)
            pend("covered", 2, 3, 3)
            # uncovered: Sources beyond the Cursor, no flush -> dirty only
            journal("uncovered", 3)
            cursor("uncovered", 1, 1)
            pend("uncovered", 3)
            # flushed: an unacknowledged flush -> accepted request (counters carried over)
            journal("flushed", 2)
            cursor("flushed", 0, 0)
            pend("flushed", 2, 5, 4)
            # nopending: journal beyond the Cursor but no Pending row and no Cursor row
            journal("nopending", 2)
            # waving: a started wave target whose Sources are covered -> recovery request
            journal("waving", 1)
            cursor("waving", 1, 1)
            conn.execute(
                waves.insert().values(
                    binding_name="topic-memory", wave_id="w7", scope_id="covered", status="done"
                )
            )
            conn.execute(
                waves.insert().values(
                    binding_name="topic-memory",
                    wave_id="w7",
                    scope_id="waving",
                    status="started" if wave_running else "done",
                )
            )
            conn.execute(
                states.insert().values(binding_name="topic-memory", last_auto_wave_completed_at=T0)
            )
            for table, rows in (extra or {}).items():
                for row in rows:
                    conn.execute(legacy.tables[table].insert().values(**row))
    finally:
        engine.dispose()


def migrate_legacy(url: str) -> None:
    migrate(url, reference_families=True)


def test_fresh_database_is_a_noop(db_url: str) -> None:
    migrate(db_url, reference_families=True)
    backend = open_backend(db_url)
    try:
        with backend.read() as conn:
            names = set(inspect(conn).get_table_names())
            assert "pc_artifact_processing_pending" not in names
            assert "pc_artifact_processing_auto_wave_targets" not in names
            assert conn.execute(select(func.count()).select_from(tm.topic_cursors)).scalar() == 0
            assert scans.get_state(conn, FAM.binding_name) is None
        migrate(db_url, reference_families=True)  # idempotent at head
    finally:
        backend.dispose()


def test_legacy_state_maps_onto_intents(db_url: str) -> None:
    build_legacy(db_url)
    migrate_legacy(db_url)
    backend = open_backend(db_url)
    try:
        assert intent(backend, FAM, "covered") is None
        up = intent(backend, FAM, "uncovered")
        assert up is not None and up.dirty and up.requested_generation == up.handled_generation
        fl = intent(backend, FAM, "flushed")
        assert fl is not None and fl.dirty
        assert (fl.requested_generation, fl.handled_generation) == (5, 4)
        npd = intent(backend, FAM, "nopending")
        assert npd is not None and npd.dirty and npd.requested_generation == 0
        wv = intent(backend, FAM, "waving")
        assert wv is not None and not wv.dirty
        assert wv.requested_generation > wv.handled_generation  # recovery responsibility
        with backend.read() as conn:
            # Cursors untouched; journal heads backfilled.
            got = {c: tm.read_cursor(conn, c) for c in ("covered", "uncovered", "flushed")}
            assert [(v.source_through, v.head_revision, v.source_head) for v in got.values()] == [
                (2, 1, 2),
                (1, 1, 3),
                (0, 0, 2),
            ]
            created = tm.read_cursor(conn, "nopending")
            assert created is not None and (created.source_through, created.source_head) == (0, 2)
            # A running wave: completion not proven -> no baseline, check immediately.
            state = scans.get_state(conn, FAM.binding_name)
            assert state is not None and state.checkpoint is None
            # Legacy Pending is kept (Topic's own), unchanged.
            rows = conn.execute(select(func.count()).select_from(pending)).scalar_one()
            assert rows == 3
    finally:
        backend.dispose()


def test_completed_waves_preserve_the_remaining_wait(db_url: str) -> None:
    build_legacy(db_url, wave_running=False)
    migrate_legacy(db_url)
    backend = open_backend(db_url)
    try:
        with backend.read() as conn:
            state = scans.get_state(conn, FAM.binding_name)
        assert state is not None and state.checkpoint == T0
        assert not state.scan_in_progress and state.scan_generation == 0
        due = FAM.policy.next_due(state.checkpoint, T0)
        assert due is not None and (due - T0).total_seconds() == 300
        wv = intent(backend, FAM, "waving")
        assert wv is None  # its wave finished and its Sources are covered
    finally:
        backend.dispose()


def test_unmapped_legacy_binding_aborts(db_url: str) -> None:
    build_legacy(
        db_url,
        extra={
            "pc_artifact_processing_pending": [
                {"binding_name": "mystery", "scope_id": "x", "source_through": 1}
            ]
        },
    )
    with pytest.raises(Exception) as err:
        migrate_legacy(db_url)
    assert "mystery" in str(err.value) and "BINDINGS" in str(err.value)


def test_topic_api_and_processing_continue_after_migration(db_url: str) -> None:
    build_legacy(db_url)
    migrate_legacy(db_url)
    backend = open_backend(db_url)
    try:
        with backend.transaction() as conn:
            assert tm.flush(conn, "covered") == "idle"
            assert tm.flush(conn, "uncovered") == "accepted"
        term = claim_term(backend)
        for scope in ("uncovered", "flushed", "nopending", "waving"):
            row = intent(backend, FAM, scope)
            if row is not None and row.requested_generation == row.handled_generation:
                with backend.transaction() as conn:  # an automatic admission
                    FAM.request(conn, scope)
            FAM(scope, make_context(backend, FAM, scope, term))
            row = intent(backend, FAM, scope)
            assert row is not None and not row.dirty
            assert row.handled_generation == row.requested_generation
        with backend.read() as conn:
            revs = tm.list_revisions(conn, "uncovered")
            # Revision numbering and the window continue from the legacy Cursor.
            assert [(r["revision"], r["source_from"], r["source_through"]) for r in revs] == [
                (1, 1, 1),
                (2, 2, 3),
            ]
            assert revs[0]["supervisor_generation"] == 0  # written before the Supervisor
            assert revs[1]["supervisor_generation"] == term.generation
            assert tm.list_revisions(conn, "waving")[-1]["revision"] == 1  # nothing new to fold
        with backend.transaction() as conn:
            assert tm.append_source(conn, "covered", "more") == 3  # journal continues
    finally:
        backend.dispose()
