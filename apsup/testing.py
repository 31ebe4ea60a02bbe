"""Test kit for your own families: a migrated database, and one real invocation of a family.

Use it from your test suite (pytest or anything else); it needs no running host::

    from apsup.testing import temporary_database, invoke

    with temporary_database() as url:                 # a migrated SQLite file, removed after
        with create_engine(url).begin() as conn:
            my_family.request(conn, "scope-1")
        outcome = invoke(my_family, "scope-1", database_url=url)
        assert outcome.exit_cause == "SUCCESS" and outcome.acknowledged

``invoke`` runs the family's processor the way a Worker does: in a new child process, through
apsup's own Worker wrapper, under a freshly claimed (valid) term, and reports what happened from
the database afterwards, so a test checks durable facts (acknowledged or not, handled
generation, still dirty) rather than return values. ``crash_after_commits=N`` kills the child
with SIGKILL right after its N-th fenced transaction commits, between a business commit and the
acknowledgment that would follow it, which is how to test that a retry does not duplicate work.

For fast in-process business tests there are ``claim_term``, ``make_context`` (the context a
Worker would receive) and ``crashing`` (raise ``SimulatedCrash`` after N commits).

Do not point these helpers at a database a running host uses: claiming a term fences that
host's Workers out (that is the guarantee; it is not what a unit test wants).
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, fields
from pathlib import Path

from sqlalchemy import Connection, Table, create_engine, delete
from sqlalchemy.engine import make_url

from apsup.context import ExecutionContext
from apsup.errors import ConfigError, IntentError
from apsup.registry import Family, default_registry
from apsup.store import SqlBackend, Term, migrate, open_backend
from apsup.store import intents as _intents

__all__ = [
    "Outcome",
    "SimulatedCrash",
    "claim_term",
    "crashing",
    "empty_tables",
    "intent",
    "invoke",
    "make_context",
    "temporary_database",
    "temporary_mysql_database",
]

#: The supervisor key a ``global``-mode host uses; ``invoke`` claims terms under it.
GLOBAL_KEY = "global"
_CRASH_ENV = "APSUP_TESTING_CRASH_AFTER_COMMITS"
_CHILD_TARGET = "apsup.testing:_child"
_TEST_LEASE_SECONDS = 300.0


# -- databases ---------------------------------------------------------------------------------


@contextmanager
def temporary_database(
    *, reference_families: bool = False, directory: str | os.PathLike[str] | None = None
) -> Iterator[str]:
    """A new SQLite database file migrated by ``apsup migrate``; yields its URL and removes it.

    ``reference_families``: also create the reference families' tables. ``directory``: where to
    put it (default: a new temporary directory, removed afterwards).
    """
    owned = directory is None
    where = Path(tempfile.mkdtemp(prefix="apsup-test-") if owned else directory)  # type: ignore[arg-type]
    url = f"sqlite:///{where.resolve() / f'apsup-{uuid.uuid4().hex[:8]}.db'}"
    try:
        migrate(url, reference_families=reference_families)
        yield url
    finally:
        _dispose_context_backends()
        if owned:
            shutil.rmtree(where, ignore_errors=True)


@contextmanager
def temporary_mysql_database(
    server_url: str, *, reference_families: bool = False, prefix: str = "apsup_test_"
) -> Iterator[str]:
    """A new database (schema) on the MySQL/OceanBase server at ``server_url`` (a URL whose
    user may CREATE and DROP databases; its database part is ignored), migrated; yields its URL
    and drops it afterwards."""
    server = make_url(server_url)
    if server.get_backend_name() not in {"mysql", "mariadb"}:
        raise ConfigError(f"{server.get_backend_name()!r} is not a MySQL URL (mysql+pymysql://...)")
    name = f"{prefix}{secrets.token_hex(6)}"  # lower case: lower_case_table_names may be 1
    admin = create_engine(server.set(database=None))
    try:
        with admin.connect() as conn:
            conn.exec_driver_sql(f"CREATE DATABASE `{name}`")
        url = server.set(database=name).render_as_string(hide_password=False)
        try:
            migrate(url, reference_families=reference_families)
            yield url
        finally:
            _dispose_context_backends()
            with admin.connect() as conn:
                conn.exec_driver_sql(f"DROP DATABASE IF EXISTS `{name}`")
    finally:
        admin.dispose()


def empty_tables(backend: SqlBackend, tables: Sequence[Table] = ()) -> None:
    """Empty apsup's intents, scan states and leases plus ``tables`` (your domain tables, in
    creation order): a migrated database reused by several tests starts each one clean."""
    from apsup.store.schema import binding_states, intents, leases

    with backend.transaction() as conn:
        for table in [*reversed(list(tables)), leases, binding_states, intents]:
            conn.execute(delete(table))


def _dispose_context_backends() -> None:
    from apsup.context import dispose_backends

    dispose_backends()


# -- terms and contexts (in-process) -----------------------------------------------------------


def claim_term(backend: SqlBackend, key: str = GLOBAL_KEY) -> Term:
    """A new valid term for ``key``; any earlier term of that key becomes stale (its commits
    fail with ``StaleTermError``), exactly as when a host takes over."""
    term = backend.claim_term(key, uuid.uuid4().hex, _TEST_LEASE_SECONDS)
    if term is None:  # a MySQL lease still held by an earlier holder: fence it out
        backend.invalidate_terms([key])
        term = backend.claim_term(key, uuid.uuid4().hex, _TEST_LEASE_SECONDS)
    if term is None:
        raise IntentError(f"could not claim a term for {key!r}: is a host running on this db?")
    return term


def intent(backend: SqlBackend, fam: Family, scope_id: str) -> _intents.Intent | None:
    """The Scope's intent row (generations, dirty/requested flags), or None."""
    with backend.read() as conn:
        return _intents.get(conn, fam.binding_name, scope_id)


