"""``apsup.store.migrate`` builds exactly ``apsup.store.schema.metadata`` (DESIGN §3, RFC §3-4).

- Revision 0001 on an empty database equals the reference metadata (alembic's own comparison:
  tables, columns, types, nullability, server defaults, indexes, unique constraints); at head the
  framework tables are still exactly that (later revisions add only the families' domain tables).
- The two CHECK constraints are enforced by the database itself (SQLite: IntegrityError; seekdb /
  OceanBase 4.3 in MySQL mode: error 3819 "check constraint violated"), and the generated flag
  columns are stored.
- The never-reused pending_sequence counter row exists; migrating again is a no-op.
- SQLite db, -wal and -shm files are created 0600 even under umask 022.

Known-benign difference, MySQL mode only: SQLAlchemy's MySQL reflection parses SHOW CREATE TABLE
and does not understand OceanBase's index suffix (``KEY ... BLOCK_SIZE 16384 LOCAL``), so it
reflects no secondary index or unique key and alembic proposes to add them. Each such proposal
is checked against ``information_schema.statistics`` (same name, columns in order, uniqueness)
and only then discounted.
"""

from __future__ import annotations

import os
import stat
import warnings
from pathlib import Path
from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import Boolean, Index, UniqueConstraint, insert, select, text, update
from sqlalchemy.exc import DBAPIError, IntegrityError, OperationalError

from apsup.errors import IntentError
from apsup.migrations import FRAMEWORK_BRANCH, VERSION_TABLE
from apsup.store import intents, migrate, open_backend
from apsup.store.base import SqlBackend
from apsup.store.revision import branch_head, script_directory
from apsup.store.schema import PENDING_SEQUENCE_COUNTER, counters, metadata
from apsup.store.schema import intents as intents_table

pytestmark = pytest.mark.timeout(120)

FRAMEWORK_TABLES = set(metadata.tables)
#: Added by apsup_0007 (operator and failure state) and apsup_0008 (activity per minute),
#: absent at apsup_0001.
OPERATOR_TABLES = {
    "pc_artifact_processing_family_minutes",
    "pc_artifact_processing_scope_states",
    "pc_artifact_processing_family_controls",
    "pc_artifact_processing_replicas",
}
CHECK_VIOLATION = 3819  # MySQL 8 ER_CHECK_CONSTRAINT_VIOLATED, also raised by seekdb


def _statistics(conn: Any) -> dict[tuple[str, str], tuple[bool, list[str]]]:
    rows = conn.execute(
        text(
            "SELECT table_name, index_name, non_unique, column_name FROM "
            "information_schema.statistics WHERE table_schema = DATABASE() "
            "ORDER BY table_name, index_name, seq_in_index"
        )
    ).all()
    out: dict[tuple[str, str], tuple[bool, list[str]]] = {}
    for table, index, non_unique, column in rows:
        key = (str(table).lower(), str(index))
        out.setdefault(key, (not int(non_unique), []))[1].append(str(column))
    return out


def _benign(conn: Any, diff: Any) -> bool:
    """An index/unique key alembic missed only because reflection failed (MySQL mode)."""
    if conn.dialect.name != "mysql" or not isinstance(diff, tuple) or len(diff) != 2:
        return False
    kind, obj = diff
    stats = _statistics(conn)
    if kind == "add_index" and isinstance(obj, Index):
        columns = [c.name for c in obj.columns]
        return stats.get((obj.table.name, str(obj.name))) == (bool(obj.unique), columns)
    if kind == "add_constraint" and isinstance(obj, UniqueConstraint):
        columns = [c.name for c in obj.columns]
        return any(
            t == obj.table.name and name != "PRIMARY" and value == (True, columns)
            for (t, name), value in stats.items()
        )
    return False


def _same_boolean_default(conn: Any, diff: Any) -> bool:
    """A Boolean column's ``DEFAULT false`` reads back as ``'0'`` on MySQL (BOOL is a
    TINYINT(1)): the same default, not a difference."""
    if not (isinstance(diff, list) and len(diff) == 1 and diff[0][0] == "modify_default"):
        return False
    _, _, table, column, _, existing, wanted = diff[0]
    if not isinstance(metadata.tables[table].c[column].type, Boolean):
        return False
    seen = str(getattr(getattr(existing, "arg", None), "text", existing)).strip("'\"").lower()
    meant = str(getattr(wanted, "arg", wanted)).strip("'\"").lower()
    return seen in {"0", "false"} and meant in {"0", "false"}


def _schema_diffs(backend: SqlBackend, without: set[str] = frozenset()) -> list[Any]:  # type: ignore[assignment]
    def include_name(name: str | None, type_: str, parent: Any) -> bool:
        return type_ != "table" or (name in FRAMEWORK_TABLES and name not in without)

    with backend.engine.connect() as conn, warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Unknown schema content")
        ctx = MigrationContext.configure(
            conn,
            opts={
                "compare_type": True,
                "compare_server_default": True,
                "include_name": include_name,
            },
        )
        diffs = compare_metadata(ctx, metadata)
        real = [d for d in diffs if not _benign(conn, d) and not _same_boolean_default(conn, d)]
        if conn.dialect.name == "mysql":
            real += _unexpected_mysql_keys(conn)
    return real


