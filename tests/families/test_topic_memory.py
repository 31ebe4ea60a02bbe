"""Topic Memory's own business guarantees, without the Supervisor (RFC acceptance 3, 4, 9, 14).

The processor is called in-process with an ExecutionContext under a real term on both backends.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
from sqlalchemy import delete, func, insert, select

from apsup.errors import ProgressConflict, StaleTermError
from apsup.families import topic_memory as tm
from apsup.families._common import SourceFailure
from apsup.testing import (
    SimulatedCrash,
    claim_term,
    crashing,
    intent,
    make_context,
)

FAM = tm.FAMILY
SECRET = "SECRET-BODY-do-not-log"


def append(backend: Any, scope: str, *bodies: str) -> list[int]:
    with backend.transaction() as conn:
        return [tm.append_source(conn, scope, b) for b in bodies]


def request(backend: Any, scope: str) -> str:
    with backend.transaction() as conn:
        return tm.flush(conn, scope)


def revisions(backend: Any, scope: str) -> list[dict[str, Any]]:
    with backend.read() as conn:
        return tm.list_revisions(conn, scope)


def cursor(backend: Any, scope: str) -> tm.Cursor:
    with backend.read() as conn:
        cur = tm.read_cursor(conn, scope)
    assert cur is not None
    return cur


def settings(sources: int = 50, windows: int = 4) -> dict[str, str]:
    return {
        "TOPIC_MEMORY_WINDOW_SOURCES": str(sources),
        "TOPIC_MEMORY_WINDOWS_PER_INVOCATION": str(windows),
    }


def test_append_marks_dirty_and_flush_accepts_only_uncovered_work(backend: Any) -> None:
    assert request(backend, "s") == "idle"
    assert intent(backend, FAM, "s") is None  # idle writes nothing
    assert append(backend, "s", "a", "b") == [1, 2]
    row = intent(backend, FAM, "s")
    assert row is not None and row.dirty_generation == 2 and row.requested_generation == 0
    assert request(backend, "s") == "accepted"
    assert request(backend, "s") == "accepted"  # coalescible: requested advances again
    row = intent(backend, FAM, "s")
    assert row is not None and row.requested_generation == 2


def test_processor_folds_sources_in_order_and_acknowledges(backend: Any) -> None:
    append(backend, "s", "a", "b", "c")
    request(backend, "s")
    term = claim_term(backend)
    ctx = make_context(backend, FAM, "s", term, settings=settings(sources=2))
    FAM(ctx.scope_id, ctx)
    revs = revisions(backend, "s")
    assert [(r["revision"], r["source_from"], r["source_through"]) for r in revs] == [
        (1, 1, 2),
        (2, 3, 3),
    ]
    assert all(r["supervisor_generation"] == term.generation for r in revs)
    assert cursor(backend, "s").source_through == 3
    assert cursor(backend, "s").head_revision == 2
    row = intent(backend, FAM, "s")
    assert row is not None
    assert row.handled_generation == row.requested_generation == 1
    assert row.clean_generation == row.dirty_generation == 3
    assert request(backend, "s") == "idle"
    # Deterministic: the same journal gives the same summaries.
    assert revs[0]["summary"] == tm.digest(["a", "b"]) and len(revs[1]["summary"]) == 64


def test_partial_invocation_leaves_ordinary_remaining_work(backend: Any) -> None:
    """Acceptance 4: one bounded window, acknowledged, remaining work stays dirty."""
    append(backend, "s", *[f"m{i}" for i in range(5)])
    request(backend, "s")
    ctx = make_context(
        backend, FAM, "s", claim_term(backend), settings=settings(sources=2, windows=1)
    )
    FAM("s", ctx)
    row = intent(backend, FAM, "s")
    assert row is not None and row.handled_generation == 1
    assert row.dirty_generation > row.clean_generation  # not drained: not clean
    assert cursor(backend, "s").source_through == 2


def test_byte_bound_window_takes_at_least_one_source(backend: Any) -> None:
    append(backend, "s", "x" * 100, "y" * 100, "z")
    request(backend, "s")
    ctx = make_context(
        backend,
        FAM,
        "s",
        claim_term(backend),
        settings={"TOPIC_MEMORY_WINDOW_BYTES": "50", "TOPIC_MEMORY_WINDOWS_PER_INVOCATION": "9"},
    )
    FAM("s", ctx)
    assert [(r["source_from"], r["source_through"]) for r in revisions(backend, "s")] == [
        (1, 1),
        (2, 2),
        (3, 3),
    ]


def test_failing_position_is_never_overtaken(backend: Any) -> None:
    """Acceptance 3: B2 never overtakes a persistently failing B1; A keeps progressing."""
    append(backend, "B", "b1", "b2", "b3", "b4")
    append(backend, "A", "a1")
    with backend.transaction() as conn:
        conn.execute(insert(tm.topic_poison).values(scope_id="B", position=3))
    request(backend, "B")
    request(backend, "A")
    term = claim_term(backend)
    for _ in range(2):  # the retry fails the same way, at the same place
        ctx = make_context(backend, FAM, "B", term, settings=settings(sources=10))
        with pytest.raises(SourceFailure) as err:
            FAM("B", ctx)
        assert err.value.position == 3
        assert cursor(backend, "B").source_through == 2
        row = intent(backend, FAM, "B")
        assert row is not None and row.handled_generation == 0  # failure does not acknowledge
    assert [r["source_through"] for r in revisions(backend, "B")] == [2]
    # Another Scope is unaffected.
    FAM("A", make_context(backend, FAM, "A", term))
    assert cursor(backend, "A").source_through == 1
    # Once the position is repaired, the retry resumes exactly there.
    with backend.transaction() as conn:
        conn.execute(delete(tm.topic_poison))
    FAM("B", make_context(backend, FAM, "B", term))
    assert [(r["source_from"], r["source_through"]) for r in revisions(backend, "B")] == [
        (1, 2),
        (3, 4),
    ]
    row = intent(backend, FAM, "B")
    assert row is not None and row.handled_generation == 1 and not row.dirty


def test_failing_first_position_commits_nothing(backend: Any) -> None:
    append(backend, "s", "p1", "p2")
    with backend.transaction() as conn:
        conn.execute(insert(tm.topic_poison).values(scope_id="s", position=1))
    request(backend, "s")
    with pytest.raises(SourceFailure):
        FAM("s", make_context(backend, FAM, "s", claim_term(backend)))
    assert revisions(backend, "s") == []
    assert cursor(backend, "s").source_through == 0


def test_duplicate_invocation_of_handled_generation_consumes_nothing(backend: Any) -> None:
    """Acceptance 9: a duplicate of an acknowledged G consumes no new input."""
    append(backend, "s", "a")
    request(backend, "s")
    term = claim_term(backend)
    ctx = make_context(backend, FAM, "s", term)
    FAM("s", ctx)
    append(backend, "s", "b")  # new input after the acknowledgment
    dup = make_context(backend, FAM, "s", term, generation=1)
    assert dup.already_handled()
    FAM("s", dup)
    assert len(revisions(backend, "s")) == 1
    assert cursor(backend, "s").source_through == 1
    row = intent(backend, FAM, "s")
    assert row is not None and row.dirty  # the new Source waits for a new invocation


def test_stale_term_commit_fails_atomically(backend: Any) -> None:
    """Acceptance 10: an old term's commit writes nothing (no revision, cursor, ack, clean)."""
    append(backend, "s", "a", "b")
    request(backend, "s")
    old = claim_term(backend)
    ctx = make_context(backend, FAM, "s", old)
    backend.invalidate_terms(["global"])  # leadership changed before the Worker committed
    claim_term(backend)
    with pytest.raises(StaleTermError):
        FAM("s", ctx)
    assert revisions(backend, "s") == []
    cur = cursor(backend, "s")
    assert (cur.source_through, cur.head_revision) == (0, 0)
    row = intent(backend, FAM, "s")
    assert row is not None
    assert (row.handled_generation, row.clean_generation) == (0, 0)