def make_context(
    backend: SqlBackend,
    fam: Family,
    scope_id: str,
    term: Term,
    *,
    generation: int | None = None,
    settings: dict[str, str] | None = None,
) -> ExecutionContext:
    """The context a Worker would receive for ``scope_id``, claiming the Scope's current
    requested generation (or ``generation``). The Scope must have an intent row (request it)."""
    row = intent(backend, fam, scope_id)
    if row is None:
        raise IntentError(
            f"scope {scope_id!r} of {fam.binding_name!r} has no intent row: "
            "request() or mark_dirty() it first"
        )
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
    """Raised by a ``crashing`` context in place of a Worker dying."""


class _CrashAfterCommits(ExecutionContext):
    crash_after: int = 1
    commits: int = 0

    @contextmanager
    def fenced(self) -> Iterator[Connection]:
        with super().fenced() as conn:
            yield conn
        self.commits += 1
        if self.commits >= self.crash_after:
            raise SimulatedCrash(f"worker died after commit {self.commits}")


def crashing(ctx: ExecutionContext, after: int = 1) -> ExecutionContext:
    """``ctx``, but the "Worker dies" (``SimulatedCrash``) right after its ``after``-th fenced
    transaction COMMITs: between a business commit and the acknowledgment that follows it."""
    clone = _CrashAfterCommits(**{f.name: getattr(ctx, f.name) for f in fields(ctx) if f.init})
    clone.crash_after = after
    return clone


# -- one real invocation in a child process ----------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    """What one ``invoke`` did, read back from the Worker's exit and the database."""

    #: Worker exit status (``apsup.workers.exit_codes.ExitCode``; ``-N`` = killed by signal N).
    exit_code: int
    #: Its name: SUCCESS, PROCESSOR_FAILURE, PROGRESS_CONFLICT, STALE_TERM, TERMINATED,
    #: BAD_CONTEXT, KILLED_SIGKILL, ...
    exit_cause: str
    #: The request generation the invocation claimed.
    generation: int
    #: The Scope's generations after the child exited.
    handled_generation: int
    requested_generation: int
    #: Work remains recorded (dirty > clean) after the invocation.
    dirty: bool
    #: The child outlived ``timeout`` and was stopped (SIGTERM, then SIGKILL).
    timed_out: bool
    #: The child's stderr (apsup's Worker reports exception types and locations, no messages).
    stderr: str

    @property
    def acknowledged(self) -> bool:
        """The claimed generation is durably handled."""
        return self.handled_generation >= self.generation


