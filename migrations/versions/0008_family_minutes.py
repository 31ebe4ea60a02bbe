"""Invocations per family and minute, beside the RFC's tables.

``pc_artifact_processing_family_minutes`` holds, per binding and minute since the epoch (in
database time), how many invocations succeeded and failed. Each leader adds what its Workers
did, so the console's chart of the last hour is the same on every replica and survives a
takeover. Rows older than two hours are deleted by the leaders that write them.

Revision ID: apsup_0008
Revises: apsup_0007
Create Date: 2026-12-07
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mysql

revision = "apsup_0008"
down_revision = "apsup_0007"
branch_labels = None
depends_on = None


def _identifier(length: int) -> sa.types.TypeEngine[str]:
    """Byte-exact identifier text (``apsup.store.schema.Identifier``; frozen here)."""
    return sa.String(length).with_variant(mysql.VARBINARY(4 * length), "mysql")


def upgrade() -> None:
    op.create_table(
        "pc_artifact_processing_family_minutes",
        sa.Column("binding_name", _identifier(128), primary_key=True),
        sa.Column("minute", sa.BigInteger, primary_key=True),
        sa.Column("succeeded", sa.BigInteger, nullable=False, server_default=sa.text("0")),
        sa.Column("failed", sa.BigInteger, nullable=False, server_default=sa.text("0")),
    )


def downgrade() -> None:
    op.drop_table("pc_artifact_processing_family_minutes")
