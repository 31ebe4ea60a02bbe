"""No "check the term in one transaction, write in another" anywhere (RFC §8).

(a) A Worker paused between a successful check (``ctx.fenced()``) and its business write, while
    its term is taken over, cannot commit: the write's own fenced transaction raises
    StaleTermError and nothing is written. A positive control shows that the forbidden pattern
    (check, then an unfenced write) would have committed.
(b) The check really is a lock held through commit: while a fenced transaction is open, a
    takeover/invalidation blocks until it commits (MySQL: the Lease row lock; SQLite: the
    database write lock taken by BEGIN IMMEDIATE), so the commit is ordered before the takeover.
(c) Statically: every Supervisor scheduling-control write (``scans.start_scan``, ``admit``,
    ``end_scan``, ``ensure_state``) in the code base is executed through ``run_fenced``.
"""

from __future__ import annotations

import ast
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import insert, select

from apsup.context import ExecutionContext
from apsup.errors import StaleTermError
from apsup.store import SqlBackend, intents
from apsup.store.leases import Term
from tests.replicas import families
from tests.replicas.cluster import REPO_ROOT, Cluster

pytestmark = [pytest.mark.timeout(120), pytest.mark.backends("sqlite", "mysql", "postgresql")]

CONTROL_WRITES = {"start_scan", "admit", "end_scan", "ensure_state"}


def _claim(backend: SqlBackend, holder: str) -> Term:
    term = backend.claim_term("global", holder, 30)
    assert term is not None
    return term


def _takeover(backend: SqlBackend) -> Term:
    """A legitimate replacement of the current term by another holder."""
    if backend.name != "sqlite":  # elected: invalidate, then take over
        backend.invalidate_terms(["global"])
    return _claim(backend, uuid.uuid4().hex)


def _ctx(backend: SqlBackend, term: Term, scope: str) -> ExecutionContext:
    with backend.transaction() as conn:
        families.work.request(conn, scope)
    with backend.read() as conn:
        row = intents.get(conn, families.work.binding_name, scope)
    assert row is not None
    return ExecutionContext(
        binding_name=families.work.binding_name,
        artifact_family=families.work.name,
        scope_id=scope,
        claimed_request_generation=row.requested_generation,
        supervisor_key=term.supervisor_key,
        holder_id=term.holder_id,
        supervisor_generation=term.generation,
        worker_id="paused-worker",
        pending_sequence=row.pending_sequence,
        entry_point=families.work.entry_point,
        database_url=backend.url,
    )


def _progress(backend: SqlBackend) -> list[Any]:
    with backend.read() as conn:
        return list(conn.execute(select(families.progress)))


# -- (a) ---------------------------------------------------------------------------------------


def test_paused_worker_cannot_commit_after_a_takeover(backend: SqlBackend, db_url: str) -> None:
    Cluster.prepare(db_url)
    term = _claim(backend, "old-holder")
    ctx = _ctx(backend, term, "s")
    with ctx.fenced() as conn:  # the check: the term is valid now
        snapshot = conn.execute(select(families.progress)).all()
    assert snapshot == []
    new = _takeover(backend)  # ... the Worker is paused here while leadership changes ...
    assert new.generation > term.generation
    with pytest.raises(StaleTermError), ctx.fenced() as conn:
        conn.execute(insert(families.progress).values(scope_id="s", version=1, last_g=1))
    assert _progress(backend) == []  # nothing written
    with pytest.raises(StaleTermError), ctx.fenced() as conn:  # nor its acknowledgment
        ctx.acknowledge(conn)
    with backend.read() as conn:
        row = intents.get(conn, families.work.binding_name, "s")
    assert row is not None and row.handled_generation == 0


def test_positive_control_check_then_unfenced_write_would_commit(
    backend: SqlBackend, db_url: str
) -> None:
    """What the forbidden pattern does: the check passes, the later unfenced write commits
    although the term was replaced in between. This is why every write is fenced."""
    Cluster.prepare(db_url)
    term = _claim(backend, "old-holder")
    with backend.fenced(term):
        pass  # check in one transaction ...
    _takeover(backend)
    with backend.transaction() as conn:  # ... write in another: nothing stops it
        conn.execute(insert(families.progress).values(scope_id="s", version=1, last_g=1))
    assert len(_progress(backend)) == 1


# -- (b) ---------------------------------------------------------------------------------------


