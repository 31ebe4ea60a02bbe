"""Scope ids and binding names compare byte for byte on every backend.

MySQL/OceanBase's default collation folds case and ignores trailing spaces, and even
``utf8mb4_bin`` ignores trailing spaces: there ``CaseX``, ``casex`` and ``"casex "`` used to be one
intents row, so the processor was invoked for ``CaseX`` and never saw the other two. Identifier
columns are ``VARBINARY`` on MySQL now; revision 0005 converts an existing database and refuses,
naming the values, when the old collation has already merged distinct Scopes.
"""

from __future__ import annotations

import unicodedata
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import Connection, delete, select, text

from apsup import Registry, family
from apsup.errors import ConfigError
from apsup.store import intents, migrate, open_backend
from apsup.store.base import SqlBackend
from apsup.store.schema import intents as intents_table

pytestmark = [pytest.mark.timeout(180), pytest.mark.backends("sqlite", "mysql", "postgresql")]

#: The revisions before byte-exact identifiers (apsup_0005 and, for principals, apsup_0006).
BEFORE = "apsup_0004"  # the families branch before 0006; the framework stays at apsup_0001

_CHARS = st.characters(
    codec="utf-8", exclude_categories=("Cs",), min_codepoint=32, exclude_characters="\x7f"
)


def _variants(base: str) -> set[str]:
    """Ids a case- or pad-insensitive or normalising comparison would merge with ``base``."""
    out = {
        base,
        base.upper(),
        base.lower(),
        base.swapcase(),
        base + " ",
        base + "  ",
        " " + base,
        unicodedata.normalize("NFD", base),
        unicodedata.normalize("NFC", base),
    }
    return {v for v in out if 0 < len(v) <= 255}


scope_sets = st.lists(st.text(_CHARS, min_size=1, max_size=12), min_size=1, max_size=4).map(
    lambda bases: set().union(*(_variants(b) for b in bases))
)


def _rows(conn: Connection, binding: str) -> dict[str, int]:
    c = intents_table.c
    rows = conn.execute(
        select(c.scope_id, c.requested_generation).where(c.binding_name == binding)
    ).all()
    return {str(r[0]): int(r[1]) for r in rows}


@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(scopes=scope_sets)
def test_distinct_scope_ids_stay_distinct_keys(backend: SqlBackend, scopes: set[str]) -> None:
    fam = family("ident-bytes", registry=Registry())(lambda scope_id, ctx: None)
    with backend.transaction() as conn:
        conn.execute(delete(intents_table).where(intents_table.c.binding_name == fam.binding_name))
    with backend.transaction() as conn:
        generations = {scope: fam.request(conn, scope) for scope in sorted(scopes)}
    assert generations == dict.fromkeys(scopes, 1), "a Scope advanced another Scope's row"
    with backend.read() as conn:
        assert _rows(conn, fam.binding_name) == dict.fromkeys(scopes, 1)
        # Point lookups find exactly their own row.
        for scope in scopes:
            found = conn.execute(
                select(intents_table.c.scope_id).where(
                    intents_table.c.binding_name == fam.binding_name,
                    intents_table.c.scope_id == scope,
                )
            ).scalars()
            assert list(found) == [scope]


def test_binding_names_differing_in_case_are_distinct(backend: SqlBackend) -> None:
    # Registered bindings are lowercase; rows written under older rules may not be.
    with backend.transaction() as conn:
        assert intents.request(conn, "case-b", "s") == 1
        assert intents.request(conn, "Case-B", "s") == 1
    with backend.read() as conn:
        assert _rows(conn, "case-b") == {"s": 1}
        assert _rows(conn, "Case-B") == {"s": 1}


# --- revision 0005 on a database created with the server's default collation ---------------


def _old_collation(url: str) -> None:
    """Turn a migrated-to-BEFORE database into what 0001/0002 used to create: text identifier
    columns in the server default, case-insensitive collation."""
    backend = open_backend(url)
    try:
        with backend.engine.begin() as conn:
            rows = conn.execute(
                text(
                    "SELECT table_name, column_name, is_nullable FROM information_schema.columns "
                    "WHERE table_schema = DATABASE() AND data_type = 'varbinary'"
                )
            ).all()
            for table, column, nullable in rows:
                null = "NULL" if nullable == "YES" else "NOT NULL"
                conn.exec_driver_sql(
                    f"ALTER TABLE `{table}` MODIFY `{column}` VARCHAR(255) "
                    f"CHARACTER SET utf8mb4 COLLATE utf8mb4_general_ci {null}"
                )
    finally:
        backend.dispose()


