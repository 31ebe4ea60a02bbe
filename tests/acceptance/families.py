"""Test families for the Supervisor acceptance tests, imported by Worker children by name.

Every family runs the same processor, :func:`behave`; the Scope id selects what it does, by the
part before the first ``.`` (``"ok.1"``, ``"fail.b1"``, ``"gate.x"``...). Tests pick budgets,
policies and timeouts per run with :func:`configure` (an effective copy of the record; the
Worker still resolves the module-level one by its entry point).

Processors leave durable facts in three business tables of the same database, so tests assert on
what happened, never on sleeps:

- ``acc_events``: one row per invocation: family, scope, Worker pid, claimed generation G, term,
  the dirty generation and last-auto-scan marker read at start, start/end times
  (``CLOCK_MONOTONIC`` in microseconds, system-wide on Linux) and the outcome. The end is written
  in the same fenced transaction as the acknowledgment.
- ``acc_inputs``: ordered business input per Scope; ``consumed_generation`` is set in the
  transaction that acknowledges the invocation that consumed it.
- ``acc_flags``: named flags a test sets to release Workers that wait (``gate``, ``hold``).

Kinds (``attempt`` counts this Scope's invocations, from ``acc_events``):

=========  ========================================================================================
ok         sleep ``ACC_SLEEP`` seconds (Worker setting, default 0), mark clean up to the dirty
           generation read at start, acknowledge
keep       like ok without marking clean (the Scope stays dirty)
gate       wait for flag ``gate:<scope>``, then like ok
hold       wait for flag ``hold:<family>``, then like ok
fail       always raise (an ordinary failure)
leak       always raise a ValueError whose message quotes a URL password and a ``secret=`` pair
crash      attempt 1: SIGKILL itself; later attempts like ok
exit1      attempt 1: ``os._exit(1)``; later attempts like ok
noack      attempt 1: ``os._exit(0)`` without acknowledging; later attempts like ok
hang       attempt 1: ignore SIGTERM and sleep (needs SIGKILL); later attempts like ok
soft       attempt 1: sleep (a SIGTERM stops it gracefully); later attempts like ok
ackcrash   consume one input and acknowledge in one transaction, then ``os._exit(1)``
partfail   commit the first unconsumed input in its own transaction; attempt 1 then fails, later
           attempts consume the rest and acknowledge (resuming from durable progress)
half       consume half (rounded up) of the unconsumed inputs; mark clean only when none remain
ordered    consume the first unconsumed input, in order; an input ``poison`` always fails
=========  ========================================================================================

``acc-manual-async`` and ``acc-b-async`` are ``async def`` twins of ``acc-manual`` and ``acc-b``
(:func:`behave_async`): they await where ``behave`` blocks and commit through
``ctx.fenced_async()``, so tests can run the same scenario over sync and async processors.
"""

from __future__ import annotations

import asyncio
import math
import os
import signal
import time
from typing import Any

from sqlalchemy import (
    BigInteger,
    Column,
    Connection,
    Engine,
    Integer,
    MetaData,
    String,
    Table,
    func,
    insert,
    select,
    update,
)

from apsup.context import ExecutionContext
from apsup.policy import Cron, Disabled, Interval
from apsup.registry import Family, Registry, family
from apsup.store import intents as store_intents

metadata = MetaData()

_Id = BigInteger().with_variant(Integer, "sqlite")  # INTEGER PRIMARY KEY autoincrements there

events = Table(
    "acc_events",
    metadata,
    Column("id", _Id, primary_key=True, autoincrement=True),
    Column("family", String(64), nullable=False),
    Column("scope_id", String(255), nullable=False),
    Column("attempt", Integer, nullable=False),
    Column("pid", Integer, nullable=False),
    Column("worker_id", String(64), nullable=False),
    Column("generation", BigInteger, nullable=False),
    Column("term", BigInteger, nullable=False),
    Column("dirty", BigInteger, nullable=False),
    Column("last_scan", BigInteger, nullable=False),
    Column("alive_peers", Integer, nullable=False),
    Column("started_us", BigInteger, nullable=False),
    Column("ended_us", BigInteger, nullable=True),
    Column("outcome", String(32), nullable=True),
)

inputs = Table(
    "acc_inputs",
    metadata,
    Column("family", String(64), primary_key=True),
    Column("scope_id", String(255), primary_key=True),
    Column("position", Integer, primary_key=True),
    Column("payload", String(64), nullable=False),
    Column("consumed_generation", BigInteger, nullable=True),
    Column("consumed_us", BigInteger, nullable=True),
)

