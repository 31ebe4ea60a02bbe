"""Profile's own business guarantees without the Supervisor: one Candidate per cron fire even
across restarts, the Review boundary, the Policy, and the background Principal's authorization
boundary (acceptance 13, 14)."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

import pytest

from apsup.errors import StaleTermError
from apsup.families import profile as pf
from apsup.families._common import AuthorizationDenied, DomainError
from apsup.policy import Cron
from apsup.store import scans
from apsup.testing import (
    SimulatedCrash,
    claim_term,
    crashing,
    intent,
    make_context,
)

FAM = pf.FAMILY
FIRE1 = datetime(2026, 12, 1, 18, 0)  # 02:00 Asia/Shanghai on Dec 2
FIRE2 = FIRE1 + timedelta(days=1)


def add(backend: Any, scope: str, *bodies: str) -> None:
    with backend.transaction() as conn:
        for b in bodies:
            pf.add_source(conn, scope, b)


def admit(backend: Any, scope: str, fire: datetime | None = None) -> int:
    """A cron admission: the checkpoint records the fire, the Scope gets requested + 1."""
    with backend.transaction() as conn:
        if fire is not None:
            scans.set_checkpoint(conn, FAM.binding_name, fire)
        return FAM.request(conn, scope)


def run(backend: Any, scope: str, term: Any = None, **kw: Any) -> None:
    FAM(scope, make_context(backend, FAM, scope, term or claim_term(backend), **kw))


def cands(backend: Any, scope: str) -> list[dict[str, Any]]:
    with backend.read() as conn:
        return pf.candidates(conn, scope)


def test_cron_policy_is_preserved() -> None:
    assert FAM.policy == Cron("0 2 * * *", "Asia/Shanghai")
    assert (FAM.max_workers, FAM.timeout) == (4, 600)


def test_fire_produces_one_pending_candidate_and_publishes_nothing(backend: Any) -> None:
    add(backend, "s", "likes tea", "lives in Hangzhou")
    g = admit(backend, "s", FIRE1)
    term = claim_term(backend)
    run(backend, "s", term)
    [c] = cands(backend, "s")
    assert c["status"] == pf.PENDING and c["cron_fire"] == FIRE1
    assert (c["source_from"], c["source_through"]) == (1, 2)
    assert c["supervisor_generation"] == term.generation
    with backend.read() as conn:
        assert pf.published(conn, "s") is None  # a Candidate is not a publication
    row = intent(backend, FAM, "s")
    assert row is not None and row.handled_generation == g and not row.dirty


def test_one_fire_never_yields_two_candidates_across_restarts(backend: Any) -> None:
    add(backend, "s", "a")
    admit(backend, "s", FIRE1)
    with pytest.raises(SimulatedCrash):  # committed, then the Worker died before reporting
        FAM("s", crashing(make_context(backend, FAM, "s", claim_term(backend)), after=1))
    run(backend, "s", generation=1)  # redelivery of the same G after a restart
    [c] = cands(backend, "s")
    with backend.transaction() as conn:
        pf.review(conn, c["candidate_id"], approve=True)
    add(backend, "s", "b")
    admit(backend, "s")  # explicit/duplicate admission within the same fire
    run(backend, "s")  # new term, new G: the fire is spent
    assert len(cands(backend, "s")) == 1
    row = intent(backend, FAM, "s")
    assert row is not None and row.dirty  # "b" waits for the next fire
    assert row.handled_generation == row.requested_generation
    admit(backend, "s", FIRE2)
    run(backend, "s")
    assert [
        (c["cron_fire"], c["source_from"], c["source_through"]) for c in cands(backend, "s")
    ] == [
        (FIRE1, 1, 1),
        (FIRE2, 2, 2),
    ]


def test_review_boundary(backend: Any) -> None:
    add(backend, "s", "a")
    admit(backend, "s", FIRE1)
    run(backend, "s")
    [c] = cands(backend, "s")
    with backend.transaction() as conn:
        assert pf.review(conn, c["candidate_id"], approve=False) == pf.REJECTED
    with backend.transaction() as conn:
        assert pf.published(conn, "s") is None  # rejected: nothing published
        assert pf.review(conn, c["candidate_id"], approve=False) == pf.REJECTED  # idempotent
        with pytest.raises(DomainError):
            pf.review(conn, c["candidate_id"], approve=True)  # decided already
        with pytest.raises(DomainError):
            pf.review(conn, "missing", approve=True)
    add(backend, "s", "b")
    admit(backend, "s", FIRE2)
    run(backend, "s")
    c2 = cands(backend, "s")[-1]
    with backend.transaction() as conn:
        assert pf.review(conn, c2["candidate_id"], approve=True) == pf.APPROVED
    with backend.read() as conn:
        pub = pf.published(conn, "s")
    assert pub == {"version": 1, "candidate_id": c2["candidate_id"], "content": c2["content"]}


def test_pending_candidate_blocks_generation_until_review_redirties(backend: Any) -> None:
    add(backend, "s", "a")
    admit(backend, "s", FIRE1)
    run(backend, "s")
    add(backend, "s", "b")
    admit(backend, "s", FIRE2)
    run(backend, "s")  # the FIRE1 Candidate still awaits Review: nothing new
    assert len(cands(backend, "s")) == 1
    row = intent(backend, FAM, "s")
    assert row is not None and not row.dirty
    with backend.transaction() as conn:
        pf.review(conn, cands(backend, "s")[0]["candidate_id"], approve=True)
    row = intent(backend, FAM, "s")
    assert row is not None and row.dirty  # Review re-marks the waiting Source: none is lost
    admit(backend, "s")
    run(backend, "s")
    assert [(c["source_from"], c["source_through"]) for c in cands(backend, "s")] == [
        (1, 1),
        (2, 2),
    ]


def test_authorization_denial_fails_only_that_scope(backend: Any) -> None:
    add(backend, "denied", "x")
    add(backend, "ok", "y")
    with backend.transaction() as conn:
        pf.set_access(conn, "denied", allowed=False)
    admit(backend, "denied", FIRE1)
    admit(backend, "ok")
    term = claim_term(backend)
    with pytest.raises(AuthorizationDenied):
        run(backend, "denied", term)
    run(backend, "ok", term)
    assert cands(backend, "denied") == [] and len(cands(backend, "ok")) == 1
    row = intent(backend, FAM, "denied")
    assert row is not None and row.handled_generation == 0 and row.dirty  # retried later
    with backend.transaction() as conn:
        pf.set_access(conn, "denied", allowed=True)
    run(backend, "denied", term)
    assert len(cands(backend, "denied")) == 1


def test_disabled_policy_generates_nothing_and_reenable_restores_work(backend: Any) -> None:
    add(backend, "s", "a")
    with backend.transaction() as conn:
        pf.set_policy(conn, "s", enabled=False)
    admit(backend, "s", FIRE1)
    run(backend, "s")
    assert cands(backend, "s") == []
    row = intent(backend, FAM, "s")
    assert row is not None and not row.dirty and row.handled_generation == 1
    with backend.transaction() as conn:
        pf.set_policy(conn, "s", enabled=True)
    row = intent(backend, FAM, "s")
    assert row is not None and row.dirty  # the Source was not lost


def test_stale_term_writes_nothing(backend: Any) -> None:
    add(backend, "s", "a")
    admit(backend, "s", FIRE1)
    ctx = make_context(backend, FAM, "s", claim_term(backend))
    backend.invalidate_terms(["global"])
    with pytest.raises(StaleTermError):
        FAM("s", ctx)
    assert cands(backend, "s") == []
    with backend.read() as conn:
        cur = pf.read_cursor(conn, "s")
    assert cur is not None and cur.source_through == 0 and cur.last_fire is None


def test_without_checkpoint_the_fire_is_the_latest_cron_fire(backend: Any) -> None:
    add(backend, "s", "a")
    admit(backend, "s")
    before = backend.now()
    run(backend, "s")
    policy = FAM.policy
    assert isinstance(policy, Cron)
    expected = {
        policy.latest_fire_at_or_before(before),
        policy.latest_fire_at_or_before(backend.now()),
    }
    [c] = cands(backend, "s")
    assert c["cron_fire"] in expected