def _unexpected_mysql_keys(conn: Any) -> list[str]:
    """Reflection cannot see extra keys on OceanBase either: compare the server's own list."""
    expected: dict[str, set[tuple[bool, tuple[str, ...]]]] = {}
    for table in metadata.tables.values():
        keys = expected.setdefault(table.name, set())
        keys |= {(bool(i.unique), tuple(c.name for c in i.columns)) for i in table.indexes}
        keys |= {
            (True, tuple(c.name for c in u.columns))
            for u in table.constraints
            if isinstance(u, UniqueConstraint)
        }
        keys |= {(True, (c.name,)) for c in table.columns if c.unique}
    return [
        f"unexpected key {name} {value} on {table}"
        for (table, name), (unique, columns) in _statistics(conn).items()
        if table in expected and name != "PRIMARY"
        for value in [(unique, tuple(columns))]
        if value not in expected[table]
    ]


def _revision(backend: SqlBackend) -> str | None:
    with backend.read() as conn:
        ctx = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE})
        return ctx.get_current_revision()


def _head() -> str:
    return branch_head(script_directory(), FRAMEWORK_BRANCH)


def test_revision_0001_creates_exactly_the_reference_schema(db_url: str) -> None:
    migrate(db_url, "apsup_0001")
    backend = open_backend(db_url)
    try:
        assert _revision(backend) == "apsup_0001"
        with backend.read() as conn:
            tables = {
                str(r[0]).lower()
                for r in conn.execute(
                    text("SELECT name FROM sqlite_master WHERE type = 'table'")
                    if backend.name == "sqlite"
                    else text(
                        "SELECT table_name FROM information_schema.tables "
                        "WHERE table_schema = DATABASE()"
                    )
                )
            }
        assert tables == (FRAMEWORK_TABLES - OPERATOR_TABLES) | {VERSION_TABLE}
        diffs = _schema_diffs(backend, OPERATOR_TABLES)
        assert [d for d in diffs if not _adds_operator_table(d)] == []
    finally:
        backend.dispose()


def _adds_operator_table(diff: Any) -> bool:
    """compare_metadata reports the metadata's tables missing at 0001 as ``add_table``."""
    ops = diff if isinstance(diff, list) else [diff]
    return all(
        (op[0] == "add_table" and op[1].name in OPERATOR_TABLES)
        or (op[0] == "add_index" and op[1].table.name in OPERATOR_TABLES)
        for op in ops
    )


def test_head_keeps_the_framework_tables_exact(backend: SqlBackend) -> None:
    assert _revision(backend) == _head()
    assert _schema_diffs(backend) == []


def test_generated_flags_are_stored_columns(backend: SqlBackend) -> None:
    with backend.read() as conn:
        if backend.name == "sqlite":
            hidden = {
                r[1]: r[6]
                for r in conn.exec_driver_sql(
                    "PRAGMA table_xinfo(pc_artifact_processing_intents)"
                ).all()
            }
            assert hidden["dirty_pending"] == hidden["request_pending"] == 3  # 3 = STORED
        else:
            extra = dict(
                conn.execute(
                    text(
                        "SELECT column_name, extra FROM information_schema.columns "
                        "WHERE table_schema = DATABASE() AND table_name = :t"
                    ),
                    {"t": "pc_artifact_processing_intents"},
                ).all()
            )
            assert extra["dirty_pending"] == extra["request_pending"] == "STORED GENERATED"


@pytest.mark.parametrize(
    ("assignments", "constraint"),
    [
        ({"clean_generation": 5}, "ck_intents_clean_le_dirty"),
        ({"clean_generation": -1}, "ck_intents_clean_le_dirty"),
        ({"handled_generation": 5}, "ck_intents_handled_le_requested"),
        ({"handled_generation": -1}, "ck_intents_handled_le_requested"),
        ({"dirty_generation": 0}, "ck_intents_clean_le_dirty"),  # lowering dirty below clean
        ({"requested_generation": 0}, "ck_intents_handled_le_requested"),
    ],
)
def test_check_constraints_are_enforced_by_the_database(
    backend: SqlBackend, assignments: dict[str, int], constraint: str
) -> None:
    with backend.transaction() as conn:
        intents.mark_dirty(conn, "b", "s")
        intents.mark_dirty(conn, "b", "s")
        intents.request(conn, "b", "s")
        row = intents.get(conn, "b", "s")
        assert row is not None
        intents.mark_clean(conn, "b", "s", 1, row.pending_sequence)
        intents.acknowledge(conn, "b", "s", 1, row.pending_sequence)
    with pytest.raises(DBAPIError) as caught, backend.transaction() as conn:
        conn.execute(update(intents_table).values(assignments))
    if backend.name == "sqlite":
        assert isinstance(caught.value, IntegrityError)
        assert constraint in str(caught.value.orig)
    else:
        assert isinstance(caught.value, OperationalError | IntegrityError)
        assert caught.value.orig.args[0] == CHECK_VIOLATION, caught.value.orig
    with backend.read() as conn:
        after = intents.get(conn, "b", "s")
    assert after == row.__class__(
        **{**row.__dict__, "clean_generation": 1, "handled_generation": 1}
    )


