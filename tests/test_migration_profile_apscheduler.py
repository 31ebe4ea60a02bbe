"""Acceptance 13: Profile moves from its APScheduler cron sidecar to the Supervisor.

The latest fire, Policy, Cursor and pending Candidate decide whether work exists; migrating
neither generates twice for one cron fire nor loses a Source, and the cron, timezone, immediate
catch-up, pending Review state and background Principal are preserved.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import (
    Column,
    Float,
    LargeBinary,
    MetaData,
    String,
    Table,
    create_engine,
    func,
    select,
)

from apsup.context import dispose_backends
from apsup.families import profile as pf
from apsup.policy import Cron
from apsup.store import migrate, open_backend, scans
from apsup.testing import claim_term, intent, make_context

FAM = pf.FAMILY
FIRE1 = datetime(2026, 12, 1, 18, 0)  # 02:00 Asia/Shanghai, Dec 2
FIRE2 = FIRE1 + timedelta(days=1)

aps = MetaData()
jobs = Table(
    "apscheduler_jobs",
    aps,
    Column("id", String(191), primary_key=True),
    Column("next_run_time", Float(25), index=True),
    Column("job_state", LargeBinary, nullable=False),
)


@pytest.fixture(autouse=True)
def _dispose() -> Iterator[None]:
    yield
    dispose_backends()


def build_legacy(url: str) -> None:
    """The sidecar ran FIRE1 (next run FIRE2) and stopped; one Scope per situation."""
    engine = create_engine(url)
    try:
        aps.create_all(engine)
        pf.metadata.create_all(engine)
        with engine.begin() as conn:
            next_run = FIRE2.replace(tzinfo=UTC).timestamp()
            conn.execute(
                jobs.insert().values(id="profile-cron", next_run_time=next_run, job_state=b"x")
            )
            conn.execute(
                jobs.insert().values(id="other-job", next_run_time=next_run, job_state=b"y")
            )

            def scope(name: str, sources: int, through: int, last_fire: datetime | None) -> None:
                for p in range(1, sources + 1):
                    conn.execute(
                        pf.profile_sources.insert().values(scope_id=name, position=p, body="b")
                    )
                conn.execute(
                    pf.profile_cursors.insert().values(
                        scope_id=name,
                        source_head=sources,
                        source_through=through,
                        last_fire=last_fire,
                    )
                )

            def candidate(name: str, fire: datetime, status: str, frm: int, thr: int) -> None:
                conn.execute(
                    pf.profile_candidates.insert().values(
                        candidate_id=pf.candidate_id_for(name, fire),
                        scope_id=name,
                        cron_fire=fire,
                        status=status,
                        source_from=frm,
                        source_through=thr,
                        content="c" * 64,
                        supervisor_generation=0,
                        created_at=fire,
                    )
                )

            scope("done", 2, 2, FIRE1)  # FIRE1 consumed everything
            candidate("done", FIRE1, pf.APPROVED, 1, 2)
            scope("newer", 3, 2, FIRE1)  # FIRE1 done; Source 3 arrived afterwards
            candidate("newer", FIRE1, pf.APPROVED, 1, 2)
            scope("missed", 2, 0, None)  # the sidecar stopped before reaching this Scope
            scope("review", 2, 1, FIRE1)  # a Candidate awaits Review; Source 2 came later
            candidate("review", FIRE1, pf.PENDING, 1, 1)
            scope("torn", 1, 0, None)  # old code wrote the Candidate but not the Cursor
            candidate("torn", FIRE1, pf.APPROVED, 1, 1)
            scope("off", 2, 0, None)  # Policy disabled
            conn.execute(pf.profile_policies.insert().values(scope_id="off", enabled=False))
    finally:
        engine.dispose()


def test_fresh_database_is_a_noop(db_url: str) -> None:
    migrate(db_url, reference_families=True)
    backend = open_backend(db_url)
    try:
        with backend.read() as conn:
            assert conn.execute(select(func.count()).select_from(pf.profile_cursors)).scalar() == 0
            assert scans.get_state(conn, FAM.binding_name) is None
    finally:
        backend.dispose()


def test_fire_before_next_run() -> None:
    import importlib.util

    from apsup.store.revision import migrations_dir

    spec = importlib.util.spec_from_file_location(
        "m0004", migrations_dir() / "families" / "0004_profile_from_apscheduler.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.fire_before(FIRE2, "0 2 * * *", "Asia/Shanghai") == FIRE1
    assert module.fire_before(FIRE2 + timedelta(hours=3), "0 2 * * *", "Asia/Shanghai") == FIRE2


def test_latest_fire_policy_cursor_and_candidate_decide_work(db_url: str) -> None:
    build_legacy(db_url)
    migrate(db_url, reference_families=True)
    backend = open_backend(db_url)
    try:
        assert intent(backend, FAM, "done") is None
        newer = intent(backend, FAM, "newer")
        assert newer is not None and newer.dirty and not newer.pending_request  # waits for a fire
        missed = intent(backend, FAM, "missed")
        assert missed is not None and missed.dirty and missed.pending_request  # recovery
        assert intent(backend, FAM, "review") is None  # pending Review state kept as is
        torn = intent(backend, FAM, "torn")
        assert torn is not None and torn.dirty and not torn.pending_request
        assert intent(backend, FAM, "off") is None
        with backend.read() as conn:
            ids = [r[0] for r in conn.execute(select(jobs.c.id).order_by(jobs.c.id))]
            assert ids == ["other-job"]  # the old entry point can no longer fire
            assert scans.get_state(conn, FAM.binding_name) is None  # immediate catch-up
    finally:
        backend.dispose()


def test_catch_up_after_migration_neither_duplicates_nor_loses(db_url: str) -> None:
    build_legacy(db_url)
    migrate(db_url, reference_families=True)
    backend = open_backend(db_url)
    try:
        term = claim_term(backend)
        policy = FAM.policy
        assert isinstance(policy, Cron) and policy.timezone == "Asia/Shanghai"
        # The immediate catch-up admits every dirty Scope for the latest fire (FIRE1 here).
        with backend.transaction() as conn:
            scans.set_checkpoint(conn, FAM.binding_name, FIRE1)
        for name in ("newer", "missed", "torn"):
            row = intent(backend, FAM, name)
            assert row is not None
            if not row.pending_request:
                with backend.transaction() as conn:
                    FAM.request(conn, name)
            FAM(name, make_context(backend, FAM, name, term))
        with backend.read() as conn:
            per_scope = {
                name: [(c["cron_fire"], c["status"]) for c in pf.candidates(conn, name)]
                for name in ("done", "newer", "missed", "review", "torn")
            }
        assert per_scope["done"] == [(FIRE1, pf.APPROVED)]
        assert per_scope["newer"] == [(FIRE1, pf.APPROVED)]  # FIRE1 is spent: no duplicate
        assert per_scope["missed"] == [(FIRE1, pf.PENDING)]  # the interrupted fire is redone
        assert per_scope["review"] == [(FIRE1, pf.PENDING)]  # still awaiting Review
        assert per_scope["torn"] == [(FIRE1, pf.APPROVED)]  # the unique fire holds
        # The next fire takes the Sources that waited: none is lost.
        with backend.transaction() as conn:
            scans.set_checkpoint(conn, FAM.binding_name, FIRE2)
            FAM.request(conn, "newer")
            FAM.request(conn, "torn")
        FAM("newer", make_context(backend, FAM, "newer", term))
        FAM("torn", make_context(backend, FAM, "torn", term))
        with backend.read() as conn:
            newer = pf.candidates(conn, "newer")[-1]
            torn = pf.candidates(conn, "torn")[-1]
        assert (newer["cron_fire"], newer["source_from"], newer["source_through"]) == (FIRE2, 3, 3)
        assert (torn["cron_fire"], torn["source_from"], torn["source_through"]) == (FIRE2, 1, 1)
        # Reviewing the carried-over Candidate re-marks its waiting Source.
        with backend.transaction() as conn:
            pending = pf.candidates(conn, "review")[0]["candidate_id"]
            assert pf.review(conn, pending, approve=True) == pf.APPROVED
            assert pf.published(conn, "review") is not None
        row = intent(backend, FAM, "review")
        assert row is not None and row.dirty
    finally:
        backend.dispose()
