"""Test families for the multi-replica tests, and their business tables.

``replica-work`` (explicit requests only) is a well-behaved processor in the RFC §6 sense:

1. a fenced snapshot transaction reads (and creates) its progress row ``(version, last_g)``;
   if ``last_g >= G`` the business work for G is already committed (a Worker died between its
   business commit and the acknowledgment): it only acknowledges;
2. it computes outside any transaction (a random sleep);
3. one fenced business transaction: progress CAS ``version -> version + 1, last_g := G`` (a lost
   CAS raises ``ProgressConflict``) and one journal row recording the term that committed it;
4. a fenced acknowledgment.

Journal rows take their ``seq`` from a counter row updated in the same transaction, so ``seq``
order is commit order (the counter row stays locked until commit). The tests also journal the
takeovers they observe (``kind='takeover'``, written after the fact, which can only move a
takeover later and never causes a false violation).

Fault injection for Worker-kill tests, read from the environment of the replica process (the
Worker inherits it): ``REPLICA_TEST_KILL`` = probability that the *first* attempt of an
invocation kills itself with SIGKILL at one of ``before_commit`` (after computing),
``in_txn`` (inside the business transaction, before COMMIT) or ``after_commit`` (between the
business commit and the acknowledgment). ``REPLICA_TEST_WORK`` = ``min,max`` seconds of compute.

``replica-side`` is a second family (dedicated-mode tests: two Leases). A Scope id starting
with ``fail.`` fails every time, with a secret in its message (the cluster view's tests).
"""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Iterable
from typing import Any

from sqlalchemy import (
    BigInteger,
    Column,
    Connection,
    Integer,
    MetaData,
    String,
    Table,
    func,
    insert,
    select,
    update,
)
from sqlalchemy.exc import IntegrityError

from apsup.context import ExecutionContext
from apsup.errors import ProgressConflict, StaleTermError
from apsup.registry import Registry, family
from apsup.store import open_backend

registry = Registry()
metadata = MetaData()

progress = Table(
    "replica_progress",
    metadata,
    Column("scope_id", String(64), primary_key=True),
    Column("version", BigInteger, nullable=False),
    Column("last_g", BigInteger, nullable=False),
)

journal = Table(
    "replica_journal",
    metadata,
    Column("seq", BigInteger, primary_key=True, autoincrement=False),
    Column("kind", String(16), nullable=False),  # commit | takeover
    Column("family", String(64), nullable=True),
    Column("scope_id", String(64), nullable=True),
    Column("g", BigInteger, nullable=True),
    Column("version", BigInteger, nullable=True),
    Column("supervisor_key", String(160), nullable=False),
    Column("generation", BigInteger, nullable=False),
    Column("holder_id", String(64), nullable=False),
    Column("worker_id", String(64), nullable=True),
)

counter = Table(
    "replica_counter",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=False),
    Column("value", BigInteger, nullable=False),
)

accepted = Table(
    "replica_accepted",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("family", String(64), nullable=False),
    Column("scope_id", String(64), nullable=False),
    Column("g", BigInteger, nullable=False),
)

events = Table(
    "replica_events",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("kind", String(32), nullable=False),  # attempt | killed:<point> | stale_rejected
    Column("family", String(64), nullable=False),
    Column("scope_id", String(64), nullable=False),
    Column("g", BigInteger, nullable=False),
    Column("generation", BigInteger, nullable=False),
)

KILL_POINTS = ("before_commit", "in_txn", "after_commit")


def create_tables(url: str) -> None:
    backend = open_backend(url)
    try:
        metadata.create_all(backend.engine)
        with backend.transaction() as conn:
            if conn.execute(select(counter.c.id)).first() is None:
                conn.execute(insert(counter).values(id=1, value=0))
    finally:
        backend.dispose()


def next_seq(conn: Connection) -> int:
    conn.execute(update(counter).where(counter.c.id == 1).values(value=counter.c.value + 1))
    return int(conn.execute(select(counter.c.value).where(counter.c.id == 1)).scalar_one())


def stamp_takeover(conn: Connection, key: str, generation: int, holder_id: str) -> int:
    seq = next_seq(conn)
    conn.execute(
        insert(journal).values(
            seq=seq, kind="takeover", supervisor_key=key, generation=generation, holder_id=holder_id
        )
    )
    return seq


def _event(ctx: ExecutionContext, kind: str) -> int:
    """Test instrumentation (not business data): a plain, unfenced transaction."""
    with ctx.backend.transaction() as conn:
        conn.execute(
            insert(events).values(
                kind=kind,
                family=ctx.artifact_family,
                scope_id=ctx.scope_id,
                g=ctx.claimed_request_generation,
                generation=ctx.supervisor_generation,
            )
        )
        return int(
            conn.execute(
                select(func.count()).where(
                    events.c.kind == "attempt",
                    events.c.family == ctx.artifact_family,
                    events.c.scope_id == ctx.scope_id,
                    events.c.g == ctx.claimed_request_generation,
                )
            ).scalar_one()
        )


def _work_seconds() -> float:
    raw = os.environ.get("REPLICA_TEST_WORK", "0.02,0.2")
    low, high = (float(x) for x in raw.split(","))
    return random.uniform(low, high)


def _kill_plan(attempt: int) -> str | None:
    p = float(os.environ.get("REPLICA_TEST_KILL", "0") or 0)
    if attempt != 1 or p <= 0 or random.random() >= p:
        return None
    return random.choice(KILL_POINTS)


def _die(ctx: ExecutionContext, point: str) -> None:
    _event(ctx, f"killed:{point}")
    os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)  # pragma: no cover - SIGKILL is not catchable


