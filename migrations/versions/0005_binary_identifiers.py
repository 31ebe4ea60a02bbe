"""Byte-exact Scope ids and binding names on MySQL/OceanBase.

Revision ID: apsup_0005
Revises: apsup_0001
Create Date: 2026-12-03

Databases created before this revision keep identifiers in the server's default text collation
(``utf8mb4_general_ci``), under which ``CaseX``, ``casex`` and ``"casex "`` are one key: two
Scopes silently became one row. This revision stores every identifier column of the framework,
the reference families and the legacy tables that apsup_0003/apsup_0004 map, whichever exist,
as ``VARBINARY`` (what apsup_0001 and apsup_0002 now create), which compares exact bytes.
``utf8mb4_bin`` is not enough: it still pads trailing spaces.

Rows that are equal under the old collation but differ in bytes cannot be told apart any more:
a request for ``casex`` advanced the generation of the row ``CaseX``, and the family's Cursor for
``CaseX`` covered Sources written for ``casex``. No automatic choice is right, so the revision
refuses (``ConfigError``, exit 2 from ``apsup migrate``), lists the colliding values with their
tables, and changes nothing: every check runs before the first ``ALTER`` (MySQL DDL commits
implicitly). The operator renames or merges those Scopes in the domain data and in the intents
table, then migrates again.

SQLite compares text byte for byte already (its default ``BINARY`` collation): nothing to do.
Downgrade keeps the binary columns (the older code reads them as well, as text).
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import op

from apsup.errors import ConfigError

revision = "apsup_0005"
down_revision = "apsup_0001"
branch_labels = None
depends_on = None

INTENTS = "pc_artifact_processing_intents"
#: Identifier columns per table: framework, reference families (0002), legacy (0003).
IDENTIFIERS: dict[str, tuple[str, ...]] = {
    INTENTS: ("binding_name", "scope_id"),
    "pc_artifact_processing_binding_states": ("binding_name",),
    "pc_artifact_processing_leases": ("supervisor_key",),
    "pc_artifact_processing_pending": ("binding_name", "scope_id"),
    "pc_artifact_processing_auto_wave_targets": ("binding_name", "scope_id"),
}
#: Reference family binding -> its domain tables keyed by scope_id.
FAMILY_TABLES: dict[str, tuple[str, ...]] = {
    "topic-memory": ("topic_sources", "topic_cursors", "topic_revisions", "topic_poison"),
    "experience": ("experience_items", "experience_progress", "experience_records"),
    "profile": (
        "profile_sources",
        "profile_cursors",
        "profile_policies",
        "profile_candidates",
        "profile_published",
        "profile_access",
    ),
    "handoff": ("handoff_requests", "handoff_reports", "handoff_access"),
}
for _tables in FAMILY_TABLES.values():
    for _table in _tables:
        IDENTIFIERS[_table] = ("scope_id",)
#: Tables whose binding_name column names the binding (intents first).
BINDING_TABLES = (
    INTENTS,
    "pc_artifact_processing_binding_states",
    "pc_artifact_processing_pending",
    "pc_artifact_processing_auto_wave_targets",
)
SHOWN = 20


def _to_convert(conn: Any) -> dict[str, list[tuple[str, int, bool]]]:
    """(column, characters, nullable) of the text identifier columns of each existing table;
    columns that are binary already are skipped. (information_schema: SQLAlchemy's reflection
    warns on OceanBase's table options.)"""
    rows = conn.execute(
        sa.text(
            "SELECT table_name, column_name, character_maximum_length, is_nullable "
            "FROM information_schema.columns WHERE table_schema = DATABASE() "
            "AND data_type IN ('varchar', 'char')"
        )
    ).all()
    out: dict[str, list[tuple[str, int, bool]]] = {}
    for table, column, length, nullable in rows:
        # lower_case_table_names=1 on OceanBase: names may come back in either case.
        table, column = str(table).lower(), str(column).lower()
        if column in IDENTIFIERS.get(table, ()):
            out.setdefault(table, []).append((column, int(length or 255), nullable == "YES"))
    return out


def _collisions(conn: Any, selects: list[str], params: dict[str, Any]) -> list[list[str]]:
    """Groups of values equal under the columns' (old) collation but different in bytes."""
    if not selects:
        return []
    union = " UNION ALL ".join(selects)
    rows = conn.execute(
        sa.text(
            f"SELECT GROUP_CONCAT(DISTINCT HEX(v)) FROM ({union}) u GROUP BY v "
            f"HAVING COUNT(DISTINCT CAST(v AS BINARY)) > 1 LIMIT {SHOWN}"
        ),
        params,
    ).all()
    groups = []
    for (hexes,) in rows:
        values = sorted(bytes.fromhex(h).decode("utf-8", "replace") for h in str(hexes).split(","))
        groups.append(values)
    return groups


def _check(conn: Any, text_tables: dict[str, list[tuple[str, int, bool]]]) -> list[str]:
    """Every identifier collision the old collation hid, as readable lines."""
    problems: list[str] = []

    def has(table: str, column: str) -> bool:
        return any(c[0] == column for c in text_tables.get(table, []))

    name_selects = [
        f"SELECT binding_name AS v FROM `{t}`" for t in BINDING_TABLES if has(t, "binding_name")
    ]
    for group in _collisions(conn, name_selects, {}):
        problems.append(f"binding names {group!r} (tables: {', '.join(BINDING_TABLES)})")

    bindings: set[str] = set(FAMILY_TABLES)
    for table in BINDING_TABLES:
        if has(table, "binding_name") or table in text_tables:
            for (name,) in conn.execute(sa.text(f"SELECT DISTINCT binding_name FROM `{table}`")):
                bindings.add(name.decode() if isinstance(name, bytes) else str(name))
    for binding in sorted(bindings):
        tables = [t for t in BINDING_TABLES if has(t, "scope_id")]
        selects = [f"SELECT scope_id AS v FROM `{t}` WHERE binding_name = :b" for t in tables]
        domain = [t for t in FAMILY_TABLES.get(binding, ()) if has(t, "scope_id")]
        selects += [f"SELECT scope_id AS v FROM `{t}`" for t in domain]
        for group in _collisions(conn, selects, {"b": binding}):
            problems.append(
                f"binding {binding!r}: Scope ids {group!r} (tables: {', '.join(tables + domain)})"
            )
    return problems


def upgrade() -> None:
    conn = op.get_bind()
    if conn.dialect.name != "mysql":
        return  # SQLite's default collation is byte-exact
    text_tables = _to_convert(conn)
    if not text_tables:
        return
    problems = _check(conn, text_tables)
    if problems:
        raise ConfigError(
            "revision 0005 (byte-exact identifiers) refused, nothing was changed: these "
            "identifiers differ only in letter case or trailing spaces, and the old "
            "case-insensitive collation has already merged their intents and progress: "
            + "; ".join(problems[:SHOWN])
            + ". Rename or merge them in the listed tables (the family's domain data decides "
            "which Scope is right), then run `apsup migrate` again"
        )
    for table, columns in text_tables.items():
        changes = ", ".join(
            f"MODIFY `{name}` VARBINARY({4 * length}) {'NULL' if nullable else 'NOT NULL'}"
            for name, length, nullable in columns
        )
        op.execute(f"ALTER TABLE `{table}` {changes}")


def downgrade() -> None:
    """Binary identifiers stay: converting back would merge distinct Scopes again."""