def test_takeover_waits_for_an_open_fenced_transaction(backend: SqlBackend, db_url: str) -> None:
    Cluster.prepare(db_url)
    term = _claim(backend, "old-holder")
    ctx = _ctx(backend, term, "s")
    inside, release = threading.Event(), threading.Event()
    order: list[str] = []

    def worker() -> None:
        with ctx.fenced() as conn:
            conn.execute(insert(families.progress).values(scope_id="s", version=1, last_g=1))
            inside.set()
            assert release.wait(20)
            order.append("worker-commit")
        order.append("worker-committed")

    def taker() -> None:
        _takeover(backend)
        order.append("takeover-done")

    w = threading.Thread(target=worker, daemon=True)
    w.start()
    assert inside.wait(10)
    t = threading.Thread(target=taker, daemon=True)
    t.start()
    time.sleep(1.5)
    # MySQL: blocked on the Lease row lock; SQLite: waiting for the database write lock.
    assert order == [] and t.is_alive(), "the takeover did not wait for the fenced transaction"
    release.set()
    w.join(15)
    t.join(15)
    assert order[:2] == ["worker-commit", "worker-committed"]
    assert order[2] == "takeover-done"
    assert len(_progress(backend)) == 1  # committed before the takeover, legitimately
    with pytest.raises(StaleTermError), ctx.fenced():
        pass  # and never again after it


# -- (c) ---------------------------------------------------------------------------------------


def _control_write_sites(tree: ast.AST) -> list[ast.Call]:
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in CONTROL_WRITES
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "scans"
    ]


def _is_run_fenced(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "run_fenced"
    )


def _names(arg: ast.AST, name: str) -> bool:
    """``arg`` is the function ``name`` itself, or ``functools.partial(name, ...)`` of it."""
    if isinstance(arg, ast.Name):
        return arg.id == name
    return (
        isinstance(arg, ast.Call)
        and isinstance(arg.func, ast.Attribute | ast.Name)
        and (arg.func.attr if isinstance(arg.func, ast.Attribute) else arg.func.id) == "partial"
        and bool(arg.args)
        and isinstance(arg.args[0], ast.Name)
        and arg.args[0].id == name
    )


def _fenced_reason(call: ast.Call, parents: dict[ast.AST, ast.AST]) -> str | None:
    """Why ``call`` runs inside run_fenced, or None if it does not."""
    node: ast.AST = call
    while node in parents:
        parent = parents[node]
        if isinstance(node, ast.Lambda):
            return "lambda passed to run_fenced" if _is_run_fenced(parent) else None
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            scope = parents.get(node)
            name = node.name
            for other in ast.walk(scope) if scope is not None else []:
                if _is_run_fenced(other) and any(
                    _names(a, name)
                    for a in [*other.args, *(k.value for k in other.keywords)]  # type: ignore[attr-defined]
                ):
                    return f"function {name!r} passed to run_fenced"
            return None
        node = parent
    return None


def test_every_supervisor_control_write_goes_through_run_fenced() -> None:
    roots = [REPO_ROOT / "apsup", REPO_ROOT / "workers", REPO_ROOT / "families"]
    sites: list[str] = []
    problems: list[str] = []
    for root in roots:
        for path in sorted(Path(root).rglob("*.py")):
            if path.parent.name == "store" and path.name == "scans.py":
                continue  # the definitions themselves
            tree = ast.parse(path.read_text(), str(path))
            parents = {
                child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)
            }
            for call in _control_write_sites(tree):
                where = f"{path.relative_to(REPO_ROOT)}:{call.lineno} scans.{call.func.attr}"  # type: ignore[attr-defined]
                reason = _fenced_reason(call, parents)
                if reason is None:
                    problems.append(where)
                else:
                    sites.append(f"{where} ({reason})")
    assert problems == [], f"control writes outside run_fenced: {problems}"
    found = {s.split(" scans.", 1)[1].split()[0] for s in sites}
    assert found == CONTROL_WRITES, sites  # the check is not vacuous


def test_the_static_check_flags_an_unfenced_control_write() -> None:
    """Positive control for (c)."""
    source = (
        "def f(backend, term, c):\n"
        "    backend.run_fenced(term, lambda conn: scans.admit(conn, 'b', 's', 1))\n"
        "    with backend.transaction() as conn:\n"
        "        scans.end_scan(conn, 'b', 1)\n"
        "    def load(conn):\n"
        "        return scans.ensure_state(conn, 'b')\n"
        "    backend.run_fenced(term, load)\n"
    )
    tree = ast.parse(source)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    verdict = {
        c.func.attr: _fenced_reason(c, parents)  # type: ignore[attr-defined]
        for c in _control_write_sites(tree)
    }
    assert verdict["admit"] and verdict["ensure_state"]
    assert verdict["end_scan"] is None
