"""Migration 0002 creates exactly the domain tables the family modules declare (both backends)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import Table, inspect, text

from apsup.families import experience, handoff, profile, topic_memory
from apsup.registry import default_registry

# OceanBase's SHOW CREATE TABLE index options are not parsed by SQLAlchemy's reflection.
pytestmark = pytest.mark.filterwarnings("ignore:Unknown schema content")

MODULES = (topic_memory, experience, profile, handoff)
TABLES: list[Table] = [t for m in MODULES for t in m.TABLES]


def test_families_register_into_the_default_registry() -> None:
    expected = {
        "topic-memory": ("interval 300s", 4, 600.0),
        "experience": ("interval 900s", 2, 1800.0),
        "profile": ("cron '0 2 * * *' Asia/Shanghai", 4, 600.0),
        "handoff": ("disabled", 2, 600.0),
    }
    for name, (policy, workers, timeout) in expected.items():
        fam = default_registry.get(name)
        assert (fam.policy.describe(), fam.max_workers, fam.timeout) == (policy, workers, timeout)
        assert fam.entry_point.startswith(f"apsup.families.{name.replace('-', '_')}:")
    assert {"TOPIC_MEMORY", "EXPERIENCE", "PROFILE", "HANDOFF"} <= set(default_registry.by_prefix())


@pytest.fixture
def backend(db_url: str) -> Iterator[Any]:
    """The reference families' tables exist only when asked for."""
    from apsup.store import migrate, open_backend

    migrate(db_url, reference_families=True)
    store = open_backend(db_url)
    yield store
    store.dispose()


def test_apsup_migrations_lists_every_family_table() -> None:
    """``apsup.migrations.include_name`` hides exactly the reference families' tables."""
    from apsup.migrations import FAMILY_TABLES, include_name

    assert {t.name for t in TABLES} == FAMILY_TABLES
    assert not any(include_name(name, "table") for name in FAMILY_TABLES)
    assert include_name("profile_settings_of_my_app", "table")


def test_migrated_tables_match_modules(backend: Any) -> None:
    for table in TABLES:
        check_table(backend, table)


def check_table(backend: Any, table: Table) -> None:
    with backend.read() as conn:
        insp = inspect(conn)
        columns = {c["name"]: c for c in insp.get_columns(table.name)}
        pk = insp.get_pk_constraint(table.name)["constrained_columns"]
        uniques = {tuple(u["column_names"]) for u in insp.get_unique_constraints(table.name)}
        uniques |= {
            tuple(i["column_names"]) for i in insp.get_indexes(table.name) if i.get("unique")
        }
        if conn.dialect.name == "mysql":  # OceanBase index options defeat SHOW CREATE parsing
            rows = conn.execute(
                text(
                    "SELECT index_name, column_name FROM information_schema.statistics "
                    "WHERE table_schema = DATABASE() AND table_name = :t AND non_unique = 0 "
                    "AND index_name <> 'PRIMARY' ORDER BY index_name, seq_in_index"
                ),
                {"t": table.name},
            ).all()
            by_index: dict[str, list[str]] = {}
            for index, column in rows:
                by_index.setdefault(index, []).append(column)
            uniques |= {tuple(cols) for cols in by_index.values()}
    assert set(columns) == {c.name for c in table.columns}
    assert pk == [c.name for c in table.primary_key.columns]
    for col in table.columns:
        assert bool(columns[col.name]["nullable"]) == bool(col.nullable and not col.primary_key), (
            col.name
        )
    for constraint in table.constraints:
        names = tuple(c.name for c in getattr(constraint, "columns", []))
        if type(constraint).__name__ == "UniqueConstraint":
            assert names in uniques
