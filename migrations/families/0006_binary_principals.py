"""Byte-exact principals in the Handoff family's access list on MySQL/OceanBase.

Revision ID: apsup_0006
Revises: apsup_0004
Create Date: 2026-12-03

``handoff_access`` decides who may request a Handoff of a Scope, keyed by ``principal``. Created
as text in the server's default collation (``utf8mb4_general_ci``), a grant to ``Alice`` also let
``alice`` and ``"alice "`` in, and a denial of one spelling denied the others. This revision
stores ``principal`` of ``handoff_access`` and ``handoff_requests`` as ``VARBINARY`` (what
apsup_0002 now creates), so a grant names exactly one principal.

The old primary key ``(scope_id, principal)`` already kept spellings that compare equal from
both being stored, so the conversion cannot meet a conflict: every row keeps the bytes it was
written with, and from now on matches only those.

SQLite compares text byte for byte already: nothing to do. Downgrade keeps the binary columns.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import context, op

revision = "apsup_0006"
down_revision = "apsup_0004"
branch_labels = None
depends_on = None

PRINCIPAL = 128
TABLES = ("handoff_access", "handoff_requests")


def _text_columns(conn: Any) -> dict[str, bool]:
    """Table -> nullable, for each of TABLES whose ``principal`` column is still text."""
    rows = conn.execute(
        sa.text(
            "SELECT table_name, is_nullable FROM information_schema.columns "
            "WHERE table_schema = DATABASE() AND column_name = 'principal' "
            "AND data_type IN ('varchar', 'char')"
        )
    ).all()
    # lower_case_table_names=1 on OceanBase: names may come back in either case.
    found = {str(table).lower(): nullable == "YES" for table, nullable in rows}
    return {table: found[table] for table in TABLES if table in found}


def upgrade() -> None:
    if context.is_offline_mode():
        return  # `--sql` prints DDL for a new database: apsup_0002 creates binary columns already
    conn = op.get_bind()
    if conn.dialect.name != "mysql":
        return  # SQLite's default collation is byte-exact
    text_tables = _text_columns(conn)
    if not text_tables:
        return
    for table, nullable in text_tables.items():
        null = "NULL" if nullable else "NOT NULL"
        op.execute(f"ALTER TABLE `{table}` MODIFY `principal` VARBINARY({4 * PRINCIPAL}) {null}")


def downgrade() -> None:
    """Binary principals stay: converting back would merge distinct principals again."""
