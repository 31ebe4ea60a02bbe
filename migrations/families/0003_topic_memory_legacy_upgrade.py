"""Move an earlier Topic Memory deployment (its own scheduler tables) onto the Supervisor.

Revision ID: apsup_0003
Revises: apsup_0002
Create Date: 2026-12-03

Run during maintenance shutdown (old Supervisor and Workers stopped, writes paused). On a
database without the legacy tables it does nothing.

Legacy schema (Topic Memory PR #1490), as this migration reads it
-----------------------------------------------------------------

``pc_artifact_processing_pending``: one Topic pending record per Scope::

    binding_name                VARCHAR(128) NOT NULL  -- PK; Topic's binding, "topic-memory"
    scope_id                    VARCHAR(255) NOT NULL  -- PK
    source_through              BIGINT       NOT NULL  -- Source position the work must cover
    flush_requested_generation  BIGINT       NOT NULL DEFAULT 0
    flush_handled_generation    BIGINT       NOT NULL DEFAULT 0
    updated_at                  DATETIME(6)  NULL

``pc_artifact_processing_binding_states``: one row per binding::

    binding_name                VARCHAR(128) NOT NULL  -- PK
    last_auto_wave_completed_at DATETIME(6)  NULL      -- end of the last completed wave

``pc_artifact_processing_auto_wave_targets``: the Scopes frozen into an automatic wave::

    binding_name  VARCHAR(128) NOT NULL  -- PK
    wave_id       VARCHAR(64)  NOT NULL  -- PK
    scope_id      VARCHAR(255) NOT NULL  -- PK
    status        VARCHAR(16)  NOT NULL  -- 'started' | 'done'

Topic domain tables (owned by the Topic processor; the Cursor is business progress)::

    topic_sources(scope_id, position, body)                        -- the ordered journal
    topic_cursors(scope_id, source_through, head_revision)         -- the Cursor
    topic_revisions(scope_id, revision, source_from, source_through, summary)

Mapping
-------

- Topic tables evolve in place: ``topic_cursors`` gains ``source_head`` (backfilled from the
  journal) and ``supervisor_generation``; ``topic_revisions`` gains ``supervisor_generation``
  (0 = written before the Supervisor). ``source_through`` and ``head_revision`` are untouched;
  a Scope with Sources but no Cursor row gets one at 0 (nothing covered, as before).
- ``pc_artifact_processing_binding_states`` gains the RFC §4 columns if 0001 did not add them.
- Uncovered Sources (journal or Pending ``source_through`` beyond the Cursor) -> ordinary dirty
  state (``dirty_generation = 1``).
- Unacknowledged flushes (requested > handled) -> accepted requests. The flush generation
  counters are carried over as ``requested/handled_generation`` so no generation is reused.
- Wave targets not proven ``done`` (``started`` or anything else) -> an accepted request with
  recovery responsibility (requested > handled); the Topic processor's Cursor deduplicates.
- ``last_auto_wave_completed_at`` -> ``last_schedule_checkpoint_at`` only when the binding has no
  unfinished wave target, preserving the remaining wait; otherwise the checkpoint stays NULL
  (an immediate check) and the intents above carry the work.
- Every legacy binding must be mapped explicitly (``BINDINGS``); an unknown one aborts.
- Nothing legacy is dropped: Topic Pending stays Topic's (no other family writes it) and the
  wave table and old column remain until a later revision retires them after the operator has
  validated consistency between intents, Pending, check state and Cursors.

Downgrade is a no-op: the mapped intents are valid scheduling state for the older code too.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import context, op
from sqlalchemy.dialects import mysql

revision = "apsup_0003"
down_revision = "apsup_0002"
branch_labels = None
depends_on = None

#: Legacy binding name -> binding of the registered Family (Topic keeps its name, RFC §11).
BINDINGS = {"topic-memory": "topic-memory"}
TOPIC = "topic-memory"

PENDING = "pc_artifact_processing_pending"
STATES = "pc_artifact_processing_binding_states"
WAVES = "pc_artifact_processing_auto_wave_targets"
INTENTS = "pc_artifact_processing_intents"
COUNTERS = "pc_artifact_processing_counters"

Timestamp = sa.DateTime().with_variant(mysql.DATETIME(fsp=6), "mysql")

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
counters = sa.table(COUNTERS, sa.column("name"), sa.column("value"))


def _columns(insp: Any, table: str) -> set[str]:
    return {c["name"] for c in insp.get_columns(table)}


def _add_missing(insp: Any, table: str, columns: list[sa.Column]) -> None:
    present = _columns(insp, table)
    for column in columns:
        if column.name not in present:
            op.add_column(table, column)


def evolve_binding_states(insp: Any) -> None:
    """RFC §4: the table evolves from Topic's binding state and keeps its primary key."""
    _add_missing(
        insp,
        STATES,
        [
            sa.Column("last_schedule_checkpoint_at", Timestamp, nullable=True),
            sa.Column("scan_generation", sa.BigInteger, nullable=False, server_default="0"),
            sa.Column("scan_in_progress", sa.Boolean, nullable=False, server_default=sa.false()),
            sa.Column("scan_upper_pending_sequence", sa.BigInteger, nullable=True),
        ],
    )


