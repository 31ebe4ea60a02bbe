"""A lost first registration is recognised by the driver's error code, not by its message.

Two rows with one primary key: a duplicate (the race the single-row and bulk intake paths
resolve by updating instead). A CHECK violation (clean ahead of dirty) is an integrity error
too, but not a duplicate: it must reach the caller, never be taken for a lost race. On both
backends, with the server's own error; a message that merely reads like one is not one."""

from __future__ import annotations

import pytest
from sqlalchemy import insert
from sqlalchemy.exc import DBAPIError

from apsup.store import intents
from apsup.store.schema import intents as intents_table
from apsup.store.violations import is_duplicate_key

pytestmark = pytest.mark.backends("sqlite", "mysql", "postgresql")


def _refused(backend, values: dict) -> DBAPIError:
    # A CHECK violation is an IntegrityError on SQLite, error 3819 (OperationalError) on seekdb.
    with pytest.raises(DBAPIError) as info, backend.transaction() as conn:
        conn.execute(insert(intents_table).values(values))
    return info.value


def test_duplicate_and_check_violations_are_told_apart(backend) -> None:
    with backend.transaction() as conn:
        intents.request(conn, "dup-fam", "s1")
        row = intents.get(conn, "dup-fam", "s1")
    assert row is not None
    duplicate = _refused(
        backend,
        {"binding_name": "dup-fam", "scope_id": "s1", "pending_sequence": 10**12},
    )
    assert is_duplicate_key(duplicate)
    check = _refused(
        backend,
        {
            "binding_name": "dup-fam",
            "scope_id": "s2",
            "pending_sequence": 10**12 + 1,
            "clean_generation": 5,
        },
    )
    assert not is_duplicate_key(check)


def test_a_message_that_only_looks_like_a_duplicate_is_not_one() -> None:
    class Foreign(Exception):
        pass

    assert not is_duplicate_key(Foreign("Duplicate entry 'x' for key 'PRIMARY'"))
    assert not is_duplicate_key(Foreign("UNIQUE constraint failed"))
