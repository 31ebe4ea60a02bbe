"""Experience's own business guarantees without the Supervisor: bounded partial progress,
clean only when drained, idempotent repeated invocations, fenced commits (acceptance 4, 9, 14)."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import insert

from apsup.errors import ProgressConflict, StaleTermError
from apsup.families import experience as ex
from apsup.testing import (
    SimulatedCrash,
    claim_term,
    crashing,
    intent,
    make_context,
)

FAM = ex.FAMILY
K = {"EXPERIENCE_BATCH_ITEMS": "20"}


def record(backend: Any, scope: str, n: int) -> list[int]:
    with backend.transaction() as conn:
        return [ex.record_item(conn, scope, f"item-{scope}-{i}") for i in range(n)]


def admit(backend: Any, scope: str) -> int:
    """What an automatic admission does durably: requested + 1."""
    with backend.transaction() as conn:
        return FAM.request(conn, scope)


def records(backend: Any, scope: str) -> list[tuple[int, int, int]]:
    with backend.read() as conn:
        return [
            (r["batch_no"], r["item_from"], r["item_through"]) for r in ex.list_records(conn, scope)
        ]


def test_consumes_at_most_k_items_per_invocation_and_cleans_only_when_drained(
    backend: Any,
) -> None:
    assert record(backend, "s", 45)[-1] == 45
    term = claim_term(backend)
    expected = [(1, 1, 20), (2, 21, 40), (3, 41, 45)]
    for n in range(1, 4):
        g = admit(backend, "s")
        FAM("s", make_context(backend, FAM, "s", term, settings=K))
        assert records(backend, "s") == expected[:n]
        row = intent(backend, FAM, "s")
        assert row is not None and row.handled_generation == g
        assert row.dirty == (n < 3)  # remaining work stays ordinary dirty state
    with backend.read() as conn:
        progress = ex.read_progress(conn, "s")
    assert progress is not None and progress.consumed_through == 45 and progress.batch_count == 3
    # Nothing left: a further invocation is a NOOP that only acknowledges.
    admit(backend, "s")
    FAM("s", make_context(backend, FAM, "s", term, settings=K))
    assert len(records(backend, "s")) == 3


def test_repeated_invocation_is_idempotent(backend: Any) -> None:
    record(backend, "s", 30)
    admit(backend, "s")
    term = claim_term(backend)
    ctx = make_context(backend, FAM, "s", term, settings=K)
    FAM("s", ctx)
    FAM("s", make_context(backend, FAM, "s", term, generation=1, settings=K))  # duplicate G
    assert records(backend, "s") == [(1, 1, 20)]


def test_crash_after_commit_then_retry_does_not_duplicate(backend: Any) -> None:
    record(backend, "s", 25)
    admit(backend, "s")
    term = claim_term(backend)
    with pytest.raises(SimulatedCrash):
        FAM("s", crashing(make_context(backend, FAM, "s", term, settings=K), after=1))
    # The batch and its acknowledgment committed together; the retry of G consumes nothing.
    FAM("s", make_context(backend, FAM, "s", claim_term(backend), generation=1, settings=K))
    assert records(backend, "s") == [(1, 1, 20)]
    # A later admission continues from durable progress.
    admit(backend, "s")
    FAM("s", make_context(backend, FAM, "s", claim_term(backend), settings=K))
    assert records(backend, "s") == [(1, 1, 20), (2, 21, 25)]


def test_concurrent_progress_raises_conflict_and_writes_nothing(
    backend: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    record(backend, "s", 30)
    admit(backend, "s")
    admit(backend, "s")
    term = claim_term(backend)
    loser = make_context(backend, FAM, "s", term, generation=1, settings=K)
    winner = make_context(backend, FAM, "s", term, generation=2, settings=K)
    real = ex.read_progress
    raced = {"done": False}

    def racing(conn: Any, scope_id: str) -> Any:
        result = real(conn, scope_id)
        if not raced["done"]:
            raced["done"] = True
            FAM("s", winner)
        return result

    monkeypatch.setattr(ex, "read_progress", racing)
    with pytest.raises(ProgressConflict):
        FAM("s", loser)
    assert records(backend, "s") == [(1, 1, 20)]
    row = intent(backend, FAM, "s")
    assert row is not None and row.handled_generation == 2


def test_stale_term_writes_nothing(backend: Any) -> None:
    record(backend, "s", 5)
    admit(backend, "s")
    ctx = make_context(backend, FAM, "s", claim_term(backend), settings=K)
    backend.invalidate_terms(["global"])
    with pytest.raises(StaleTermError):
        FAM("s", ctx)
    assert records(backend, "s") == []
    row = intent(backend, FAM, "s")
    assert row is not None and row.handled_generation == 0 and row.dirty


def test_reconciler_rebuilds_dirty_state_without_requesting(backend: Any) -> None:
    with backend.transaction() as conn:  # progress rows left without intents
        conn.execute(insert(ex.experience_progress).values(scope_id="a", item_head=3))
        conn.execute(
            insert(ex.experience_progress).values(scope_id="b", item_head=2, consumed_through=2)
        )
    reconcile = FAM.reconcile
    assert reconcile is not None
    with backend.transaction() as conn:
        assert reconcile(conn, FAM, None) is None
    a, b = intent(backend, FAM, "a"), intent(backend, FAM, "b")
    assert a is not None and a.dirty and a.requested_generation == 0
    assert b is None