def _column_types(url: str, table: str) -> dict[str, str]:
    backend = open_backend(url)
    try:
        with backend.engine.connect() as conn:
            rows = conn.execute(
                text(
                    "SELECT column_name, data_type FROM information_schema.columns "
                    "WHERE table_schema = DATABASE() AND table_name = :t"
                ),
                {"t": table},
            ).all()
        return {str(r[0]).lower(): str(r[1]).lower() for r in rows}
    finally:
        backend.dispose()


@pytest.mark.mysql_only
def test_0005_makes_an_old_database_byte_exact(db_url: str) -> None:
    migrate(db_url, BEFORE)
    _old_collation(db_url)
    with open_backend(db_url).engine.begin() as conn:  # the merge the old collation causes
        conn.exec_driver_sql(
            "INSERT INTO pc_artifact_processing_intents (binding_name, scope_id, "
            "pending_sequence, requested_generation) VALUES ('fam', 'CaseX', 1, 1)"
        )
        with pytest.raises(Exception, match="Duplicate"):
            conn.exec_driver_sql(
                "INSERT INTO pc_artifact_processing_intents (binding_name, scope_id, "
                "pending_sequence) VALUES ('fam', 'casex ', 2)"
            )
    migrate(db_url)
    assert _column_types(db_url, "pc_artifact_processing_intents")["scope_id"] == "varbinary"
    assert _column_types(db_url, "topic_sources")["scope_id"] == "varbinary"
    fam = family("fam", registry=Registry())(lambda scope_id, ctx: None)
    backend = open_backend(db_url)
    try:
        with backend.transaction() as conn:
            assert fam.request(conn, "casex ") == 1
            assert fam.request(conn, "CaseX") == 2  # the existing row kept its generations
        with backend.read() as conn:
            assert _rows(conn, "fam") == {"CaseX": 2, "casex ": 1}
    finally:
        backend.dispose()


@pytest.mark.mysql_only
def test_0005_refuses_merged_scopes_and_changes_nothing(db_url: str) -> None:
    migrate(db_url, BEFORE)
    _old_collation(db_url)
    with open_backend(db_url).engine.begin() as conn:
        conn.exec_driver_sql(
            "INSERT INTO pc_artifact_processing_intents (binding_name, scope_id, "
            "pending_sequence, requested_generation) VALUES ('topic-memory', 'CaseX', 1, 2)"
        )
        # Sources written for two Scopes, both attributed to one intents row and Cursor.
        conn.exec_driver_sql(
            "INSERT INTO topic_sources (scope_id, position, body) "
            "VALUES ('CaseX', 1, 'a'), ('casex', 2, 'b'), ('other', 1, 'c')"
        )
    with pytest.raises(ConfigError) as info:
        migrate(db_url)
    message = str(info.value)
    assert "'CaseX'" in message and "'casex'" in message and "topic_sources" in message
    assert "'other'" not in message
    assert "apsup migrate" in message
    # Nothing converted: every check runs before the first ALTER.
    assert _column_types(db_url, "pc_artifact_processing_intents")["scope_id"] == "varchar"
    assert _column_types(db_url, "topic_sources")["scope_id"] == "varchar"


@pytest.mark.mysql_only
def test_0006_makes_handoff_principals_byte_exact(db_url: str) -> None:
    from apsup.families import handoff as ho
    from apsup.families._common import AuthorizationDenied

    migrate(db_url, BEFORE)
    _old_collation(db_url)  # principal columns too, as apsup_0002 used to create them
    with open_backend(db_url).engine.begin() as conn:
        conn.exec_driver_sql(
            "INSERT INTO handoff_access (scope_id, principal, allowed) VALUES ('s', 'alice', 1)"
        )
    migrate(db_url)
    assert _column_types(db_url, "handoff_access")["principal"] == "varbinary"
    assert _column_types(db_url, "handoff_requests")["principal"] == "varbinary"
    backend = open_backend(db_url)
    try:
        with pytest.raises(AuthorizationDenied), backend.transaction() as conn:
            ho.request_handoff(conn, "s", "blob://1", principal="Alice")
        with backend.transaction() as conn:  # the kept grant still names its own principal
            assert ho.request_handoff(conn, "s", "blob://1", principal="alice") == 1
    finally:
        backend.dispose()


@pytest.mark.backends("sqlite")
def test_0005_is_a_no_op_on_sqlite(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'x.db'}"
    migrate(url, BEFORE)
    migrate(url)
    backend = open_backend(url)
    fam = family("fam", registry=Registry())(lambda scope_id, ctx: None)
    try:
        with backend.transaction() as conn:
            assert [fam.request(conn, s) for s in ("a", "A", "a ")] == [1, 1, 1]
    finally:
        backend.dispose()