flags = Table("acc_flags", metadata, Column("name", String(255), primary_key=True))

FLAG_WAIT_LIMIT = 90.0  # a waiting Worker gives up (fails) after this; tests finish far sooner
LONG_SLEEP = 120.0


def now_us() -> int:
    return time.monotonic_ns() // 1000


# --- families -------------------------------------------------------------------------------------

registry = Registry()


@family("acc-a", interval=1, max_workers=3, timeout=30, registry=registry)
def acc_a(scope_id: str, ctx: ExecutionContext) -> None:
    behave(scope_id, ctx)


@family("acc-b", interval=1, max_workers=2, timeout=30, registry=registry)
def acc_b(scope_id: str, ctx: ExecutionContext) -> None:
    behave(scope_id, ctx)


@family("acc-c", interval=1, max_workers=2, timeout=30, registry=registry)
def acc_c(scope_id: str, ctx: ExecutionContext) -> None:
    behave(scope_id, ctx)


@family("acc-manual", max_workers=2, timeout=30, registry=registry)
def acc_manual(scope_id: str, ctx: ExecutionContext) -> None:
    behave(scope_id, ctx)


@family("acc-manual-async", max_workers=2, timeout=30, registry=registry)
async def acc_manual_async(scope_id: str, ctx: ExecutionContext) -> None:
    await behave_async(scope_id, ctx)


@family("acc-b-async", interval=1, max_workers=2, timeout=30, registry=registry)
async def acc_b_async(scope_id: str, ctx: ExecutionContext) -> None:
    await behave_async(scope_id, ctx)


BY_NAME: dict[str, Family] = {f.name: f for f in registry}


def configure(
    fam: Family | str,
    *,
    interval: float | None = None,
    cron: str | None = None,
    timezone: str | None = None,
    disabled: bool = False,
    max_workers: int | None = None,
    timeout: float | None = None,
) -> Family:
    """An effective copy of a test family with this run's policy, budget and timeout."""
    base = BY_NAME[fam] if isinstance(fam, str) else fam
    changes: dict[str, Any] = {}
    if disabled:
        changes["policy"] = Disabled()
    elif interval is not None:
        changes["policy"] = Interval(float(interval))
    elif cron is not None:
        changes["policy"] = Cron(cron, timezone or "UTC")
    if max_workers is not None:
        changes["max_workers"] = max_workers
    if timeout is not None:
        changes["timeout"] = float(timeout)
    return base.with_overrides(**changes) if changes else base


def from_spec(spec: dict[str, dict[str, Any]]) -> list[Family]:
    """``{"acc-a": {"interval": 1, "max_workers": 2}, ...}`` -> configured families."""
    return [configure(name, **opts) for name, opts in spec.items()]


# --- test-side helpers ---------------------------------------------------------------------


def create_tables(engine: Engine) -> None:
    metadata.create_all(engine)


def set_flag(conn: Connection, name: str) -> None:
    conn.execute(insert(flags).values(name=name))


def add_inputs(conn: Connection, fam: Family, scope_id: str, payloads: list[str]) -> None:
    """Domain input and its dirty marker in the caller's transaction (RFC §3)."""
    start = conn.execute(
        select(func.coalesce(func.max(inputs.c.position), 0)).where(
            inputs.c.family == fam.name, inputs.c.scope_id == scope_id
        )
    ).scalar_one()
    for offset, payload in enumerate(payloads, start=1):
        conn.execute(
            insert(inputs).values(
                family=fam.name, scope_id=scope_id, position=int(start) + offset, payload=payload
            )
        )
    fam.mark_dirty(conn, scope_id)


def event_rows(conn: Connection, family_name: str | None = None) -> list[dict[str, Any]]:
    stmt = select(events).order_by(events.c.id)
    if family_name is not None:
        stmt = stmt.where(events.c.family == family_name)
    return [dict(r._mapping) for r in conn.execute(stmt)]


def input_rows(conn: Connection, family_name: str, scope_id: str) -> list[dict[str, Any]]:
    stmt = (
        select(inputs)
        .where(inputs.c.family == family_name, inputs.c.scope_id == scope_id)
        .order_by(inputs.c.position)
    )
    return [dict(r._mapping) for r in conn.execute(stmt)]