def evolve_topic_tables(conn: sa.Connection, insp: Any, tables: set[str]) -> None:
    zero = sa.text("0")
    if "topic_cursors" in tables:
        added = "source_head" not in _columns(insp, "topic_cursors")
        _add_missing(
            insp,
            "topic_cursors",
            [
                sa.Column("source_head", sa.BigInteger, nullable=False, server_default=zero),
                sa.Column(
                    "supervisor_generation", sa.BigInteger, nullable=False, server_default=zero
                ),
            ],
        )
        if added and "topic_sources" in tables:
            conn.execute(
                sa.text(
                    "UPDATE topic_cursors SET source_head = COALESCE((SELECT MAX(s.position) "
                    "FROM topic_sources s WHERE s.scope_id = topic_cursors.scope_id), 0)"
                )
            )
        if "topic_sources" in tables:
            conn.execute(
                sa.text(
                    "INSERT INTO topic_cursors (scope_id, source_head, source_through, "
                    "head_revision, supervisor_generation) "
                    "SELECT s.scope_id, MAX(s.position), 0, 0, 0 FROM topic_sources s "
                    "WHERE NOT EXISTS (SELECT 1 FROM topic_cursors c WHERE c.scope_id = s.scope_id)"
                    " GROUP BY s.scope_id"
                )
            )
    if "topic_revisions" in tables:
        _add_missing(
            insp,
            "topic_revisions",
            [
                sa.Column(
                    "supervisor_generation", sa.BigInteger, nullable=False, server_default=zero
                )
            ],
        )


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


def upsert_intent(
    conn: sa.Connection, binding: str, scope_id: str, *, dirty: bool, requested: int, handled: int
) -> None:
    """Create or merge the intent row: dirty -> dirty > clean; requested/handled carried over
    (never lowered; an existing pending request is reused)."""
    key = (intents.c.binding_name == binding) & (intents.c.scope_id == scope_id)
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
                binding_name=binding,
                scope_id=scope_id,
                pending_sequence=_next_sequence(conn),
                dirty_generation=1 if dirty else 0,
                clean_generation=0,
                requested_generation=requested,
                handled_generation=handled,
            )
        )
        return
    d, c, r, h = (int(v) for v in row)
    values: dict[str, int] = {}
    if dirty and d <= c:
        values["dirty_generation"] = d + 1
    if requested > handled and r <= h:
        values["handled_generation"] = max(h, handled)
        values["requested_generation"] = max(r, requested, values["handled_generation"] + 1)
    if values:
        conn.execute(intents.update().where(key).values(values))


