"""Helpers for testing a processor without the Supervisor (family authors' test kit).

Business guarantees (ordering, idempotency, Review and authorization boundaries) are tested by
calling the processor in-process with an ``ExecutionContext`` built here, under a real term
claimed on the real backend, so fencing is exercised exactly as in a Worker.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import fields
from typing import Any

from sqlalchemy import Connection, create_engine, delete
from sqlalchemy.engine import make_url

from apsup.context import ExecutionContext
from apsup.errors import IntentError
from apsup.registry import Family
from apsup.store import SqlBackend, Term
from apsup.store import intents as _intents


def claim(backend: SqlBackend, key: str = "global") -> Term:
    """A fresh valid term for ``key`` (any backend)."""
    term = backend.claim_term(key, uuid.uuid4().hex, 30)
    if term is None:  # a MySQL lease still held by an earlier test holder: invalidate it
        backend.invalidate_terms([key])
        term = backend.claim_term(key, uuid.uuid4().hex, 30)
    assert term is not None
    return term


def make_context(
    backend: SqlBackend,
    fam: Family,
    scope_id: str,
    term: Term,
    *,
    generation: int | None = None,
    settings: dict[str, str] | None = None,
) -> ExecutionContext:
    """The context a Worker would receive for ``scope_id``, claiming the current requested G
    (or ``generation``). The Scope must already have an intent row."""
    with backend.read() as conn:
        row = _intents.get(conn, fam.binding_name, scope_id)
    if row is None:
        raise IntentError(f"scope {scope_id!r} of {fam.binding_name!r} has no intent row")
    return ExecutionContext(
        binding_name=fam.binding_name,
        artifact_family=fam.artifact_family,
        scope_id=scope_id,
        claimed_request_generation=(row.requested_generation if generation is None else generation),
        supervisor_key=term.supervisor_key,
        holder_id=term.holder_id,
        supervisor_generation=term.generation,
        worker_id=f"test-{uuid.uuid4().hex[:8]}",
        pending_sequence=row.pending_sequence,
        entry_point=fam.entry_point,
        database_url=backend.url,
        settings=dict(settings or {}),
    )


class SimulatedCrash(Exception):
    """Raised by ``CrashAfterCommits`` in place of a Worker dying."""


class CrashAfterCommits(ExecutionContext):
    """A context whose Worker "dies" right after its N-th fenced transaction COMMITs, i.e.
    between a legitimate business commit and the acknowledgment that would follow it."""

    crash_after: int = 1
    commits: int = 0

    @contextmanager
    def fenced(self) -> Iterator[Connection]:
        with super().fenced() as conn:
            yield conn
        self.commits += 1
        if self.commits >= self.crash_after:
            raise SimulatedCrash(f"worker died after commit {self.commits}")


def crashing(ctx: ExecutionContext, after: int = 1) -> CrashAfterCommits:
    clone = CrashAfterCommits(**{f.name: getattr(ctx, f.name) for f in fields(ctx) if f.init})
    clone.crash_after = after
    return clone


def intent(backend: SqlBackend, fam: Family, scope_id: str) -> _intents.Intent | None:
    with backend.read() as conn:
        return _intents.get(conn, fam.binding_name, scope_id)


# -- shared databases for fast business tests --------------------------------------------------


#: Tables a business test may write; ``reset`` empties them between tests of one module.
def _family_tables() -> list[Any]:
    from apsup.families import experience, handoff, profile, topic_memory
    from apsup.store.schema import binding_states, intents, leases

    tables: list[Any] = [intents, binding_states, leases]
    for module in (topic_memory, experience, profile, handoff):
        tables.extend(module.TABLES)
    return tables


def create_database(kind: str, *, sqlite_dir: str, mysql_admin_url: str | None) -> str:
    """A new empty database URL: a file under ``sqlite_dir`` or a new MySQL schema."""
    if kind == "sqlite":
        return f"sqlite:///{sqlite_dir}/apsup-{uuid.uuid4().hex[:8]}.db"
    if not mysql_admin_url:
        raise ValueError("a MySQL admin URL is required for the mysql backend")
    name = f"apsup_f_{uuid.uuid4().hex[:12]}"
    engine = create_engine(mysql_admin_url)
    try:
        with engine.connect() as conn:
            conn.exec_driver_sql(f"CREATE DATABASE `{name}`")
    finally:
        engine.dispose()
    return make_url(mysql_admin_url).set(database=name).render_as_string(hide_password=False)


def drop_database(url: str) -> None:
    u = make_url(url)
    if u.get_backend_name() == "sqlite":
        return
    engine = create_engine(u.set(database=None))
    try:
        with engine.connect() as conn:
            conn.exec_driver_sql(f"DROP DATABASE IF EXISTS `{u.database}`")
    finally:
        engine.dispose()


def reset(backend: SqlBackend) -> None:
    """Empty the framework and family tables (a migrated database reused across tests)."""
    with backend.transaction() as conn:
        for table in reversed(_family_tables()):
            conn.execute(delete(table))