# --- the processor --------------------------------------------------------------------------


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _start(scope_id: str, ctx: ExecutionContext) -> tuple[int, int, int]:
    """Record the invocation; returns (event id, attempt, dirty generation read at start)."""
    me = os.getpid()
    with ctx.backend.transaction() as conn:
        attempt = 1 + int(
            conn.execute(
                select(func.count()).where(
                    events.c.family == ctx.artifact_family, events.c.scope_id == scope_id
                )
            ).scalar_one()
        )
        open_pids = conn.execute(
            select(events.c.pid).where(
                events.c.family == ctx.artifact_family, events.c.ended_us.is_(None)
            )
        ).scalars()
        peers = sum(1 for pid in set(open_pids) if pid != me and _alive(pid))
        row = store_intents.get(conn, ctx.binding_name, scope_id)
        dirty = 0 if row is None else row.dirty_generation
        last_scan = 0 if row is None else row.last_auto_scan_generation
        event_id = conn.execute(
            insert(events).values(
                family=ctx.artifact_family,
                scope_id=scope_id,
                attempt=attempt,
                pid=me,
                worker_id=ctx.worker_id,
                generation=ctx.claimed_request_generation,
                term=ctx.supervisor_generation,
                dirty=dirty,
                last_scan=last_scan,
                alive_peers=peers,
                started_us=now_us(),
            )
        ).inserted_primary_key[0]
    return int(event_id), attempt, dirty


def _note(ctx: ExecutionContext, event_id: int, outcome: str) -> None:
    with ctx.backend.transaction() as conn:
        conn.execute(update(events).where(events.c.id == event_id).values(outcome=outcome))


def _finish(conn: Connection, event_id: int, outcome: str = "ok") -> None:
    conn.execute(
        update(events).where(events.c.id == event_id).values(ended_us=now_us(), outcome=outcome)
    )


def _wait_flag(ctx: ExecutionContext, name: str) -> None:
    end = time.monotonic() + FLAG_WAIT_LIMIT
    while time.monotonic() < end:
        with ctx.backend.read() as conn:
            if conn.execute(select(flags.c.name).where(flags.c.name == name)).first():
                return
        time.sleep(0.02)
    raise TimeoutError(f"flag {name!r} was never set")


def _complete(
    ctx: ExecutionContext, event_id: int, dirty: int, *, clean: bool = True, sleep: float = 0
) -> None:
    if sleep > 0:
        time.sleep(sleep)  # compute outside any transaction
    with ctx.fenced() as conn:
        if clean:
            ctx.mark_clean(conn, dirty)
        ctx.acknowledge(conn)
        _finish(conn, event_id)


def _unconsumed(conn: Connection, ctx: ExecutionContext, scope_id: str) -> list[Any]:
    return list(
        conn.execute(
            select(inputs.c.position, inputs.c.payload)
            .where(
                inputs.c.family == ctx.artifact_family,
                inputs.c.scope_id == scope_id,
                inputs.c.consumed_generation.is_(None),
            )
            .order_by(inputs.c.position)
        )
    )


def _consume(conn: Connection, ctx: ExecutionContext, scope_id: str, positions: list[int]) -> None:
    for position in positions:
        done = conn.execute(
            update(inputs)
            .where(
                inputs.c.family == ctx.artifact_family,
                inputs.c.scope_id == scope_id,
                inputs.c.position == position,
                inputs.c.consumed_generation.is_(None),
            )
            .values(consumed_generation=ctx.claimed_request_generation, consumed_us=now_us())
        ).rowcount
        assert done == 1, f"input {position} of {scope_id} consumed twice"


