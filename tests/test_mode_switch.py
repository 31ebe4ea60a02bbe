"""Mode switch maintenance (RFC §9, acceptance 11), on both backends.

- ``switch_mode`` invalidates every active term of *both* modes (``global`` and every
  ``artifact:*``) in the database: generations advance (never reset), holders clear, and a
  Worker context of the old mode can no longer commit (StaleTermError, nothing written); SQLite's
  permanent term is invalidated too (a new key alone would not invalidate it);
- intents, scan state, check times and counters are byte-for-byte unchanged;
- it refuses while a SQLite host runs (host lock) and, on MySQL, while a Lease is live (unless
  forced), and prints what it did through ``apsup maintenance switch-mode``;
- switching global -> dedicated -> global with real Runtimes in between preserves progress:
  every accepted request is handled exactly once in business terms, generations only grow.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from datetime import datetime
from typing import Any

import pytest
from sqlalchemy import insert, select

from apsup.context import ExecutionContext
from apsup.errors import HostConflictError, StaleTermError
from apsup.store import SqlBackend, intents, scans
from apsup.store.leases import Term
from apsup.store.schema import binding_states, counters
from apsup.store.schema import intents as intents_table
from apsup.supervisor.control import HostLock
from apsup.supervisor.maintenance import switch_mode
from apsup.supervisor.runtime import Runtime
from tests.replicas import families
from tests.replicas.cluster import REPO_ROOT, Cluster
from tests.replicas.support import (
    FAST_BACKOFF,
    handled,
    request,
    running,
    settings_for,
    wait_for,
)

pytestmark = [pytest.mark.timeout(180), pytest.mark.backends("sqlite", "mysql", "postgresql")]


def _snapshot(backend: SqlBackend) -> dict[str, list[tuple[Any, ...]]]:
    out = {}
    with backend.read() as conn:
        for table in (intents_table, binding_states, counters, families.progress):
            pk = list(table.primary_key.columns)
            out[table.name] = [tuple(r) for r in conn.execute(select(table).order_by(*pk))]
    return out


def _context(backend: SqlBackend, term: Term, scope: str) -> ExecutionContext:
    fam = families.work
    with backend.read() as conn:
        row = intents.get(conn, fam.binding_name, scope)
    assert row is not None
    return ExecutionContext(
        binding_name=fam.binding_name,
        artifact_family=fam.name,
        scope_id=scope,
        claimed_request_generation=row.requested_generation,
        supervisor_key=term.supervisor_key,
        holder_id=term.holder_id,
        supervisor_generation=term.generation,
        worker_id="old-mode-worker",
        pending_sequence=row.pending_sequence,
        entry_point=fam.entry_point,
        database_url=backend.url,
    )


def _old_mode_state(backend: SqlBackend) -> Term:
    """A running old-mode (global) deployment: a live term, intents, an unfinished scan."""
    # An earlier dedicated life left its keys behind (released), as after a previous switch.
    old = backend.claim_term("artifact:replica-work", uuid.uuid4().hex, 30)
    assert old is not None
    backend.release_term(old)
    term = backend.claim_term("global", uuid.uuid4().hex, 30)
    assert term is not None
    with backend.transaction() as conn:
        for i in range(5):
            families.work.mark_dirty(conn, f"s{i}")
            families.work.request(conn, f"s{i}")
        families.side.request(conn, "x")

    def scan(conn: Any) -> None:
        scans.start_scan(conn, families.work.binding_name, datetime(2026, 1, 2, 3, 4, 5))
        scans.admit(conn, families.work.binding_name, "s1", 1)

    backend.run_fenced(term, scan)
    return term


@pytest.mark.parametrize("to", ["dedicated", "global"])
def test_switch_invalidates_every_term_and_touches_nothing_else(
    backend: SqlBackend, db_url: str, to: str
) -> None:
    Cluster.prepare(db_url)
    term = _old_mode_state(backend)
    ctx = _context(backend, term, "s0")
    with ctx.fenced() as conn:  # the old-mode Worker commits while its term is valid
        conn.execute(insert(families.progress).values(scope_id="s0", version=1, last_g=1))
    before_rows = {r.supervisor_key: r for r in backend.lease_rows()}
    assert before_rows["global"].holder_id == term.holder_id
    if backend.name == "sqlite":
        assert before_rows["global"].expires_at is None  # the permanent SQLite term
    before = _snapshot(backend)

    settings = settings_for(db_url, mode="global", http=False)
    # MySQL: the old holder is (known) dead but its Lease has not expired yet.
    report = switch_mode(settings, to, force=backend.name != "sqlite")

    after_rows = {r.supervisor_key: r for r in backend.lease_rows()}
    assert sorted(after_rows) == ["artifact:replica-work", "global"]
    for key, row in after_rows.items():
        assert row.holder_id == ""
        assert row.generation == before_rows[key].generation + 1  # advanced, never reset
    assert {c.key for c in report.changes} == set(after_rows)
    text = str(report)
    assert "invalidated global" in text and "invalidated artifact:replica-work" in text
    assert _snapshot(backend) == before  # intents, scan state, checkpoints: byte for byte
    # The old-mode Worker can no longer commit, and nothing of its attempt is written.
    with pytest.raises(StaleTermError), ctx.fenced() as conn:
        conn.execute(insert(families.progress).values(scope_id="s9", version=1, last_g=1))
    assert _snapshot(backend) == before
    # Neither can the old Supervisor's control writes.
    with pytest.raises(StaleTermError):
        backend.run_fenced(term, lambda c: scans.end_scan(c, families.work.binding_name, 1))


@pytest.mark.backends("sqlite")
def test_sqlite_switch_is_refused_while_a_host_runs(backend: SqlBackend, db_url: str) -> None:
    Cluster.prepare(db_url)
    _old_mode_state(backend)
    before = backend.lease_rows()
    lock = HostLock(db_url)
    lock.acquire()  # what a running host holds
    try:
        with pytest.raises(HostConflictError, match="Stop every apsup host"):
            switch_mode(settings_for(db_url, http=False), "dedicated")
    finally:
        lock.release()
    assert backend.lease_rows() == before
    switch_mode(settings_for(db_url, http=False), "dedicated")  # hosts stopped: it proceeds


@pytest.mark.mysql_only
def test_mysql_switch_is_refused_while_a_lease_is_live(backend: SqlBackend, db_url: str) -> None:
    Cluster.prepare(db_url)
    term = _old_mode_state(backend)
    before = backend.lease_rows()
    with pytest.raises(HostConflictError, match="global"):
        switch_mode(settings_for(db_url, http=False), "dedicated")
    assert backend.lease_rows() == before
    backend.release_term(term)  # the replica stopped gracefully
    report = switch_mode(settings_for(db_url, http=False), "dedicated")
    assert all(c.generation_after > c.generation_before for c in report.changes)


def _cli_switch(db_url: str, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("POWERCONTEXT_")}
    env["PYTHONPATH"] = str(REPO_ROOT)
    return subprocess.run(
        [
            *(sys.executable, "-m", "apsup.cli", "maintenance", "switch-mode"),
            *("--to", "dedicated", "--app", "tests.replicas.cli_app", "--db", db_url, *extra),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=str(REPO_ROOT),
    )


@pytest.mark.mysql_only
def test_cli_refuses_a_live_lease_and_names_force_which_then_proceeds(
    backend: SqlBackend, db_url: str
) -> None:
    Cluster.prepare(db_url)
    _old_mode_state(backend)  # a replica that died without releasing: its Lease is still live
    before = backend.lease_rows()
    refused = _cli_switch(db_url)
    assert refused.returncode == 3, refused.stderr  # a host conflict, not a crash
    assert "--force" in refused.stderr and "global" in refused.stderr
    assert backend.lease_rows() == before
    forced = _cli_switch(db_url, "--force")
    assert forced.returncode == 0, forced.stderr
    after = {r.supervisor_key: r for r in backend.lease_rows()}
    assert all(
        after[r.supervisor_key].holder_id == ""
        and after[r.supervisor_key].generation > r.generation
        for r in before
        if r.holder_id
    )


def test_cli_switch_mode_prints_what_it_did(backend: SqlBackend, db_url: str) -> None:
    Cluster.prepare(db_url)
    term = _old_mode_state(backend)
    backend.release_term(term)
    out = _cli_switch(db_url)
    assert out.returncode == 0, out.stderr
    assert "invalidated global" in out.stdout
    assert "artifact:replica-side, artifact:replica-work" in out.stdout
    assert "POWERCONTEXT_SERVER_RUNTIME_ARTIFACT_PROCESSING_SUPERVISOR_MODE=dedicated" in out.stdout
    assert all(r.holder_id == "" for r in backend.lease_rows())


def test_switching_back_and_forth_preserves_progress(backend: SqlBackend, db_url: str) -> None:
    Cluster.prepare(db_url)
    accepted: dict[tuple[str, str], int] = {}
    generations: list[dict[str, int]] = []

    def phase(mode: str, n: int) -> None:
        settings = settings_for(db_url, mode=mode)
        with running(Runtime(settings, families.registry, backoff=FAST_BACKOFF)):
            for i in range(n):
                fam = "replica-work" if i % 3 else "replica-side"
                scope = f"{fam[8:]}-{i % 4}"
                accepted[(fam, scope)] = request(db_url, fam, scope)
            wait_for(
                lambda: all(handled(db_url, f, s) >= g for (f, s), g in accepted.items()),
                timeout=60,
                what=f"requests handled in {mode} mode",
            )
        generations.append({r.supervisor_key: r.generation for r in backend.lease_rows()})
        to = "dedicated" if mode == "global" else "global"
        switch_mode(settings_for(db_url, mode=to, http=False), to)
        generations.append({r.supervisor_key: r.generation for r in backend.lease_rows()})

    phase("global", 9)
    progress_1 = _snapshot(backend)[families.progress.name]
    phase("dedicated", 9)
    phase("global", 9)
    progress_3 = _snapshot(backend)[families.progress.name]
    # Progress only moved forward and nothing was redone.
    old = {r[0]: r[1] for r in progress_1}
    new = {r[0]: r[1] for r in progress_3}
    assert all(new[k] >= v for k, v in old.items())
    with backend.read() as conn:
        rows = families.read_journal(conn)
    assert families.duplicate_commits(rows) == []
    assert families.fencing_violations(rows) == []
    assert {r.supervisor_key for r in rows} == {
        "global",
        "artifact:replica-work",
        "artifact:replica-side",
    }
    # Generations never go backwards, and every switch advanced every existing key.
    for key in ("global", "artifact:replica-work", "artifact:replica-side"):
        seen = [g[key] for g in generations if key in g]
        assert seen == sorted(seen), (key, seen)
    for before_switch, after_switch in zip(generations[::2], generations[1::2], strict=True):
        assert all(after_switch[k] == g + 1 for k, g in before_switch.items())
    requested = sum(accepted.values())
    assert requested > 0
