"""Handoff's own business guarantees without the Supervisor: explicit requests only, one report
per requested generation (idempotent), the authorization boundary at acceptance (acceptance 14)."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import func, select

from apsup.errors import StaleTermError
from apsup.families import handoff as ho
from apsup.families._common import AuthorizationDenied, DomainError
from apsup.policy import Disabled
from apsup.testing import (
    SimulatedCrash,
    claim_term,
    crashing,
    intent,
    make_context,
)

FAM = ho.FAMILY


def ask(backend: Any, scope: str, ref: str, **kw: Any) -> int:
    with backend.transaction() as conn:
        return ho.request_handoff(conn, scope, ref, **kw)


def reports(backend: Any, scope: str) -> list[tuple[int, str]]:
    with backend.read() as conn:
        return [(r["request_generation"], r["payload_ref"]) for r in ho.reports(conn, scope)]


def count(backend: Any, table: Any) -> int:
    with backend.read() as conn:
        return int(conn.execute(select(func.count()).select_from(table)).scalar_one())


def test_automatic_admission_is_disabled() -> None:
    assert FAM.policy == Disabled()
    assert FAM.reconcile is None  # nothing to rebuild: Handoff has no ordinary dirty work


def test_request_stores_reference_and_intent_together(backend: Any) -> None:
    assert ask(backend, "s", "blob://1") == 1
    assert ask(backend, "s", "blob://2") == 2
    row = intent(backend, FAM, "s")
    assert row is not None and row.requested_generation == 2 and row.dirty_generation == 0
    # A caller transaction that rolls back leaves neither the reference nor the intent.
    with pytest.raises(RuntimeError), backend.transaction() as conn:
        ho.request_handoff(conn, "t", "blob://3")
        raise RuntimeError("caller aborted")
    assert intent(backend, FAM, "t") is None
    assert count(backend, ho.handoff_requests) == 2


def test_one_report_per_requested_generation_idempotently(backend: Any) -> None:
    ask(backend, "s", "blob://1")
    ask(backend, "s", "blob://2")
    term = claim_term(backend)
    ctx = make_context(backend, FAM, "s", term)  # coalesced: carries G = 2
    ask(backend, "s", "blob://3")  # arrives while the invocation runs
    FAM("s", ctx)
    assert reports(backend, "s") == [(1, "blob://1"), (2, "blob://2")]
    row = intent(backend, FAM, "s")
    assert row is not None and row.handled_generation == 2 and row.requested_generation == 3
    FAM("s", make_context(backend, FAM, "s", term, generation=2))  # duplicate of G = 2
    assert len(reports(backend, "s")) == 2
    FAM("s", make_context(backend, FAM, "s", term))  # the successor invocation, G = 3
    assert reports(backend, "s")[-1] == (3, "blob://3")
    with backend.read() as conn:
        assert {r["supervisor_generation"] for r in ho.reports(conn, "s")} == {term.generation}


def test_crash_between_report_commit_and_ack_does_not_duplicate(backend: Any) -> None:
    for i in range(5):
        ask(backend, "s", f"blob://{i}")
    settings = {"HANDOFF_PAGE": "2"}  # three short transactions; the last acknowledges
    with pytest.raises(SimulatedCrash):
        FAM("s", crashing(make_context(backend, FAM, "s", claim_term(backend), settings=settings)))
    assert len(reports(backend, "s")) == 2
    row = intent(backend, FAM, "s")
    assert row is not None and row.handled_generation == 0
    FAM("s", make_context(backend, FAM, "s", claim_term(backend), settings=settings))
    assert [g for g, _ in reports(backend, "s")] == [1, 2, 3, 4, 5]
    row = intent(backend, FAM, "s")
    assert row is not None and row.handled_generation == 5


def test_authorization_boundary_at_acceptance(backend: Any) -> None:
    with pytest.raises(AuthorizationDenied):
        ask(backend, "s", "blob://1", principal="mallory")  # deny by default
    with backend.transaction() as conn:
        ho.grant(conn, "s", "alice")
        ho.grant(conn, "s", "bob", allowed=False)
    with pytest.raises(AuthorizationDenied):
        ask(backend, "s", "blob://1", principal="bob")
    assert intent(backend, FAM, "s") is None  # a denial accepts nothing
    assert count(backend, ho.handoff_requests) == 0
    assert ask(backend, "s", "blob://1", principal="alice") == 1
    with pytest.raises(AuthorizationDenied):
        ask(backend, "other", "blob://x", principal="alice")  # grants are per Scope


def test_a_grant_names_exactly_one_principal(backend: Any) -> None:
    """MySQL's default collation folds case and pads spaces: a grant to ``alice`` used to admit
    ``Alice`` and ``"alice "``, and ``Bob``'s denial shadowed ``bob``'s grant."""
    with backend.transaction() as conn:
        ho.grant(conn, "s", "alice")
        ho.grant(conn, "s", "Bob", allowed=False)
        ho.grant(conn, "s", "bob")  # a second principal, not an update of Bob's row
    for other in ("Alice", "ALICE", "alice ", "Bob"):
        with pytest.raises(AuthorizationDenied):
            ask(backend, "s", "blob://1", principal=other)
    assert count(backend, ho.handoff_requests) == 0
    assert ask(backend, "s", "blob://1", principal="alice") == 1
    assert ask(backend, "s", "blob://2", principal="bob") == 2


def test_invalid_reference_is_rejected(backend: Any) -> None:
    with pytest.raises(DomainError):
        ask(backend, "s", "")
    with pytest.raises(DomainError):
        ask(backend, "s", "x" * 1000)


def test_stale_term_writes_nothing(backend: Any) -> None:
    ask(backend, "s", "blob://1")
    ctx = make_context(backend, FAM, "s", claim_term(backend))
    backend.invalidate_terms(["global"])
    with pytest.raises(StaleTermError):
        FAM("s", ctx)
    assert reports(backend, "s") == []
    row = intent(backend, FAM, "s")
    assert row is not None and row.handled_generation == 0
