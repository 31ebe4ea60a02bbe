"""apsup's migrations live beside the application's own (both backends).

- apsup records its revisions (``apsup_0001``..) in ``apsup_alembic_version``; an application's
  own history (with its own ``alembic_version``, even with bare ids ``0001``/``0002``) and
  ``apsup migrate`` work on one database in either order.
- A database made by the earlier layout (bare ``0001``..``0004`` in ``alembic_version``, built
  here by the earlier code's own revision files) upgrades in place, data kept.
- The reference families' tables exist only when asked for.
- An application may include apsup's revisions in its own environment
  (``apsup.migrations.version_locations()``); ``apsup run``'s check reads them there.
- ``apsup migrate --sql`` prints DDL without connecting; revision errors exit 2 in one line.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from alembic import command
from sqlalchemy import inspect, text

from apsup.migrations import FAMILY_TABLES, FRAMEWORK_TABLES, VERSION_TABLE, version_locations
from apsup.store import intents, migrate, open_backend
from apsup.store.revision import LEGACY_REVISIONS, SchemaRevisionError, check
from tests._legacy_layout import app_alembic, make_legacy_database

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.filterwarnings("ignore:Unknown schema content"),
]

PREFIX = "POWERCONTEXT_SERVER_RUNTIME_"


def apsup(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(PREFIX)}
    return subprocess.run(
        [sys.executable, "-m", "apsup.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def tables(url: str) -> set[str]:
    backend = open_backend(url)
    try:
        with backend.read() as conn:
            return {t.lower() for t in inspect(conn).get_table_names()}
    finally:
        backend.dispose()


def versions(url: str, table: str) -> set[str]:
    backend = open_backend(url)
    try:
        with backend.read() as conn:
            return {str(r[0]) for r in conn.execute(text(f"SELECT version_num FROM {table}"))}
    finally:
        backend.dispose()


def run_check(url: str) -> None:
    backend = open_backend(url)
    try:
        with backend.read() as conn:
            check(conn)
    finally:
        backend.dispose()


def one_line_error(out: subprocess.CompletedProcess[str]) -> str:
    assert out.returncode == 2, (out.returncode, out.stdout, out.stderr)
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("apsup:")]
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    return lines[0]


@pytest.mark.parametrize("legacy", ["0001", "0004"])
def test_a_database_of_the_earlier_layout_upgrades_in_place(
    db_url: str, tmp_path: Path, legacy: str
) -> None:
    make_legacy_database(db_url, legacy, tmp_path)
    assert versions(db_url, "alembic_version") == {legacy}
    backend = open_backend(db_url)
    try:
        with backend.transaction() as conn:
            kept = intents.request(conn, "b", "kept-scope")
        with pytest.raises(SchemaRevisionError, match=r"earlier layout.*apsup migrate"):
            run_check(db_url)
    finally:
        backend.dispose()

    out = apsup("migrate", "--db", db_url)
    assert out.returncode == 0, out.stderr[-2000:]

    names = tables(db_url)
    assert "alembic_version" not in names  # left to the application: it held only apsup's row
    assert versions(db_url, VERSION_TABLE) == {LEGACY_REVISIONS[legacy]}
    assert (names >= FAMILY_TABLES) == (legacy == "0004")  # the families' tables stay if made
    run_check(db_url)
    backend = open_backend(db_url)
    try:
        with backend.read() as conn:
            row = intents.get(conn, "b", "kept-scope")
        assert row is not None and row.requested_generation == kept
    finally:
        backend.dispose()

    # The application's own history (bare ids 0001/0002 too) now applies beside apsup's.
    command.upgrade(app_alembic(tmp_path, db_url), "head")
    assert versions(db_url, "alembic_version") == {"0002"}
    assert apsup("migrate", "--db", db_url).returncode == 0  # the app's 0002 is not ours
    assert versions(db_url, "alembic_version") == {"0002"}
    run_check(db_url)


@pytest.mark.parametrize("order", ["app-first", "apsup-first"])
def test_application_history_and_apsup_migrate_work_in_either_order(
    db_url: str, tmp_path: Path, order: str
) -> None:
    app = app_alembic(tmp_path, db_url)
    steps = [lambda: command.upgrade(app, "head"), lambda: migrate(db_url)]
    for step in steps if order == "app-first" else reversed(steps):
        step()
    names = tables(db_url)
    assert {"app_orders", "app_customers"} <= names
    assert names >= FRAMEWORK_TABLES
    assert not names & FAMILY_TABLES
    assert versions(db_url, "alembic_version") == {"0002"}
    assert versions(db_url, VERSION_TABLE) == {"apsup_0001"}
    run_check(db_url)
    # Each side upgrades again without disturbing the other.
    migrate(db_url)
    command.upgrade(app, "head")
    command.downgrade(app, "0001")  # the app's own history is fully its own
    assert "app_customers" not in tables(db_url)
    assert versions(db_url, VERSION_TABLE) == {"apsup_0001"}


def test_reference_family_tables_only_when_asked(db_url: str) -> None:
    migrate(db_url)
    assert not tables(db_url) & FAMILY_TABLES
    out = apsup("migrate", "--db", db_url, "--with-reference-families")
    assert out.returncode == 0, out.stderr[-2000:]
    assert tables(db_url) >= FAMILY_TABLES
    assert versions(db_url, VERSION_TABLE) == {"apsup_0004"}
    migrate(db_url)  # a plain migrate keeps a migrated families branch (and leaves it at head)
    run_check(db_url)


def test_own_alembic_environment_can_include_apsup_revisions(db_url: str, tmp_path: Path) -> None:
    app = app_alembic(tmp_path, db_url, *version_locations())
    command.upgrade(app, "heads")
    names = tables(db_url)
    assert FRAMEWORK_TABLES - {VERSION_TABLE} <= names and VERSION_TABLE not in names
    assert not names & FAMILY_TABLES
    assert versions(db_url, "alembic_version") == {"0002", "apsup_0001"}
    run_check(db_url)  # `apsup run` reads apsup's revision from the app's history
    line = one_line_error(apsup("migrate", "--db", db_url))
    assert "alembic upgrade heads" in line


@pytest.mark.backends("sqlite")
def test_revision_errors_exit_2_in_one_line(tmp_path: Path) -> None:
    fresh = tmp_path / "fresh.db"
    line = one_line_error(apsup("migrate", "--db", f"sqlite:///{fresh}", "--revision", "nope"))
    assert "nope" in line and not fresh.exists()  # nothing created

    url = f"sqlite:///{tmp_path / 'ahead.db'}"
    migrate(url)
    with sqlite3.connect(tmp_path / "ahead.db") as conn:
        conn.execute(f"UPDATE {VERSION_TABLE} SET version_num = 'apsup_0099'")
    line = one_line_error(apsup("migrate", "--db", url))
    assert "apsup_0099" in line
    with pytest.raises(SchemaRevisionError, match="apsup_0099"):
        run_check(url)


@pytest.mark.backends("sqlite")
@pytest.mark.parametrize("families", [False, True])
def test_sql_prints_the_ddl_without_connecting(tmp_path: Path, families: bool) -> None:
    flags = ["--with-reference-families"] if families else []
    mysql = apsup("migrate", "--sql", "--db", "mysql+pymysql://u:Secr3t@127.0.0.1:1/x", *flags)
    assert mysql.returncode == 0, mysql.stderr[-2000:]
    assert "CREATE TABLE pc_artifact_processing_intents" in mysql.stdout
    assert ("CREATE TABLE topic_sources" in mysql.stdout) == families
    assert "Secr3t" not in mysql.stdout + mysql.stderr

    path = tmp_path / "from-ddl.db"
    out = apsup("migrate", "--sql", "--db", f"sqlite:///{path}", *flags)
    assert out.returncode == 0 and not path.exists(), out.stderr[-2000:]
    with sqlite3.connect(path) as conn:  # what a DBA would do with the printed DDL
        conn.executescript(out.stdout)
    url = f"sqlite:///{path}"
    run_check(url)
    assert (tables(url) >= FAMILY_TABLES) == families
    backend: Any = open_backend(url)
    try:
        with backend.transaction() as conn:
            assert intents.request(conn, "b", "s") == 1  # the counter row was inserted too
    finally:
        backend.dispose()
