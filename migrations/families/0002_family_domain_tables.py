"""Domain tables of the reference families (topic-memory, experience, profile, handoff).

Revision ID: apsup_0002
Revises: - (a separate branch, `apsup_families`; depends on apsup_0001)
Create Date: 2026-12-03

The shapes are frozen here (a migration never imports application code); ``tests/
test_migration_family_tables.py`` checks them against the Tables in ``apsup.families.*``.

A table that already exists is left untouched: deployments of the earlier Topic Memory (PR
#1490) and of the APScheduler-driven Profile already hold ``topic_*`` and ``profile_*`` tables of
these shapes, with their Cursors and journals, and a migration must not recreate them
(``0003`` and ``0004`` then map their scheduling state).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context, op
from sqlalchemy.dialects import mysql

revision = "apsup_0002"
down_revision = None
branch_labels = ("apsup_families",)
depends_on = "apsup_0001"

Timestamp = sa.DateTime().with_variant(mysql.DATETIME(fsp=6), "mysql")
SCOPE = 255
DIGEST = 64
PRINCIPAL = 128
ZERO = sa.text("0")


def _scope(name: str = "scope_id", *, primary_key: bool = True) -> sa.Column:
    # Byte-exact on MySQL (VARBINARY): its text collations fold case or pad trailing spaces.
    kind = sa.String(SCOPE).with_variant(mysql.VARBINARY(4 * SCOPE), "mysql")
    return sa.Column(name, kind, primary_key=primary_key, nullable=False)


def _principal(*, primary_key: bool = False, nullable: bool = False) -> sa.Column:
    # Byte-exact on MySQL, like Scope ids: an access grant names exactly one principal.
    kind = sa.String(PRINCIPAL).with_variant(mysql.VARBINARY(4 * PRINCIPAL), "mysql")
    return sa.Column("principal", kind, primary_key=primary_key, nullable=nullable)


def _big(name: str, *, primary_key: bool = False, default: bool = False) -> sa.Column:
    if primary_key:
        return sa.Column(name, sa.BigInteger, primary_key=True, autoincrement=False)
    if default:
        return sa.Column(name, sa.BigInteger, nullable=False, server_default=ZERO)
    return sa.Column(name, sa.BigInteger, nullable=False)


def tables() -> dict[str, list[sa.SchemaItem]]:
    """Every domain table of revision 0002, in creation order."""
    return {
        # topic-memory
        "topic_sources": [
            _scope(),
            _big("position", primary_key=True),
            sa.Column("body", sa.Text, nullable=False),
        ],
        "topic_cursors": [
            _scope(),
            _big("source_head", default=True),
            _big("source_through", default=True),
            _big("head_revision", default=True),
            _big("supervisor_generation", default=True),
        ],
        "topic_revisions": [
            _scope(),
            _big("revision", primary_key=True),
            _big("source_from"),
            _big("source_through"),
            sa.Column("summary", sa.String(DIGEST), nullable=False),
            _big("supervisor_generation"),
        ],
        "topic_poison": [_scope(), _big("position", primary_key=True)],
        # experience
        "experience_items": [
            _scope(),
            _big("position", primary_key=True),
            sa.Column("payload", sa.Text, nullable=False),
        ],
        "experience_progress": [
            _scope(),
            _big("item_head", default=True),
            _big("consumed_through", default=True),
            _big("batch_count", default=True),
            _big("supervisor_generation", default=True),
        ],
        "experience_records": [
            _scope(),
            _big("batch_no", primary_key=True),
            _big("item_from"),
            _big("item_through"),
            sa.Column("digest", sa.String(DIGEST), nullable=False),
            _big("supervisor_generation"),
        ],
        # profile
        "profile_sources": [
            _scope(),
            _big("position", primary_key=True),
            sa.Column("body", sa.Text, nullable=False),
        ],
        "profile_cursors": [
            _scope(),
            _big("source_head", default=True),
            _big("source_through", default=True),
            sa.Column("last_fire", Timestamp, nullable=True),
            _big("supervisor_generation", default=True),
        ],
        "profile_policies": [
            _scope(),
            sa.Column("enabled", sa.Boolean, nullable=False, server_default=sa.true()),
        ],
        "profile_candidates": [
            sa.Column("candidate_id", sa.String(DIGEST), primary_key=True),
            _scope(primary_key=False),
            sa.Column("cron_fire", Timestamp, nullable=False),
            sa.Column("status", sa.String(32), nullable=False),
            _big("source_from"),
            _big("source_through"),
            sa.Column("content", sa.String(DIGEST), nullable=False),
            _big("supervisor_generation"),
            sa.Column("created_at", Timestamp, nullable=False),
            sa.Column("reviewed_at", Timestamp, nullable=True),
            sa.UniqueConstraint("scope_id", "cron_fire", name="uq_profile_candidates_fire"),
        ],
        "profile_published": [
            _scope(),
            _big("version"),
            sa.Column("candidate_id", sa.String(DIGEST), nullable=False),
            sa.Column("content", sa.String(DIGEST), nullable=False),
            sa.Column("published_at", Timestamp, nullable=False),
        ],
        "profile_access": [_scope(), sa.Column("allowed", sa.Boolean, nullable=False)],
        # handoff
        "handoff_requests": [
            _scope(),
            _big("request_generation", primary_key=True),
            sa.Column("payload_ref", sa.String(512), nullable=False),
            _principal(nullable=True),
            sa.Column("requested_at", Timestamp, nullable=False),
        ],
        "handoff_reports": [
            _scope(),
            _big("request_generation", primary_key=True),
            sa.Column("payload_ref", sa.String(512), nullable=False),
            sa.Column("report", sa.String(DIGEST), nullable=False),
            _big("supervisor_generation"),
            sa.Column("created_at", Timestamp, nullable=False),
        ],
        "handoff_access": [
            _scope(),
            _principal(primary_key=True),
            sa.Column("allowed", sa.Boolean, nullable=False),
        ],
    }


def upgrade() -> None:
    # Offline (`apsup migrate --sql`) the DDL is for a new database: every table is created.
    existing = (
        set() if context.is_offline_mode() else set(sa.inspect(op.get_bind()).get_table_names())
    )
    for name, items in tables().items():
        if name in existing:
            continue  # shipped by a pre-Supervisor deployment: keep it and its data
        op.create_table(name, *items)


def downgrade() -> None:
    existing = set(sa.inspect(op.get_bind()).get_table_names())
    for name in reversed(list(tables())):
        if name in existing:
            op.drop_table(name)
