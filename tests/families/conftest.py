"""Fixtures for the reference families' business tests, built on the public ``apsup.testing``:
one migrated database per module and backend (migrating per test would dominate the run time),
emptied before every test."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pytest

from apsup.families import experience, handoff, profile, topic_memory
from apsup.store import open_backend
from apsup.testing import empty_tables, temporary_database, temporary_mysql_database

FAMILY_TABLES = [t for m in (topic_memory, experience, profile, handoff) for t in m.TABLES]


@pytest.fixture(
    scope="module",
    params=["sqlite", pytest.param("mysql", marks=pytest.mark.mysql_only)],
    ids=["sqlite", "mysql"],
)
def shared_db(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One migrated database per backend for this module; tests start from emptied tables."""
    database: AbstractContextManager[str]
    if request.param == "mysql":
        admin = request.getfixturevalue("mysql_url_admin")
        database = temporary_mysql_database(admin, reference_families=True)
    else:
        where: Path = tmp_path_factory.mktemp("db")
        database = temporary_database(reference_families=True, directory=where)
    with database as url:
        store = open_backend(url)
        yield store
        store.dispose()


@pytest.fixture
def backend(shared_db: Any) -> Iterator[Any]:
    empty_tables(shared_db, FAMILY_TABLES)
    yield shared_db
