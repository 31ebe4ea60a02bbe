"""Fixtures for the reference families' business tests: one migrated database per module and
backend (migrating per test would dominate the run time), emptied before every test."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from apsup.context import dispose_backends
from apsup.families._testing import create_database, drop_database, reset
from apsup.store import migrate, open_backend


@pytest.fixture(
    scope="module",
    params=["sqlite", pytest.param("mysql", marks=pytest.mark.mysql_only)],
    ids=["sqlite", "mysql"],
)
def shared_db(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One migrated database per backend for this module; tests start from emptied tables."""
    admin = request.getfixturevalue("mysql_url_admin") if request.param == "mysql" else None
    url = create_database(
        request.param, sqlite_dir=str(tmp_path_factory.mktemp("db")), mysql_admin_url=admin
    )
    migrate(url, reference_families=True)
    store = open_backend(url)
    yield store
    store.dispose()
    dispose_backends()
    drop_database(url)


@pytest.fixture
def backend(shared_db: Any) -> Iterator[Any]:
    reset(shared_db)
    yield shared_db
