"""Move Profile from its APScheduler cron sidecar onto the Supervisor.

Revision ID: apsup_0004
Revises: apsup_0003
Create Date: 2026-12-03

Run during maintenance shutdown, after the APScheduler sidecar has stopped. On a database
without Profile data and without an APScheduler job store it does nothing.

Legacy schema, as this migration reads it
-----------------------------------------

APScheduler 3's ``SQLAlchemyJobStore`` table, holding Profile's cron job under ``JOB_IDS``::

    apscheduler_jobs(id VARCHAR(191) PK, next_run_time FLOAT NULL, job_state BLOB NOT NULL)

``next_run_time`` is the UNIX time of the next fire. APScheduler advances it *before* running a
fire, so the fire just before it is the latest fire that was started, not one proven complete.

Profile domain tables: the shapes of ``apsup.families.profile`` (Sources, Cursor with
``last_fire``, Policy, Candidates unique per ``(scope_id, cron_fire)``, published, access).

Mapping
-------

For every Scope the latest fire, Policy, Cursor and pending Candidate decide whether work exists:

- Policy enabled (no row = enabled), no Candidate awaiting Review, and Sources beyond the Cursor
  -> ordinary dirty state, so no Source is lost when the sidecar stops.
- If, in addition, the latest started fire did not finish for that Scope (its Cursor is behind
  that fire and no Candidate of that fire exists) -> an accepted request, with recovery
  responsibility, so the interrupted fire is redone even if automatic scheduling is disabled.
- A pending Candidate is left alone: it keeps awaiting Review (``review`` re-marks the Scope
  dirty when Sources arrived meanwhile). One fire never yields two Candidates: the processor
  skips a fire already recorded by the Cursor or by a Candidate, and the unique key backs it.
- ``last_schedule_checkpoint_at`` stays NULL so the first start performs Profile's immediate
  catch-up (RFC §4), which coalesces every missed fire into the latest one.
- The APScheduler job rows are deleted: the old entry point must not fire alongside Workers.

Downgrade is a no-op (the APScheduler job is re-added by the sidecar's own startup).
"""

from __future__ import annotations

import os
from datetime import UTC, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo

import sqlalchemy as sa
from alembic import context, op
from croniter import croniter
from sqlalchemy.dialects import mysql

revision = "apsup_0004"
down_revision = "apsup_0003"
branch_labels = None
depends_on = None

BINDING = "profile"
JOB_IDS = ("profile-cron", "profile_cron", "profile")
APSCHEDULER = "apscheduler_jobs"
ENV = "POWERCONTEXT_SERVER_RUNTIME_"
DEFAULT_CRON = "0 2 * * *"
DEFAULT_TIMEZONE = "Asia/Shanghai"
INTENTS = "pc_artifact_processing_intents"
COUNTERS = "pc_artifact_processing_counters"

intents = sa.table(
    INTENTS,
    sa.column("binding_name"),
    sa.column("scope_id"),
    sa.column("pending_sequence"),
    sa.column("dirty_generation"),
    sa.column("clean_generation"),
    sa.column("requested_generation"),
    sa.column("handled_generation"),
)
Timestamp = sa.DateTime().with_variant(mysql.DATETIME(fsp=6), "mysql")
counters = sa.table(COUNTERS, sa.column("name"), sa.column("value"))


def fire_before(next_run: datetime, expr: str, timezone: str) -> datetime:
    """The cron fire strictly before ``next_run`` (naive UTC in and out)."""
    tz = ZoneInfo(timezone)
    wall = next_run.replace(tzinfo=UTC).astimezone(tz).replace(tzinfo=None)
    prev = croniter(expr, wall - timedelta(microseconds=1)).get_prev(datetime)
    return prev.replace(tzinfo=tz, fold=0).astimezone(UTC).replace(tzinfo=None)


def _as_datetime(value: Any) -> datetime | None:
    if value is None or isinstance(value, datetime):
        return value
    return datetime.fromisoformat(str(value))


def _next_sequence(conn: sa.Connection) -> int:
    conn.execute(
        counters.update()
        .where(counters.c.name == "pending_sequence")
        .values(value=counters.c.value + 1)
    )
    return int(
        conn.execute(
            sa.select(counters.c.value).where(counters.c.name == "pending_sequence")
        ).scalar_one()
    )