def upgrade() -> None:
    if context.is_offline_mode():
        # A new database needs nothing here; mapping legacy tables needs the live database.
        op.execute(
            f"-- {revision}: no DDL; a database with legacy Topic Memory tables: `apsup migrate`"
        )
        return
    conn = op.get_bind()
    insp = sa.inspect(conn)
    tables = set(insp.get_table_names())
    if STATES in tables:
        evolve_binding_states(insp)
    evolve_topic_tables(conn, insp, tables)
    legacy_states = STATES in tables and "last_auto_wave_completed_at" in _columns(insp, STATES)
    if PENDING not in tables and WAVES not in tables and not legacy_states:
        return  # a fresh database: nothing to map

    # Every legacy binding must be mapped explicitly.
    seen: set[str] = set()
    for table in (PENDING, WAVES):
        if table in tables:
            seen.update(
                _str(r[0])
                for r in conn.execute(sa.text(f"SELECT DISTINCT binding_name FROM {table}"))
            )
    if legacy_states:
        seen.update(
            _str(r[0])
            for r in conn.execute(
                sa.text(
                    f"SELECT binding_name FROM {STATES} "
                    "WHERE last_auto_wave_completed_at IS NOT NULL"
                )
            )
        )
    unknown = sorted(seen - set(BINDINGS))
    if unknown:
        raise RuntimeError(
            f"legacy artifact-processing bindings {unknown} have no Family mapping; add them to "
            "BINDINGS in migration 0003 (or retire their rows) before upgrading"
        )

    # Per Scope: (uncovered, flush requested, flush handled, unfinished wave).
    facts: dict[tuple[str, str], list[Any]] = {}

    def fact(binding: str, scope: str) -> list[Any]:
        return facts.setdefault((BINDINGS[binding], scope), [False, 0, 0, False])

    cursors: dict[str, int] = {}
    if "topic_cursors" in tables:
        cursors = {
            _str(r[0]): int(r[1])
            for r in conn.execute(sa.text("SELECT scope_id, source_through FROM topic_cursors"))
        }
    if "topic_sources" in tables:
        for scope, head in conn.execute(
            sa.text("SELECT scope_id, MAX(position) FROM topic_sources GROUP BY scope_id")
        ):
            scope = _str(scope)
            if int(head) > cursors.get(scope, 0):
                fact(TOPIC, scope)[0] = True
    if PENDING in tables:
        for binding, scope, through, req, handled in conn.execute(
            sa.text(
                f"SELECT binding_name, scope_id, source_through, flush_requested_generation, "
                f"flush_handled_generation FROM {PENDING}"
            )
        ):
            binding, scope = _str(binding), _str(scope)
            f = fact(binding, scope)
            if int(through) > cursors.get(scope, 0):
                f[0] = True
            f[1], f[2] = int(req or 0), min(int(handled or 0), int(req or 0))
    unfinished_bindings: set[str] = set()
    if WAVES in tables:
        for binding, scope in conn.execute(
            sa.text(
                f"SELECT DISTINCT binding_name, scope_id FROM {WAVES} "
                "WHERE status IS NULL OR status <> 'done'"
            )
        ):
            binding, scope = _str(binding), _str(scope)
            fact(binding, scope)[3] = True
            unfinished_bindings.add(BINDINGS[binding])

    for (binding, scope), (uncovered, req, handled, wave) in sorted(facts.items()):
        if wave and req <= handled:
            req = handled + 1  # recovery responsibility for the started wave target
        if not uncovered and req <= handled:
            continue  # covered and acknowledged: no scheduling state needed
        upsert_intent(conn, binding, scope, dirty=uncovered, requested=req, handled=handled)

    if legacy_states:
        for binding, completed in conn.execute(
            sa.text(
                f"SELECT binding_name, last_auto_wave_completed_at FROM {STATES} "
                "WHERE last_auto_wave_completed_at IS NOT NULL "
                "AND last_schedule_checkpoint_at IS NULL"
            )
        ).all():
            binding = _str(binding)
            if BINDINGS[binding] in unfinished_bindings:
                continue  # completion not proven: keep the intent, check immediately
            conn.execute(
                sa.text(
                    f"UPDATE {STATES} SET last_schedule_checkpoint_at = :at WHERE binding_name = :b"
                ),
                {"at": completed, "b": binding},  # the row keeps its primary key
            )


def _str(value: Any) -> str:
    """Identifier columns are VARBINARY on MySQL (byte-exact): raw SQL reads them as bytes."""
    return value.decode("utf-8") if isinstance(value, bytes | bytearray) else str(value)


def downgrade() -> None:
    pass
