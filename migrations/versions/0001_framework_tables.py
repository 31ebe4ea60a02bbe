"""Framework tables: intents, counters, binding states, leases.

Revision ID: apsup_0001
Revises:
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context, op
from sqlalchemy.dialects import mysql

revision = "apsup_0001"
down_revision = None
branch_labels = ("apsup",)
depends_on = None

Timestamp = sa.DateTime().with_variant(mysql.DATETIME(fsp=6), "mysql")


def _identifier(length: int) -> sa.types.TypeEngine[str]:
    """Byte-exact identifier text: VARBINARY on MySQL, whose text collations fold case or pad
    trailing spaces (``apsup.store.schema.Identifier``; frozen here, not imported)."""
    return sa.String(length).with_variant(mysql.VARBINARY(4 * length), "mysql")


def upgrade() -> None:
    op.create_table(
        "pc_artifact_processing_intents",
        sa.Column("binding_name", _identifier(128), primary_key=True),
        sa.Column("scope_id", _identifier(255), primary_key=True),
        sa.Column("pending_sequence", sa.BigInteger, nullable=False),
        sa.Column("dirty_generation", sa.BigInteger, nullable=False, server_default=sa.text("0")),
        sa.Column("clean_generation", sa.BigInteger, nullable=False, server_default=sa.text("0")),
        sa.Column(
            "requested_generation", sa.BigInteger, nullable=False, server_default=sa.text("0")
        ),
        sa.Column("handled_generation", sa.BigInteger, nullable=False, server_default=sa.text("0")),
        sa.Column(
            "last_auto_scan_generation", sa.BigInteger, nullable=False, server_default=sa.text("0")
        ),
        sa.Column(
            "dirty_pending",
            sa.Integer,
            sa.Computed(
                "CASE WHEN dirty_generation > clean_generation THEN 1 ELSE 0 END", persisted=True
            ),
        ),
        sa.Column(
            "request_pending",
            sa.Integer,
            sa.Computed(
                "CASE WHEN requested_generation > handled_generation THEN 1 ELSE 0 END",
                persisted=True,
            ),
        ),
        sa.UniqueConstraint("pending_sequence"),
        sa.CheckConstraint(
            "clean_generation >= 0 AND clean_generation <= dirty_generation",
            name="ck_intents_clean_le_dirty",
        ),
        sa.CheckConstraint(
            "handled_generation >= 0 AND handled_generation <= requested_generation",
            name="ck_intents_handled_le_requested",
        ),
    )
    op.create_index(
        "ix_intents_dirty",
        "pc_artifact_processing_intents",
        ["binding_name", "dirty_pending", "pending_sequence"],
    )
    op.create_index(
        "ix_intents_request",
        "pc_artifact_processing_intents",
        ["binding_name", "request_pending", "pending_sequence"],
    )
    counters = op.create_table(
        "pc_artifact_processing_counters",
        sa.Column("name", sa.String(64), primary_key=True),
        sa.Column("value", sa.BigInteger, nullable=False, server_default=sa.text("0")),
    )
    op.bulk_insert(counters, [{"name": "pending_sequence", "value": 0}])
    # A PR #1490 deployment already has this table (with last_auto_wave_completed_at); it
    # evolves in place in 0003 instead of being recreated (RFC §4, §11).
    offline = context.is_offline_mode()  # `apsup migrate --sql`: DDL for a new database
    if not offline and sa.inspect(op.get_bind()).has_table("pc_artifact_processing_binding_states"):
        _create_leases()
        return
    op.create_table(
        "pc_artifact_processing_binding_states",
        sa.Column("binding_name", _identifier(128), primary_key=True),
        sa.Column("last_schedule_checkpoint_at", Timestamp, nullable=True),
        sa.Column("scan_generation", sa.BigInteger, nullable=False, server_default=sa.text("0")),
        sa.Column("scan_in_progress", sa.Boolean, nullable=False, server_default=sa.false()),
        sa.Column("scan_upper_pending_sequence", sa.BigInteger, nullable=True),
    )
    _create_leases()


def _create_leases() -> None:
    op.create_table(
        "pc_artifact_processing_leases",
        sa.Column("supervisor_key", _identifier(160), primary_key=True),
        sa.Column("holder_id", sa.String(64), nullable=False),
        sa.Column(
            "supervisor_generation", sa.BigInteger, nullable=False, server_default=sa.text("0")
        ),
        sa.Column("expires_at", Timestamp, nullable=True),
    )


def downgrade() -> None:
    op.drop_table("pc_artifact_processing_leases")
    op.drop_table("pc_artifact_processing_binding_states")
    op.drop_table("pc_artifact_processing_counters")
    op.drop_index("ix_intents_request", "pc_artifact_processing_intents")
    op.drop_index("ix_intents_dirty", "pc_artifact_processing_intents")
    op.drop_table("pc_artifact_processing_intents")