def invoke(
    family: Family | str,
    scope_id: str,
    *,
    database_url: str,
    settings: dict[str, str] | None = None,
    generation: int | None = None,
    term: Term | None = None,
    crash_after_commits: int | None = None,
    timeout: float = 60.0,
    grace: float = 5.0,
) -> Outcome:
    """Run one invocation of ``family`` for ``scope_id`` in a new child process, the way a
    Worker does, and return its ``Outcome``.

    The invocation claims the Scope's pending requested generation; when none is pending it
    first accepts one (``family.request``), as an automatic admission of dirty state would.
    ``generation`` claims that generation instead (an already handled one replays a duplicate
    delivery, which the Worker wrapper skips without calling the processor). ``term``: the
    term to dispatch under (default: a freshly claimed one; pass an earlier term to see a stale
    one fenced out). ``settings``: environment
    of the child (e.g. ``{"POWERCONTEXT_SERVER_RUNTIME_MY_FAMILY_BATCH": "5"}``).
    ``crash_after_commits``: SIGKILL the child right after its N-th fenced commit.

    The family must be importable in a new process by its entry point (``module:attribute``);
    the child gets this process's ``sys.path`` as ``PYTHONPATH``.
    """
    fam = default_registry.get(family) if isinstance(family, str) else family
    backend = open_backend(database_url)
    try:
        row = intent(backend, fam, scope_id)
        if generation is None and (
            row is None or row.requested_generation <= row.handled_generation
        ):
            with backend.transaction() as conn:  # nothing pending: admit, as a scan would
                fam.request(conn, scope_id)
        if term is None:
            term = claim_term(backend)
        ctx = make_context(
            backend, fam, scope_id, term, generation=generation, settings=dict(settings or {})
        )
        code, timed_out, stderr = _run_child(ctx, crash_after_commits, timeout, grace)
        after = intent(backend, fam, scope_id)
    finally:
        backend.dispose()
    assert after is not None
    return Outcome(
        exit_code=code,
        exit_cause=_describe(code),
        generation=ctx.claimed_request_generation,
        handled_generation=after.handled_generation,
        requested_generation=after.requested_generation,
        dirty=after.dirty,
        timed_out=timed_out,
        stderr=stderr,
    )


def _describe(code: int) -> str:
    from apsup.workers.exit_codes import describe

    return describe(code)


def _run_child(
    ctx: ExecutionContext, crash_after: int | None, timeout: float, grace: float
) -> tuple[int, bool, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    env.pop(_CRASH_ENV, None)
    target = "apsup.workers.invoke:run"
    if crash_after is not None:
        if crash_after < 1:
            raise ValueError("crash_after_commits must be >= 1")
        env[_CRASH_ENV] = str(crash_after)
        target = _CHILD_TARGET
    code = (
        "import sys; from apsup.workers.child import main; "
        f"main({target!r}, sys.stdin.buffer.read())"
    )
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(
            [sys.executable, "-c", code], stdin=subprocess.PIPE, stderr=err, env=env
        )
        assert proc.stdin is not None
        proc.stdin.write(ctx.to_bytes())
        proc.stdin.close()
        timed_out = False
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            with suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)  # the Worker leads its own process group
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                with suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        err.seek(0)
        return proc.returncode, timed_out, err.read().decode(errors="replace")


def _child(payload: bytes) -> int:
    """Child-side target of ``crash_after_commits``: apsup's Worker wrapper, with the process
    SIGKILLed right after the N-th fenced commit (a real crash, not an exception)."""
    from apsup.workers.invoke import run

    after = int(os.environ[_CRASH_ENV])
    original = ExecutionContext.fenced
    commits = 0

    @contextmanager
    def fenced(self: ExecutionContext) -> Iterator[Connection]:
        nonlocal commits
        with original(self) as conn:
            yield conn
        commits += 1
        if commits >= after:
            os.kill(os.getpid(), signal.SIGKILL)

    ExecutionContext.fenced = fenced  # type: ignore[method-assign]
    return run(payload)