def behave(scope_id: str, ctx: ExecutionContext) -> None:
    kind = scope_id.split(".", 1)[0]
    event_id, attempt, dirty = _start(scope_id, ctx)
    sleep = float(os.environ.get("ACC_SLEEP", "0") or 0)
    if kind == "ok":
        _complete(ctx, event_id, dirty, sleep=sleep)
    elif kind == "keep":
        _complete(ctx, event_id, dirty, clean=False, sleep=sleep)
    elif kind == "gate":
        _wait_flag(ctx, f"gate:{scope_id}")
        _complete(ctx, event_id, dirty)
    elif kind == "hold":
        _wait_flag(ctx, f"hold:{ctx.artifact_family}")
        _complete(ctx, event_id, dirty)
    elif kind == "fail":
        _note(ctx, event_id, "fail")
        raise RuntimeError("acceptance: this Scope always fails")
    elif kind == "leak":  # a message quoting a credential, as a careless driver error would
        _note(ctx, event_id, "fail")
        raise ValueError(
            "boom-token-7731 cannot reach mysql://svc:hunter2pw@db.internal:3306/app "
            "(secret=s3cr3t-value)"
        )
    elif kind in ("crash", "exit1", "noack", "hang", "soft") and attempt == 1:
        _first_attempt_misbehaves(kind, ctx, event_id)
    elif kind in ("crash", "exit1", "noack", "hang", "soft"):
        _complete(ctx, event_id, dirty)
    elif kind == "ackcrash":
        with ctx.fenced() as conn:
            rows = _unconsumed(conn, ctx, scope_id)
            _consume(conn, ctx, scope_id, [r[0] for r in rows[:1]])
            ctx.acknowledge(conn)
            _finish(conn, event_id, "acked")
        os._exit(1)  # the acknowledgment committed; the exit is lost
    elif kind == "partfail":
        with ctx.fenced() as conn:  # a legitimate short business commit, not acknowledging
            rows = _unconsumed(conn, ctx, scope_id)
            _consume(conn, ctx, scope_id, [r[0] for r in rows[:1]])
        if attempt == 1:
            _note(ctx, event_id, "partfail")
            raise RuntimeError("acceptance: failed after a partial business commit")
        with ctx.fenced() as conn:
            rows = _unconsumed(conn, ctx, scope_id)
            _consume(conn, ctx, scope_id, [r[0] for r in rows])
            ctx.mark_clean(conn, dirty)
            ctx.acknowledge(conn)
            _finish(conn, event_id)
    elif kind == "half":
        with ctx.fenced() as conn:
            rows = _unconsumed(conn, ctx, scope_id)
            take = math.ceil(len(rows) / 2)
            _consume(conn, ctx, scope_id, [r[0] for r in rows[:take]])
            if take == len(rows):
                ctx.mark_clean(conn, dirty)  # nothing left of this snapshot
            ctx.acknowledge(conn)
            _finish(conn, event_id, f"took {take}/{len(rows)}")
    elif kind == "ordered":
        with ctx.fenced() as conn:
            rows = _unconsumed(conn, ctx, scope_id)
            poisoned = bool(rows) and rows[0][1] == "poison"
            if not poisoned:
                _consume(conn, ctx, scope_id, [r[0] for r in rows[:1]])
                if len(rows) <= 1:
                    ctx.mark_clean(conn, dirty)
                ctx.acknowledge(conn)
                _finish(conn, event_id, rows[0][1] if rows else "noop")
        if poisoned:  # nothing consumed: B2 must wait for B1 (RFC "Meaning of one invocation")
            _note(ctx, event_id, "poison")
            raise RuntimeError("acceptance: poisoned input")
    else:
        raise ValueError(f"unknown acceptance behaviour {kind!r} in scope {scope_id!r}")


def _first_attempt_misbehaves(kind: str, ctx: ExecutionContext, event_id: int) -> None:
    _note(ctx, event_id, kind)
    if kind == "crash":
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "exit1":
        os._exit(1)
    elif kind == "noack":
        os._exit(0)  # exit 0 without a durable acknowledgment
    elif kind == "hang":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(LONG_SLEEP)
    elif kind == "soft":
        time.sleep(LONG_SLEEP)
    raise AssertionError("unreachable: the first attempt should not return")


async def behave_async(scope_id: str, ctx: ExecutionContext) -> None:
    """``behave`` as a coroutine for the kinds the sync/async parity tests use; the start and
    note records stay sync (they are test bookkeeping, not the path under test)."""
    kind = scope_id.split(".", 1)[0]
    event_id, attempt, dirty = _start(scope_id, ctx)
    sleep = float(os.environ.get("ACC_SLEEP", "0") or 0)
    if kind in ("ok", "keep") or (
        kind in ("crash", "exit1", "noack", "hang", "soft") and attempt > 1
    ):
        await asyncio.sleep(sleep)  # compute outside any transaction
        async with ctx.fenced_async() as conn:
            if kind != "keep":
                await ctx.mark_clean_async(conn, dirty)
            await ctx.acknowledge_async(conn)
            await conn.run_sync(_finish, event_id)
    elif kind == "fail":
        await asyncio.sleep(0)
        _note(ctx, event_id, "fail")
        raise RuntimeError("acceptance: this Scope always fails")
    elif kind in ("crash", "exit1", "noack"):
        await asyncio.sleep(0)
        _first_attempt_misbehaves(kind, ctx, event_id)
    elif kind in ("hang", "soft"):
        _note(ctx, event_id, kind)
        if kind == "hang":
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        await asyncio.sleep(LONG_SLEEP)
        raise AssertionError("unreachable: the first attempt should not return")
    else:
        raise ValueError(f"unknown async acceptance behaviour {kind!r} in scope {scope_id!r}")
