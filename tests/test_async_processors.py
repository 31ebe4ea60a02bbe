"""Processors through the real Worker wrapper, sync and ``async def`` alike, on both backends.

An ``async def`` processor used to be "called": the wrapper got a coroutine, never awaited it,
and acknowledged the request as handled (a lost request reported as done). These tests launch
the real wrapper (``apsup.workers.invoke:run``) in real Workers for the same scenarios with a
plain and an async processor (tests/processor_families.py) and read the outcome from the exit
code, the durable intent row and marker files the processor body writes.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import select

from apsup.context import ExecutionContext
from apsup.registry import Family
from apsup.store import SqlBackend, intents
from apsup.store.leases import Term
from apsup.workers import ExitCode, WorkerExit, WorkerPool
from apsup.workers.invoke import TARGET
from tests import _contract_fencing as fj
from tests import processor_families as pf
from tests.test_worker_processes import LIMIT, drive, skew_to_deadline, wait_until

pytestmark = [pytest.mark.timeout(180), pytest.mark.backends("sqlite", "mysql", "postgresql")]


@pytest.fixture(params=["sync", "async"])
def fam(request: pytest.FixtureRequest) -> Family:
    return pf.probe_sync if request.param == "sync" else pf.probe_async


@pytest.fixture
def store(backend: SqlBackend) -> SqlBackend:
    pf.metadata.create_all(backend.engine)
    return backend


@pytest.fixture
def term(store: SqlBackend) -> Term:
    claimed = store.claim_term(fj.KEY, "holder-0", 60)
    assert claimed is not None
    return claimed


@pytest.fixture
def pool() -> Iterator[WorkerPool]:
    p = WorkerPool(["tests.processor_families"], grace_seconds=3.0, confirm_seconds=1.0)
    try:
        yield p
    finally:
        p.close()


def context(
    store: SqlBackend, fam: Family, scope_id: str, term: Term, probe_dir: Path
) -> ExecutionContext:
    generation = store.run(lambda conn: fam.request(conn, scope_id))
    with store.read() as conn:
        row = intents.get(conn, fam.binding_name, scope_id)
    assert row is not None
    return ExecutionContext(
        binding_name=fam.binding_name,
        artifact_family=fam.name,
        scope_id=scope_id,
        claimed_request_generation=generation,
        supervisor_key=term.supervisor_key,
        holder_id=term.holder_id,
        supervisor_generation=term.generation,
        worker_id=f"w-{scope_id}",
        pending_sequence=row.pending_sequence,
        entry_point=fam.entry_point,
        database_url=store.url,
        settings={"PROBE_DIR": str(probe_dir)},
    )


def run_worker(pool: WorkerPool, ctx: ExecutionContext) -> WorkerExit:
    pool.launch(ctx.worker_id, TARGET, ctx.to_bytes(), timeout=LIMIT)
    return drive(pool, {ctx.worker_id})[ctx.worker_id]


def handled(store: SqlBackend, fam: Family, scope_id: str) -> int:
    with store.read() as conn:
        row = intents.get(conn, fam.binding_name, scope_id)
    return 0 if row is None else row.handled_generation


def markers(probe_dir: Path, scope_id: str) -> list[str]:
    path = probe_dir / scope_id
    return path.read_text().splitlines() if path.exists() else []


def probe_rows(store: SqlBackend) -> list[tuple[str, str]]:
    with store.read() as conn:
        return [tuple(r) for r in conn.execute(select(pf.runs.c.scope_id, pf.runs.c.note))]


def test_wrapper_acknowledges_only_after_the_body_ran(
    store: SqlBackend, fam: Family, term: Term, pool: WorkerPool, tmp_path: Path
) -> None:
    """Returning without acknowledging and without a fenced transaction: the wrapper
    acknowledges, and only after the body (for async: past its first await) really ran."""
    ctx = context(store, fam, "noack.1", term, tmp_path)
    ex = run_worker(pool, ctx)
    assert ex.exitcode == ExitCode.SUCCESS, ex
    assert markers(tmp_path, "noack.1") == ["ran"], "acknowledged, but the body never ran"
    assert handled(store, fam, "noack.1") == ctx.claimed_request_generation


def test_failure_after_the_body_started_is_not_acknowledged(
    store: SqlBackend, fam: Family, term: Term, pool: WorkerPool, tmp_path: Path
) -> None:
    ctx = context(store, fam, "fail.1", term, tmp_path)
    assert run_worker(pool, ctx).exitcode == ExitCode.PROCESSOR_FAILURE
    assert markers(tmp_path, "fail.1") == ["ran"]
    assert handled(store, fam, "fail.1") == 0


def test_fenced_business_write_and_acknowledgment_commit_together(
    store: SqlBackend, fam: Family, term: Term, pool: WorkerPool, tmp_path: Path
) -> None:
    ctx = context(store, fam, "fenced.1", term, tmp_path)
    assert run_worker(pool, ctx).exitcode == ExitCode.SUCCESS
    note = "async" if fam is pf.probe_async else "sync"
    assert probe_rows(store) == [("fenced.1", note)]
    assert handled(store, fam, "fenced.1") == ctx.claimed_request_generation


def test_progress_conflict_and_stale_term_keep_their_exit_codes(
    store: SqlBackend, fam: Family, term: Term, pool: WorkerPool, tmp_path: Path
) -> None:
    conflict = context(store, fam, "conflict.1", term, tmp_path)
    assert run_worker(pool, conflict).exitcode == ExitCode.PROGRESS_CONFLICT
    stale = context(store, fam, "stale.1", term, tmp_path)
    fj.bump(store, "holder-1")  # the dispatching term is replaced before the Worker commits
    assert run_worker(pool, stale).exitcode == ExitCode.STALE_TERM
    assert probe_rows(store) == []
    assert handled(store, fam, "conflict.1") == handled(store, fam, "stale.1") == 0


def test_timeout_stops_the_processor_unacknowledged_and_finally_runs(
    store: SqlBackend, fam: Family, term: Term, pool: WorkerPool, tmp_path: Path
) -> None:
    ctx = context(store, fam, "sleep.1", term, tmp_path)
    handle = pool.launch(ctx.worker_id, TARGET, ctx.to_bytes(), timeout=LIMIT)
    wait_until(lambda: markers(tmp_path, "sleep.1") == ["started"], "processor start")
    ex = drive(pool, {ctx.worker_id}, skew=skew_to_deadline(handle))[ctx.worker_id]
    assert (ex.exitcode, ex.timed_out) == (ExitCode.TERMINATED, True)
    assert markers(tmp_path, "sleep.1") == ["started", "finally"]
    assert handled(store, fam, "sleep.1") == 0