def _mark(conn: sa.Connection, scope_id: str, *, request: bool) -> None:
    key = (intents.c.binding_name == BINDING) & (intents.c.scope_id == scope_id)
    row = conn.execute(
        sa.select(
            intents.c.dirty_generation,
            intents.c.clean_generation,
            intents.c.requested_generation,
            intents.c.handled_generation,
        ).where(key)
    ).first()
    if row is None:
        conn.execute(
            intents.insert().values(
                binding_name=BINDING,
                scope_id=scope_id,
                pending_sequence=_next_sequence(conn),
                dirty_generation=1,
                clean_generation=0,
                requested_generation=1 if request else 0,
                handled_generation=0,
            )
        )
        return
    d, c, r, h = (int(v) for v in row)
    values: dict[str, int] = {}
    if d <= c:
        values["dirty_generation"] = d + 1
    if request and r <= h:
        values["requested_generation"] = r + 1
    if values:
        conn.execute(intents.update().where(key).values(values))


def latest_started_fire(conn: sa.Connection, tables: set[str]) -> datetime | None:
    if APSCHEDULER not in tables:
        return None
    placeholders = ", ".join(f":j{i}" for i in range(len(JOB_IDS)))
    params = {f"j{i}": job for i, job in enumerate(JOB_IDS)}
    next_runs = [
        float(r[0])
        for r in conn.execute(
            sa.text(f"SELECT next_run_time FROM {APSCHEDULER} WHERE id IN ({placeholders})"),
            params,
        )
        if r[0] is not None
    ]
    if not next_runs:
        return None
    next_run = datetime.fromtimestamp(min(next_runs), UTC).replace(tzinfo=None)
    expr = os.environ.get(f"{ENV}PROFILE_CRON", DEFAULT_CRON).strip().strip('"')
    timezone = os.environ.get(f"{ENV}PROFILE_TIMEZONE", DEFAULT_TIMEZONE).strip().strip('"')
    return fire_before(next_run, expr, timezone)


def upgrade() -> None:
    if context.is_offline_mode():
        # A new database needs nothing here; mapping a job store needs the live database.
        op.execute(
            f"-- {revision}: no DDL; a database with an APScheduler job store: `apsup migrate`"
        )
        return
    conn = op.get_bind()
    tables = set(sa.inspect(conn).get_table_names())
    started = latest_started_fire(conn, tables)
    if "profile_cursors" in tables:
        rows = conn.execute(
            sa.text(
                "SELECT c.scope_id, c.source_head, c.source_through, c.last_fire, "
                "(SELECT p.enabled FROM profile_policies p WHERE p.scope_id = c.scope_id), "
                "(SELECT COUNT(*) FROM profile_candidates k WHERE k.scope_id = c.scope_id "
                " AND k.status = 'pending_review') "
                "FROM profile_cursors c WHERE c.source_head > c.source_through "
                "ORDER BY c.scope_id"
            )
        ).all()
        for scope_id, _head, _through, last_fire, enabled, waiting in rows:
            if (enabled is not None and not enabled) or int(waiting):
                continue  # Policy disabled, or a Candidate awaits Review
            unfinished = False
            if started is not None:
                last = _as_datetime(last_fire)
                behind = last is None or last < started
                produced = conn.execute(
                    sa.text(
                        "SELECT 1 FROM profile_candidates WHERE scope_id = :s AND cron_fire = :f"
                    ).bindparams(sa.bindparam("f", type_=Timestamp)),
                    {"s": scope_id, "f": started},
                ).first()
                unfinished = behind and produced is None
            _mark(conn, scope_id, request=unfinished)
    if APSCHEDULER in tables:
        placeholders = ", ".join(f":j{i}" for i in range(len(JOB_IDS)))
        conn.execute(
            sa.text(f"DELETE FROM {APSCHEDULER} WHERE id IN ({placeholders})"),
            {f"j{i}": job for i, job in enumerate(JOB_IDS)},
        )


def downgrade() -> None:
    pass
