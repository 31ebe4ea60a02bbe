"""Dedicated scale-out placement: balanced, stable, and deaf to a second handover under the same
membership (``apsup.supervisor.placement``)."""

from __future__ import annotations

import random
import statistics
from datetime import datetime, timedelta

from hypothesis import given
from hypothesis import strategies as st

from apsup.store.membership import Member
from apsup.supervisor.placement import Balancer, assign

names = st.text(alphabet="abcdefghijklmnopqrstuvwxyz-0123456789", min_size=1, max_size=12)


@given(st.sets(names, max_size=24), st.sets(names, min_size=1, max_size=8))
def test_every_replica_gets_floor_or_ceil_of_the_families(fams: set, reps: set) -> None:
    out = assign(fams, reps)
    assert set(out) == fams and set(out.values()) <= reps
    low, extra = divmod(len(fams), len(reps))
    loads = [sum(1 for r in out.values() if r == rep) for rep in reps]
    assert all(low <= n <= low + (1 if extra else 0) for n in loads), loads


@given(st.sets(names, max_size=16), st.lists(names, min_size=1, max_size=6, unique=True))
def test_the_answer_depends_on_the_sets_only(fams: set, reps: list) -> None:
    shuffled = list(reps)
    random.Random(len(reps)).shuffle(shuffled)
    assert assign(fams, reps) == assign(sorted(fams, reverse=True), shuffled)


def test_no_replica_no_placement_and_one_replica_takes_all() -> None:
    assert assign(["a", "b"], []) == {}
    assert assign(["a", "b", "c"], ["only"]) == {"a": "only", "b": "only", "c": "only"}


def test_a_join_or_a_leave_moves_about_k_over_r_families() -> None:
    """Mean movement over random names (R replicas before the change) stays within 1.5 x K/R;
    measured 1.0-1.5 x, the excess being families that follow a shifted floor/ceil cap."""
    rng = random.Random(7)
    for k, r in ((4, 2), (4, 3), (8, 3), (16, 4)):
        joins, leaves = [], []
        for _ in range(200):
            fams = [f"family-{rng.randrange(10**9)}" for _ in range(k)]
            reps = [f"host-{rng.randrange(10**9)}:{8080 + i}" for i in range(r)]
            before = assign(fams, reps)
            joined = assign(fams, [*reps, f"new-{rng.randrange(10**9)}"])
            left = assign(fams, reps[1:])
            joins.append(sum(before[f] != joined[f] for f in fams))
            leaves.append(sum(before[f] != left[f] for f in fams))
        assert statistics.mean(joins) <= 1.5 * k / r, (k, r, statistics.mean(joins))
        assert statistics.mean(leaves) <= 1.5 * k / r, (k, r, statistics.mean(leaves))


NOW = datetime(2026, 12, 4, 12, 0, 0)


def _rows(*spec: tuple[str, int, float]) -> list[Member]:
    """(replica, live processes, seconds since last seen) -> membership rows."""
    rows = []
    for replica, count, age in spec:
        for i in range(count):
            seen = NOW - timedelta(seconds=age)
            rows.append(
                Member(
                    f"{replica}-{i}",
                    replica,
                    "h",
                    1,
                    "0",
                    "background",
                    "dedicated",
                    None,
                    seen,
                    seen,
                )
            )
    return rows


def _balancer(me: str) -> Balancer:
    return Balancer(me, ["w", "x", "y", "z"], lease_seconds=3.0, refresh_seconds=1.5)


def test_a_replica_counts_once_every_family_process_of_it_is_live() -> None:
    b = _balancer("a")
    view = b.update(_rows(("a", 4, 0), ("b", 3, 0), ("c", 4, 9)), NOW, now=100.0)
    assert view.replicas == {"a"}  # b: a process missing; c: stale
    view = b.update(_rows(("a", 4, 0), ("b", 4, 1), ("c", 4, 9)), NOW, now=101.0)
    assert view.replicas == {"a", "b"}