def test_crash_between_business_commit_and_ack_resumes_without_duplicates(backend: Any) -> None:
    """Acceptance 9: failure after partial legitimate commits recovers from business progress."""
    append(backend, "s", *[f"m{i}" for i in range(6)])
    request(backend, "s")
    term = claim_term(backend)
    ctx = make_context(backend, FAM, "s", term, settings=settings(sources=2, windows=3))
    with pytest.raises(SimulatedCrash):
        FAM("s", crashing(ctx, after=1))
    assert [r["source_through"] for r in revisions(backend, "s")] == [2]
    row = intent(backend, FAM, "s")
    assert row is not None and row.handled_generation == 0  # not acknowledged
    # The retry (same G, possibly a new term) resumes from the durable cursor.
    retry = make_context(backend, FAM, "s", claim_term(backend), settings=settings(2, 3))
    FAM("s", retry)
    revs = revisions(backend, "s")
    assert [(r["revision"], r["source_from"], r["source_through"]) for r in revs] == [
        (1, 1, 2),
        (2, 3, 4),
        (3, 5, 6),
    ]
    row = intent(backend, FAM, "s")
    assert row is not None and row.handled_generation == 1 and not row.dirty


def test_concurrent_head_move_raises_progress_conflict(
    backend: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two invocations race on one Scope: the Head CAS lets exactly one commit."""
    append(backend, "s", "a", "b")
    request(backend, "s")
    request(backend, "s")
    term = claim_term(backend)
    loser = make_context(backend, FAM, "s", term, generation=1)
    winner = make_context(backend, FAM, "s", term, generation=2)
    real = tm._select_window
    raced = {"done": False}

    def racing_select(*args: Any, **kwargs: Any) -> Any:
        result = real(*args, **kwargs)
        if not raced["done"]:
            raced["done"] = True  # the winner commits between the loser's snapshot and CAS
            FAM("s", winner)
        return result

    monkeypatch.setattr(tm, "_select_window", racing_select)
    with pytest.raises(ProgressConflict):
        FAM("s", loser)
    revs = revisions(backend, "s")
    assert [(r["revision"], r["source_through"]) for r in revs] == [(1, 2)]  # loser wrote nothing
    row = intent(backend, FAM, "s")
    assert row is not None and row.handled_generation == 2


def test_source_arriving_during_processing_is_not_swallowed(
    backend: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """mark_clean acknowledges only the snapshot's dirty generation."""
    append(backend, "s", "a")
    request(backend, "s")
    real = tm._select_window

    def select_then_append(*args: Any, **kwargs: Any) -> Any:
        result = real(*args, **kwargs)
        append(backend, "s", "late")
        return result

    monkeypatch.setattr(tm, "_select_window", select_then_append)
    FAM("s", make_context(backend, FAM, "s", claim_term(backend)))
    row = intent(backend, FAM, "s")
    assert row is not None and row.handled_generation == 1
    assert row.dirty  # the late Source keeps the Scope dirty
    assert cursor(backend, "s").source_through == 1


def test_source_bodies_never_reach_logs_or_errors(
    backend: Any, caplog: pytest.LogCaptureFixture
) -> None:
    append(backend, "s", SECRET, SECRET + "2")
    with backend.transaction() as conn:
        conn.execute(insert(tm.topic_poison).values(scope_id="s", position=2))
    request(backend, "s")
    caplog.set_level(logging.DEBUG)
    with pytest.raises(SourceFailure) as err:
        FAM("s", make_context(backend, FAM, "s", claim_term(backend)))
    assert SECRET not in str(err.value) and SECRET not in repr(err.value)
    assert SECRET not in caplog.text
    assert "sources=1..1" in caplog.text  # processors log domain fields such as ranges


def test_reconciler_marks_dirty_from_domain_facts_and_never_requests(backend: Any) -> None:
    """RFC §11: remaining work without a Pending record is rebuilt as ordinary dirty state."""
    with backend.transaction() as conn:  # journals written without intents (pre-migration)
        for i in range(5):
            conn.execute(insert(tm.topic_cursors).values(scope_id=f"s{i}", source_head=2))
            for p in (1, 2):
                conn.execute(
                    insert(tm.topic_sources).values(scope_id=f"s{i}", position=p, body="x")
                )
        conn.execute(
            insert(tm.topic_cursors).values(scope_id="done", source_head=1, source_through=1)
        )
    reconcile = FAM.reconcile
    assert reconcile is not None
    old_page = tm.RECONCILE_PAGE
    tm.RECONCILE_PAGE = 2  # several pages
    try:
        token: Any = None
        pages = 0
        while True:
            with backend.transaction() as conn:
                token = reconcile(conn, FAM, token)
            pages += 1
            if token is None:
                break
    finally:
        tm.RECONCILE_PAGE = old_page
    assert pages == 3
    for i in range(5):
        row = intent(backend, FAM, f"s{i}")
        assert row is not None and row.dirty and row.requested_generation == 0
    assert intent(backend, FAM, "done") is None
    # Idempotent: a second pass does not advance dirty again for already-dirty Scopes.
    with backend.transaction() as conn:
        reconcile(conn, FAM, None)
    row = intent(backend, FAM, "s0")
    assert row is not None and row.dirty_generation == 1
    with backend.read() as conn:
        assert conn.execute(select(func.count()).select_from(tm.topic_revisions)).scalar_one() == 0