def _snapshot(conn: Connection, scope_id: str) -> tuple[int, int]:
    row = conn.execute(
        select(progress.c.version, progress.c.last_g).where(progress.c.scope_id == scope_id)
    ).first()
    if row is None:
        try:
            with conn.begin_nested():
                conn.execute(insert(progress).values(scope_id=scope_id, version=0, last_g=0))
        except IntegrityError:
            pass
        return 0, 0
    return int(row[0]), int(row[1])


def process(scope_id: str, ctx: ExecutionContext) -> None:
    if scope_id.startswith("fail."):
        raise RuntimeError(f"{scope_id} cannot be processed: password hunter2 rejected")
    attempt = _event(ctx, "attempt")
    plan = _kill_plan(attempt)
    g = ctx.claimed_request_generation
    with ctx.fenced() as conn:
        version, last_g = _snapshot(conn, scope_id)
        dirty = ctx.dirty_generation(conn)
    if last_g < g:
        time.sleep(_work_seconds())  # compute outside any transaction
        if plan == "before_commit":
            _die(ctx, plan)
        try:
            with ctx.fenced() as conn:
                moved = conn.execute(
                    update(progress)
                    .where(progress.c.scope_id == scope_id, progress.c.version == version)
                    .values(version=version + 1, last_g=g)
                ).rowcount
                if moved != 1:
                    raise ProgressConflict(f"progress of {scope_id} moved past version {version}")
                conn.execute(
                    insert(journal).values(
                        seq=next_seq(conn),
                        kind="commit",
                        family=ctx.artifact_family,
                        scope_id=scope_id,
                        g=g,
                        version=version + 1,
                        supervisor_key=ctx.supervisor_key,
                        generation=ctx.supervisor_generation,
                        holder_id=ctx.holder_id,
                        worker_id=ctx.worker_id,
                    )
                )
                if plan == "in_txn":
                    _die(ctx, plan)
        except StaleTermError:
            _event(ctx, "stale_rejected")
            raise
        if plan == "after_commit":
            _die(ctx, plan)
    with ctx.fenced() as conn:
        ctx.mark_clean(conn, dirty)  # everything up to the snapshot is processed
        ctx.acknowledge(conn)


@family("replica-work", max_workers=4, timeout=30, registry=registry)
def work(scope_id: str, ctx: ExecutionContext) -> None:
    process(scope_id, ctx)


@family("replica-side", max_workers=2, timeout=30, registry=registry)
def side(scope_id: str, ctx: ExecutionContext) -> None:
    process(scope_id, ctx)


# -- checkers -------------------------------------------------------------------------------------


def read_journal(conn: Connection) -> list[Any]:
    return list(
        conn.execute(
            select(
                journal.c.seq,
                journal.c.kind,
                journal.c.family,
                journal.c.scope_id,
                journal.c.g,
                journal.c.supervisor_key,
                journal.c.generation,
                journal.c.holder_id,
            ).order_by(journal.c.seq)
        )
    )


def fencing_violations(rows: Iterable[Any]) -> list[str]:
    """Commits (in commit order) carrying a generation older than a generation that had already
    taken over the same key: journalled takeovers, or a commit of a newer generation."""
    newest: dict[str, tuple[int, int, str]] = {}
    problems = []
    for r in rows:
        key, gen = r.supervisor_key, int(r.generation)
        seen = newest.get(key)
        if r.kind == "commit" and seen is not None and gen < seen[0]:
            problems.append(
                f"commit #{r.seq} ({r.family}/{r.scope_id} G={r.g}) of generation {gen} after "
                f"{seen[2]} #{seen[1]} of generation {seen[0]}"
            )
        if seen is None or gen > seen[0]:
            newest[key] = (gen, int(r.seq), str(r.kind))
    return problems


def duplicate_commits(rows: Iterable[Any]) -> list[str]:
    seen: dict[tuple[str, str, int], int] = {}
    problems = []
    for r in rows:
        if r.kind != "commit":
            continue
        k = (r.family, r.scope_id, int(r.g))
        if k in seen:
            problems.append(f"{k} committed twice: #{seen[k]} and #{r.seq}")
        seen[k] = int(r.seq)
    return problems


#: A separate registry with an interval family: its Supervisor performs scan control writes
#: (start/admit/end) every second, for the lock-wait tests.
auto_registry = Registry()


@family("replica-auto", interval=1, max_workers=2, timeout=30, registry=auto_registry)
def auto(scope_id: str, ctx: ExecutionContext) -> None:
    process(scope_id, ctx)


#: Four families for the dedicated scale-out tests (placement over several replicas).
scale_registry = Registry()


@family("scale-a", max_workers=2, timeout=30, registry=scale_registry)
def scale_a(scope_id: str, ctx: ExecutionContext) -> None:
    process(scope_id, ctx)


@family("scale-b", max_workers=2, timeout=30, registry=scale_registry)
def scale_b(scope_id: str, ctx: ExecutionContext) -> None:
    process(scope_id, ctx)


@family("scale-c", max_workers=2, timeout=30, registry=scale_registry)
def scale_c(scope_id: str, ctx: ExecutionContext) -> None:
    process(scope_id, ctx)


@family("scale-d", max_workers=2, timeout=30, registry=scale_registry)
def scale_d(scope_id: str, ctx: ExecutionContext) -> None:
    process(scope_id, ctx)


REGISTRIES = {"default": registry, "auto": auto_registry, "scale": scale_registry}


def lookup(name: str) -> Any:
    """A test family by name, whichever registry holds it."""
    for reg in REGISTRIES.values():
        if name in reg:
            return reg.get(name)
    raise KeyError(name)