def test_hand_over_once_per_membership_and_only_on_a_fresh_view() -> None:
    b = _balancer("a")
    b.update(_rows(("a", 4, 0), ("b", 4, 0)), NOW, now=100.0)
    expected = assign(["w", "x", "y", "z"], ["a", "b"])
    theirs = [f for f, r in expected.items() if r == "b"]
    mine = [f for f, r in expected.items() if r == "a"]
    key = f"artifact:{theirs[0]}"
    assert b.hand_over_to(key, now=100.5) == "b"
    assert b.hand_over_to(f"artifact:{mine[0]}", now=100.5) is None
    assert b.hand_over_to(key, now=104.0) is None  # view older than twice its refresh
    b.handed(key)
    b.update(_rows(("a", 4, 0), ("b", 4, 0)), NOW, now=105.0)
    assert b.hand_over_to(key, now=105.0) is None  # same membership: never twice
    b.update(_rows(("a", 4, 0), ("b", 4, 0), ("c", 4, 0)), NOW, now=106.0)
    again = assign(["w", "x", "y", "z"], ["a", "b", "c"])[theirs[0]]
    assert b.hand_over_to(key, now=106.0) == (None if again == "a" else again)
    # Back to the earlier membership: a new change, so the key may move again.
    b.update(_rows(("a", 4, 0), ("b", 4, 0)), NOW, now=107.0)
    assert b.hand_over_to(key, now=107.0) == "b"


def test_only_the_preferred_replica_claims_at_once_unless_the_holder_ran_out() -> None:
    placed = assign(["w", "x", "y", "z"], ["a", "b"])
    fam = next(f for f, r in placed.items() if r == "b")
    a = _balancer("a")
    a.update(_rows(("a", 4, 0), ("b", 4, 0)), NOW, now=100.0)
    assert not a.should_claim_now(f"artifact:{fam}")
    # b's Lease ran out unrenewed: b is gone for this decision, a is the only one left.
    assert a.should_claim_now(f"artifact:{fam}", last_holder="b-2")
    # An unknown holder (no membership row) changes nothing.
    assert not a.should_claim_now(f"artifact:{fam}", last_holder="someone")
    # No view yet: claim as a host without placement would.
    assert _balancer("a").should_claim_now(f"artifact:{fam}")


def test_replica_id_setting_is_checked_and_reported() -> None:
    import pytest

    from apsup.config import Settings
    from apsup.errors import ConfigError
    from apsup.registry import Registry

    prefix = Settings.default_prefix()
    ok = Settings.load(Registry(), env={prefix + "REPLICA_ID": "host-a:8080"})
    assert ok.replica_id == "host-a:8080"
    assert Settings.load(Registry(), env={}).replica_id is None
    with pytest.raises(ConfigError, match="REPLICA_ID"):
        Settings.load(Registry(), env={prefix + "REPLICA_ID": "has space"})


def test_a_replica_whose_lease_ran_out_is_no_candidate_until_it_is_seen_again() -> None:
    """Killed replicas keep live rows for two Leases: the survivor that took a family of one must
    not hand it back to it meanwhile (it moved twice after a kill in the scale-out test)."""
    placed = assign(["w", "x", "y", "z"], ["a", "b"])
    fam = next(f for f, r in placed.items() if r == "b")
    key = f"artifact:{fam}"
    a = _balancer("a")
    a.update(_rows(("a", 4, 0), ("b", 4, 1)), NOW, now=100.0)
    assert a.hand_over_to(key, now=100.0) == "b"  # b alive: the key is b's
    a.ran_out("b-2")  # a took b's Lease after it ran out unrenewed
    assert a.view is not None and a.view.replicas == {"a"}
    assert a.hand_over_to(key, now=100.5) is None
    # b's rows are still within their margin, but not refreshed since: still no candidate.
    a.update(_rows(("a", 4, 0), ("b", 4, 1)), NOW + timedelta(seconds=1), now=101.5)
    assert a.view.replicas == {"a"} and a.hand_over_to(key, now=101.5) is None
    # b refreshes again (it was cut off, not killed): a candidate again, and the key goes back.
    a.update(_rows(("a", 4, 0), ("b", 4, 0)), NOW + timedelta(seconds=2), now=102.5)
    assert a.view.replicas == {"a", "b"} and a.hand_over_to(key, now=102.5) == "b"
    # This host's own holders, and unknown ones, are never marked.
    a.ran_out("a-1")
    a.ran_out("someone")
    assert a.view.replicas == {"a", "b"}
