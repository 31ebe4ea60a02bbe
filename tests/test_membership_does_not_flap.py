"""Membership is refreshed on its own timer and judged with a margin: a replica that is late
once moves nothing, and a family moves at most once per real join or leave.

Two halves: a real host on MySQL refreshes its row at least three times per Lease whatever its
renewal interval, leader or standby; and a seeded simulation of whole deployments (3-5
replicas, 4-12 families, every refresh jittered, some replicas stalled once for up to a Lease)
drives the real judgment (``Member.alive``) and placement (``Balancer``) through every host's
view, and counts the moves.
"""

from __future__ import annotations

import bisect
import random
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import select

from apsup.store import membership, open_backend
from apsup.store.membership import Member
from apsup.store.schema import replicas
from apsup.supervisor.host import LeasePolicy
from apsup.supervisor.placement import Balancer, assign
from tests.liveness_families import live_work
from tests.liveness_support import live_host

LEASE = 3.0


def _member(holder: str, replica: str, seen: datetime) -> Member:
    return Member(holder, replica, "h", 1, "0", "background", "dedicated", None, seen, seen)


# -- the real host's cadence ------------------------------------------------------------------


@pytest.mark.backends("mysql")
@pytest.mark.parametrize("role", ["leader", "standby"])
def test_a_host_refreshes_its_row_several_times_per_lease(
    db_url: str, tmp_path: Path, role: str
) -> None:
    """Renewals every 1.9 s of a 3 s Lease used to carry the refresh: one per 1.9 s, so one
    late tick left the row older than the Lease. The refresh now has a timer of its own."""
    lease = LeasePolicy(LEASE, 1.9, 0.5, renew_deadline=2.5)
    with live_host(db_url, [live_work], tmp_path, lease=lease, start=False) as bundle:
        host = bundle.host
        if role == "standby":  # someone else leads: this host only competes
            other = open_backend(db_url)
            try:
                assert other.claim_term(host.supervisors[0].key, "elsewhere", 60) is not None
            finally:
                other.dispose()
        now = datetime.utcnow()
        host.member = _member(host.holder_id, "rep-under-test", now)
        host.start()
        seen: set[datetime] = set()
        stop = threading.Event()

        def watch() -> None:
            reader = open_backend(db_url)
            try:
                while not stop.is_set():
                    with reader.read() as conn:
                        row = conn.execute(
                            select(replicas.c.last_seen).where(
                                replicas.c.holder_id == host.holder_id
                            )
                        ).first()
                    if row is not None:
                        seen.add(row[0])
                    time.sleep(0.05)
            finally:
                reader.dispose()

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        t0 = time.monotonic()
        while time.monotonic() - t0 < 2 * LEASE:
            host.cycle(max_wait=0.2)
        stop.set()
        watcher.join(5)
        assert (host.supervisors[0].term is not None) == (role == "leader")
    # Four refreshes per Lease are scheduled: eight in two Leases; three per Lease at least.
    print(f"\n{role}: {len(seen)} distinct refreshes in {2 * LEASE:g} s")
    assert len(seen) >= 6, sorted(seen)


# -- whole deployments, simulated -------------------------------------------------------------


@dataclass
class _Replica:
    name: str
    processes: int
    joined_at: float
    left_at: float | None = None
    #: (start, end) of the one stall this replica suffers: no refresh inside it.
    stall: tuple[float, float] | None = None
    phase: float = 0.0
    last_seen: dict[int, float] = field(default_factory=dict)