def test_store_guards_agree_with_the_constraints(backend: SqlBackend) -> None:
    """The store refuses the same states with IntentError before the database has to."""
    with backend.transaction() as conn:
        intents.mark_dirty(conn, "b", "s")
        intents.request(conn, "b", "s")
        seq = intents.get(conn, "b", "s").pending_sequence  # type: ignore[union-attr]
    with pytest.raises(IntentError, match="above dirty"), backend.transaction() as conn:
        intents.mark_clean(conn, "b", "s", 2, seq)
    with pytest.raises(IntentError, match="above requested"), backend.transaction() as conn:
        intents.acknowledge(conn, "b", "s", 2, seq)


def test_counter_row_exists_and_migrate_is_idempotent(backend: SqlBackend, db_url: str) -> None:
    with backend.read() as conn:
        assert conn.execute(select(counters.c.name, counters.c.value)).all() == [
            (PENDING_SEQUENCE_COUNTER, 0)
        ]
    with backend.transaction() as conn:
        intents.mark_dirty(conn, "b", "kept")
    migrate(db_url)
    migrate(db_url)
    assert _revision(backend) == _head()
    with backend.read() as conn:
        assert conn.execute(select(counters.c.value)).scalar_one() == 1  # not reset
        kept = intents.get(conn, "b", "kept")
    assert kept is not None and kept.dirty_generation == 1
    assert _schema_diffs(backend) == []
    # the counter row is the only one and its name is unique: no second counter was inserted
    with pytest.raises(IntegrityError), backend.transaction() as conn:
        conn.execute(insert(counters).values(name=PENDING_SEQUENCE_COUNTER, value=0))


@pytest.mark.backends("sqlite")
def test_sqlite_files_are_private(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'private.db'}"
    old = os.umask(0o022)
    try:
        migrate(url)
        backend = open_backend(url)
        try:
            with backend.transaction() as conn:  # keeps -wal and -shm in existence
                intents.mark_dirty(conn, "b", "s")
                files = {p.name: stat.S_IMODE(p.stat().st_mode) for p in tmp_path.iterdir()}
        finally:
            backend.dispose()
    finally:
        os.umask(old)
    assert {"private.db", "private.db-wal", "private.db-shm"} <= set(files), files
    assert {name: mode for name, mode in files.items() if mode != 0o600} == {}


@pytest.mark.backends("sqlite")
@pytest.mark.parametrize("mode", [0o644, 0o600])
def test_a_host_warns_about_an_existing_file_other_users_can_read(
    tmp_path: Path, mode: int, caplog: pytest.LogCaptureFixture
) -> None:
    from apsup.supervisor.launcher import build_host
    from tests.replicas import families

    path = tmp_path / "existing.db"
    url = f"sqlite:///{path}"
    migrate(url)
    path.chmod(mode)
    with caplog.at_level("WARNING", logger="apsup.launcher"):
        bundle = build_host(url, list(families.registry))
        bundle.close()
    warnings_ = [r for r in caplog.records if "other users" in r.getMessage()]
    assert stat.S_IMODE(path.stat().st_mode) == mode  # a deliberate setup is not changed
    if mode == 0o600:
        assert warnings_ == []
    else:
        assert len(warnings_) == 1
        assert warnings_[0].fix == f"chmod 600 {path}"  # type: ignore[attr-defined]
        assert warnings_[0].mode == "644"  # type: ignore[attr-defined]


def test_boolean_defaults_are_booleans_for_every_dialect() -> None:
    """``DEFAULT 0`` on a BOOLEAN column is refused by PostgreSQL ("default expression is of
    type integer"): the reference schema and the migrations say ``false``, which SQLite renders
    as 0 and MySQL stores as 0."""
    from pathlib import Path

    from sqlalchemy.dialects import postgresql
    from sqlalchemy.schema import CreateTable

    for table in metadata.tables.values():
        ddl = str(CreateTable(table).compile(dialect=postgresql.dialect()))
        for column in table.columns:
            if isinstance(column.type, Boolean) and column.server_default is not None:
                line = next(x for x in ddl.splitlines() if x.strip().startswith(column.name))
                assert "DEFAULT false" in line, (table.name, line)
    versions = Path(__file__).resolve().parents[1] / "migrations" / "versions"
    for path in versions.glob("*.py"):
        for line in path.read_text().splitlines():
            if "sa.Boolean" in line and "server_default" in line:
                assert "sa.false()" in line, (path.name, line)
