"""Operator state beside the RFC's tables: per-Scope failure and operator state, per-family
controls, replica membership.

``pc_artifact_processing_scope_states`` holds, for a Scope that failed or that an operator acted
on: its consecutive failures, the last error's type and redacted message, when it failed and
when it is next attempted, whether it is parked, and the operator's pending retry/stop requests.
``pc_artifact_processing_family_controls`` holds a family's pause flag and a version that every
operator action on the family advances, so each leader notices an action with one small read.
``pc_artifact_processing_replicas`` has one row per running host process (its holder id), with
where it runs, its role and mode, its HTTP listener and when it was last seen in database time,
so that operators and ``apsup status`` see every replica and find their listeners.
The RFC's own tables keep exactly their columns.

Revision ID: apsup_0007
Revises: apsup_0005
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mysql

revision = "apsup_0007"
down_revision = "apsup_0005"
branch_labels = None
depends_on = None

Timestamp = sa.DateTime().with_variant(mysql.DATETIME(fsp=6), "mysql")


def _identifier(length: int) -> sa.types.TypeEngine[str]:
    """Byte-exact identifier text (``apsup.store.schema.Identifier``; frozen here)."""
    return sa.String(length).with_variant(mysql.VARBINARY(4 * length), "mysql")


def upgrade() -> None:
    op.create_table(
        "pc_artifact_processing_scope_states",
        sa.Column("binding_name", _identifier(128), primary_key=True),
        sa.Column("scope_id", _identifier(255), primary_key=True),
        sa.Column(
            "consecutive_failures", sa.BigInteger, nullable=False, server_default=sa.text("0")
        ),
        sa.Column("last_error_type", sa.String(200), nullable=True),
        sa.Column("last_error", sa.String(400), nullable=True),
        sa.Column("last_failure_at", Timestamp, nullable=True),
        sa.Column("next_attempt_at", Timestamp, nullable=True),
        sa.Column("parked", sa.Boolean, nullable=False, server_default=sa.false()),
        sa.Column("parked_at", Timestamp, nullable=True),
        sa.Column("retry_requested", sa.Boolean, nullable=False, server_default=sa.false()),
        sa.Column("stop_requested", sa.Boolean, nullable=False, server_default=sa.false()),
    )
    op.create_index(
        "ix_scope_states_failing",
        "pc_artifact_processing_scope_states",
        ["binding_name", "consecutive_failures"],
    )
    op.create_table(
        "pc_artifact_processing_family_controls",
        sa.Column("binding_name", _identifier(128), primary_key=True),
        sa.Column("paused", sa.Boolean, nullable=False, server_default=sa.false()),
        sa.Column("paused_at", Timestamp, nullable=True),
        sa.Column("control_version", sa.BigInteger, nullable=False, server_default=sa.text("0")),
    )
    op.create_table(
        "pc_artifact_processing_replicas",
        sa.Column("holder_id", sa.String(64), primary_key=True),
        sa.Column("replica_id", sa.String(64), nullable=False),
        sa.Column("host_name", sa.String(255), nullable=False),
        sa.Column("pid", sa.Integer, nullable=False),
        sa.Column("version", sa.String(64), nullable=False),
        sa.Column("role", sa.String(16), nullable=False),
        sa.Column("mode", sa.String(16), nullable=False),
        sa.Column("http_address", sa.String(300), nullable=True),
        sa.Column("started_at", Timestamp, nullable=False),
        sa.Column("last_seen", Timestamp, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("pc_artifact_processing_replicas")
    op.drop_table("pc_artifact_processing_family_controls")
    op.drop_index("ix_scope_states_failing", table_name="pc_artifact_processing_scope_states")
    op.drop_table("pc_artifact_processing_scope_states")