def _simulate(seed: int) -> tuple[int, int, dict[str, int], list[str]]:
    """One deployment over 30 Leases: returns (real changes, hosts, worst moves per family
    seen by any host, problems)."""
    rng = random.Random(seed)
    fams = [f"fam-{i}" for i in range(rng.randint(4, 12))]
    count = rng.randint(3, 5)
    end = 30 * LEASE
    reps = [_Replica(f"rep-{i}", len(fams), 0.0, phase=rng.uniform(0, 1)) for i in range(count)]
    changes: list[float] = []
    shape = rng.choice(["steady", "join", "leave", "join+leave"])
    if "join" in shape:
        t = rng.uniform(8, 12) * LEASE
        reps.append(_Replica(f"rep-{count}", len(fams), t, phase=rng.uniform(0, 1)))
        changes.append(t)
    if "leave" in shape:
        t = rng.uniform(16, 20) * LEASE
        rng.choice(reps[:count]).left_at = t  # killed: its rows simply stop being refreshed
        changes.append(t)
    for r in reps:  # a third of the replicas are late once, by up to a whole Lease
        if rng.random() < 0.34:
            s = rng.uniform(2, 26) * LEASE
            r.stall = (s, s + rng.uniform(0.3, 1.0) * LEASE)
    interval = membership.refresh_interval(LEASE)
    # Every process's refresh times: on its timer, each tick up to 30% late, none in a stall.
    rows: dict[str, list[list[float]]] = {}
    for r in reps:
        per_proc = []
        for p in range(r.processes):
            t, times = r.joined_at + r.phase * interval + p * 0.01, []
            stop = end if r.left_at is None else r.left_at
            while t < stop:
                if r.stall and r.stall[0] <= t < r.stall[1]:
                    t = r.stall[1]  # the refresh runs when the stall ends
                times.append(t)
                t += interval * rng.uniform(1.0, 1.3)
            per_proc.append(times)
        rows[r.name] = per_proc

    def view_rows(at: float) -> list[Member]:
        out = []
        base = datetime(2026, 12, 7)
        for r in reps:
            for p, times in enumerate(rows[r.name]):
                i = bisect.bisect_right(times, at)
                if i:
                    out.append(
                        _member(f"{r.name}-{p}", r.name, base + timedelta(seconds=times[i - 1]))
                    )
        return out

    base = datetime(2026, 12, 7)
    problems: list[str] = []
    worst: dict[str, int] = dict.fromkeys(fams, 0)
    for host in reps:
        bal = Balancer(host.name, fams, lease_seconds=LEASE, refresh_seconds=LEASE / 2)
        placed: dict[str, str] | None = None
        moves = dict.fromkeys(fams, 0)
        # From a Lease after the start: every process of the first replicas has its row.
        t = host.joined_at + LEASE + rng.uniform(0, LEASE / 2)
        stop = end if host.left_at is None else host.left_at
        while t < stop:
            if not (host.stall and host.stall[0] <= t < host.stall[1]):
                view = bal.update(view_rows(t), base + timedelta(seconds=t), t)
                now_placed = assign(fams, view.replicas)
                if placed is not None and view.replicas:
                    for f in fams:
                        if now_placed[f] != placed[f]:
                            moves[f] += 1
                if view.replicas:
                    placed = now_placed
            t += bal.refresh_seconds * rng.uniform(1.0, 1.2)
        # A host that joined late saw only the changes after it joined.
        allowed = sum(1 for c in changes if c > host.joined_at)
        for f, n in moves.items():
            worst[f] = max(worst[f], n)
            if n > allowed:
                problems.append(
                    f"seed {seed} ({shape}): {host.name} saw {f} move {n} times, "
                    f"{allowed} real membership change(s)"
                )
        live = {r.name for r in reps if r.left_at is None}
        if host.left_at is None and placed != assign(fams, live):
            problems.append(f"seed {seed} ({shape}): {host.name} ended on a stale placement")
    return len(changes), len(reps), worst, problems


def test_families_move_only_on_real_membership_changes() -> None:
    """150 seeded deployments: no family moves in any host's view without a real join or
    leave, at most once per one, and every host ends on the placement of the live set."""
    problems: list[str] = []
    moved = 0
    for seed in range(150):
        _, _, worst, found = _simulate(seed)
        problems += found
        moved += sum(worst.values())
    assert not problems, "\n".join(problems[:10])
    assert moved > 0  # the real changes did move families: the simulation can see moves


def test_a_row_is_judged_gone_only_with_a_margin() -> None:
    now = datetime(2026, 12, 7, 12)
    late_once = _member(
        "a", "a", now - timedelta(seconds=LEASE + membership.refresh_interval(LEASE))
    )
    gone = _member("b", "b", now - timedelta(seconds=membership.gone_after(LEASE) + 0.1))
    assert late_once.alive(now, LEASE)
    assert not gone.alive(now, LEASE)
    assert membership.refresh_interval(LEASE) <= LEASE / 3


def test_rows_of_processes_gone_for_long_are_pruned(backend: object) -> None:
    """A killed process's row is listed as gone for ``GONE_KEPT_SECONDS``, then pruned: dead
    rows must not pile up into the ``MAX_MEMBERS`` rows every view reads."""
    from typing import Any

    b: Any = backend
    now = b.now()
    kept = membership.GONE_KEPT_SECONDS
    with b.transaction() as conn:
        membership.refresh(conn, _member("old", "r-old", now - timedelta(seconds=kept + 60)))
        membership.refresh(conn, _member("gone", "r-gone", now - timedelta(seconds=kept / 2)))
        membership.refresh(conn, _member("live", "r-live", now))
    with b.transaction() as conn:
        assert membership.prune(conn, now - timedelta(seconds=kept)) == 1
    with b.read() as conn:
        assert sorted(m.holder_id for m in membership.members(conn)) == ["gone", "live"]
