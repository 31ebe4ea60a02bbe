"""Dedicated mode scales out: the families spread over the live replicas and move gracefully.

Real replicas (launcher + one Supervisor process per family) of four families on the real
MySQL-compatible server, each replica behind its own fault proxy; Lease 3 s, renewal 1 s, renew
deadline 2 s, drain 2 s. A watcher reads every Lease row with its holder's replica every 50 ms
while a steady stream of requests runs over all four families. Asserted, as an operator meets it:

- **balance**: after each membership change the placement is the rendezvous rule's for the live
  replicas (1 -> 3 replicas: 2/1/1) within 3 x (Lease + renew);
- **stickiness**: a replica that leaves and comes back with the same id gets back exactly the
  families it had, and no family moves more than once per membership change (no ping-pong;
  one leave/come-back cycle in CI, ten with ``APSUP_SOAK=1``);
- **graceful leave** (SIGTERM): its families are released, not left to expire: each is led
  again within a poll or two of its release, far sooner than a Lease;
- **kill -9**: its families are led again within Lease + renew + 1 s, by the replica the rule
  names for the survivors;
- **black hole**: a replica that cannot reach the database releases nothing; its families are
  taken over after their Lease, and it gets its share back once it can reach the database again;
- throughout: every accepted request handled, no (family, Scope, G) committed twice, no commit
  of an old term after a newer one took over.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from sqlalchemy import func, select, text

from apsup.store.leases import INVALIDATED
from apsup.store.schema import leases, replicas
from apsup.supervisor.placement import assign
from tests.faults.partition import PartitionCluster
from tests.replicas import families
from tests.replicas.cluster import Cluster, Replica
from tests.replicas.support import http_get, wait_for

LEASE, RENEW, DEADLINE, POLL = 3.0, 1.0, 2.0, 0.5
FAMILIES = sorted(f.name for f in families.scale_registry)
KEYS = [f"artifact:{f}" for f in FAMILIES]
#: Balance follows a membership change within this (the issue's bound).
BALANCE_BOUND = 3 * (LEASE + RENEW)
TAKEOVER_BOUND = LEASE + RENEW + 1.0
SOAK = os.environ.get("APSUP_SOAK", "").strip().lower() in {"1", "true", "yes", "on"}
#: Leave/come-back cycles of one replica (CI: one; ``APSUP_SOAK=1``: ten).
FLAPS = 10 if SOAK else 1

pytestmark = [pytest.mark.mysql_only, pytest.mark.soak, pytest.mark.timeout(1800 if SOAK else 420)]


@dataclass
class Holding:
    at: float  # test monotonic time
    replica: str | None  # None: no live term


class Watcher(threading.Thread):
    """Every 50 ms: each key's live holder, as a replica id (Lease row joined to membership)."""

    def __init__(self, cluster: Cluster) -> None:
        super().__init__(name="scaleout-watcher", daemon=True)
        self.cluster = cluster
        self.stop = threading.Event()
        self.history: dict[str, list[Holding]] = {k: [] for k in KEYS}
        self.current: dict[str, str | None] = dict.fromkeys(KEYS)
        self.replica_of: dict[str, str] = {}  # holder id -> replica id, as ever seen
        self.errors = 0

    def read(self) -> dict[str, str | None]:
        stmt = (
            select(
                leases.c.supervisor_key,
                leases.c.holder_id,
                leases.c.expires_at,
                replicas.c.replica_id,
                func.utc_timestamp(6),
            )
            .select_from(leases.outerjoin(replicas, replicas.c.holder_id == leases.c.holder_id))
            .where(leases.c.supervisor_key.in_(KEYS))
        )
        with self.cluster.backend.engine.connect() as conn:
            rows = conn.execute(stmt).all()
            conn.rollback()
        out: dict[str, str | None] = dict.fromkeys(KEYS)
        for key, holder, expires, replica, now in rows:
            if replica is not None:  # a leaving replica deletes its rows before it releases
                self.replica_of[holder] = replica
            live = holder != INVALIDATED and expires is not None and expires > now
            out[key] = self.replica_of.get(holder, f"?{holder[:6]}") if live else None
        return out

    def run(self) -> None:
        while not self.stop.wait(0.05):
            try:
                view = self.read()
            except Exception:
                self.errors += 1
                continue
            now = time.monotonic()
            for key, rep in view.items():
                if rep != self.current[key] or not self.history[key]:
                    self.history[key].append(Holding(now, rep))
            self.current = view

    def placement(self) -> dict[str, str | None]:
        return {k.partition(":")[2]: v for k, v in self.current.items()}

    def moves(self, since: float) -> dict[str, int]:
        """Per key, how often the lead passed to a different replica after ``since`` (a gap
        without a leader between two terms of the same replica is no move)."""
        out = {}
        for key, hist in self.history.items():
            last = None
            for h in hist:
                if h.at <= since:
                    last = h.replica or last
            n = 0
            for h in hist:
                if h.at > since and h.replica is not None:
                    if last is not None and h.replica != last:
                        n += 1
                    last = h.replica
            out[key] = n
        return out

    def led_again(self, key: str, since: float) -> float | None:
        """Seconds from ``since`` to the first live holder of ``key`` after ``since`` that is
        another replica than the one leading then, or comes after a moment without one (a
        takeover may fall between two samples)."""
        before = None
        for h in self.history[key]:
            if h.at <= since:
                before = h.replica
        gone = before is None
        for h in self.history[key]:
            if h.at <= since:
                continue
            if h.replica is None:
                gone = True
            elif gone or h.replica != before:
                return h.at - since
        return None


class Stream(threading.Thread):
    def __init__(self, cluster: Cluster, interval: float = 0.05) -> None:
        super().__init__(name="scaleout-requests", daemon=True)
        self.cluster = cluster
        self.interval = interval
        self.stop = threading.Event()
        self.rng = random.Random(5)
        self.accepted = 0

    def run(self) -> None:
        while not self.stop.wait(self.interval):
            with contextlib.suppress(Exception):
                fam = self.rng.choice(FAMILIES)
                # Scope ids per family: the test processor's progress rows are keyed by Scope.
                self.cluster.request(fam, f"{fam}-{self.rng.randrange(12)}")
                self.accepted += 1


@pytest.fixture
def cluster(db_url: str, tmp_path: Path) -> Iterator[PartitionCluster]:
    Cluster.prepare(db_url)
    c = PartitionCluster(
        db_url,
        tmp_path / "cluster",
        lease=LEASE,
        renew=RENEW,
        poll=POLL,
        mode="dedicated",
        deadline=DEADLINE,
        env={
            "REPLICA_TEST_WORK": "0.05,0.2",
            "POWERCONTEXT_SERVER_RUNTIME_SHUTDOWN_DRAIN_SECONDS": "2",
        },
    )
    try:
        yield c
    finally:
        c.close()


def _start(c: PartitionCluster, rid: str) -> Replica:
    r = c.start(
        "background", "--registry", "scale", env={"POWERCONTEXT_SERVER_RUNTIME_REPLICA_ID": rid}
    )
    c.wait_ready(r)
    return r


def _joined(c: Cluster, rid: str, timeout: float = 90.0) -> float:
    """Wait until every per-family process of replica ``rid`` keeps a membership row (the
    membership change the others react to); returns that moment (monotonic)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with c.backend.engine.connect() as conn:
            n = conn.execute(
                select(func.count()).where(
                    replicas.c.replica_id == rid,
                    replicas.c.last_seen > func.utc_timestamp(6) - text(f"INTERVAL {LEASE} SECOND"),
                )
            ).scalar_one()
            conn.rollback()
        if n >= len(FAMILIES):
            return time.monotonic()
        time.sleep(0.05)
    raise AssertionError(f"replica {rid} did not join within {timeout}s")


def _wait_placement(w: Watcher, live: set[str], since: float, what: str) -> float:
    want = assign(FAMILIES, live)
    deadline = since + BALANCE_BOUND
    while time.monotonic() < deadline:
        if w.placement() == want:
            return time.monotonic() - since
        time.sleep(0.05)
    raise AssertionError(
        f"{what}: placement {w.placement()} is not {want} within {BALANCE_BOUND:g}s"
    )


def _check_data(c: Cluster, stream: Stream) -> None:
    stream.stop.set()
    stream.join(10)
    assert stream.accepted > 100, stream.accepted
    c.wait_all_handled(timeout=90)
    rows = c.journal()
    assert families.duplicate_commits(rows) == []
    assert families.fencing_violations(rows) == []


def test_families_spread_move_once_and_come_back(cluster: PartitionCluster) -> None:
    c = cluster
    w = Watcher(c)
    w.start()
    stream = Stream(c)
    stream.start()
    try:
        a = _start(c, "rep-a")
        _wait_placement(w, {"rep-a"}, _joined(c, "rep-a"), "one replica leads all")

        # Join: 1 -> 3 replicas (two membership changes, counted from the later one).
        t_first = time.monotonic()
        b, cr = _start(c, "rep-b"), _start(c, "rep-c")
        t_join = max(_joined(c, "rep-b"), _joined(c, "rep-c"))
        took = _wait_placement(w, {"rep-a", "rep-b", "rep-c"}, t_join, "after the join")
        three = w.placement()
        assert sorted(list(three.values()).count(r) for r in ("rep-a", "rep-b", "rep-c")) == [
            1,
            1,
            2,
        ]

        # /status of a replica says which replica the rule names for each family.
        def named() -> dict | None:  # each process reads membership every half Lease
            _, body = http_get(int(a.port or 0), "/status")
            got = {e["key"]: e.get("preferred_replica") for e in body["supervisors"]}
            return got if got == {f"artifact:{f}": r for f, r in three.items()} else None

        wait_for(named, LEASE, "every family's preferred replica in /status")
        time.sleep(1.0)  # settled: nothing moves on
        joined = w.moves(t_first)
        assert all(n <= 2 for n in joined.values()), joined  # two joins: at most one move each

        # Flapping membership: rep-c leaves (SIGTERM) and comes back with the same id, FLAPS
        # times. Each change moves a family at most once, and the same set always gives the
        # same placement (sticky).
        gaps_seen: list[float] = []
        leave_times: list[float] = []
        moves_seen: list[dict[str, int]] = []
        for _ in range(FLAPS):
            # Graceful leave: its families released and taken at once.
            t_leave = time.monotonic()
            c_keys = [k for k in KEYS if w.current[k] == "rep-c"]
            assert c.stop(cr) == 0
            leave_times.append(_wait_placement(w, {"rep-a", "rep-b"}, t_leave, "rep-c left"))
            gaps = [w.led_again(k, t_leave) for k in c_keys]
            # Released on SIGTERM after its drain (<= 2 s), then claimed within a renewal or
            # two: far below the Lease a kill leaves behind (drain + Lease).
            assert all(g is not None and g < 2.0 + LEASE for g in gaps), gaps
            gaps_seen += [g for g in gaps if g is not None]
            time.sleep(1.0)
            left = w.moves(t_leave)
            assert all(n <= 1 for n in left.values()), left
            moves_seen.append(left)

            # Comes back with the same id: exactly its families again, one move each.
            t_back = time.monotonic()
            cr = _start(c, "rep-c")
            _wait_placement(w, {"rep-a", "rep-b", "rep-c"}, _joined(c, "rep-c"), "rep-c back")
            assert w.placement() == three
            time.sleep(1.0)
            back = w.moves(t_back)
            assert all(n <= 1 for n in back.values()), back
            moves_seen.append(back)
        took_leave = max(leave_times)

        # kill -9 rep-b: its families led again within Lease + renew + 1 s, by the survivors
        # the rule names, each moving once.
        b_keys = [k for k in KEYS if w.current[k] == "rep-b"]
        t_kill = time.monotonic()
        c.signal_all(c.process_tree(b), signal.SIGKILL)
        b.proc.wait(10)
        _wait_placement(w, {"rep-a", "rep-c"}, t_kill, "after rep-b was killed")
        kill_times = {k: w.led_again(k, t_kill) for k in b_keys}
        for k, took_kill in kill_times.items():
            assert took_kill is not None and took_kill <= TAKEOVER_BOUND, (k, took_kill)
        time.sleep(1.0)
        killed = w.moves(t_kill)
        assert all(n <= 1 for n in killed.values()), killed
        _check_data(c, stream)
        print(
            f"join balanced in {took:.2f}s; {FLAPS} leave/back cycles: leave balanced within "
            f"{took_leave:.2f}s, led again {min(gaps_seen):.2f}-{max(gaps_seen):.2f}s after "
            f"the SIGTERM, max moves per family per change "
            f"{max(max(m.values()) for m in moves_seen)}; moves join {joined} kill {killed} "
            f"(led again after {kill_times}); {stream.accepted} requests"
        )
        assert a.alive()
    finally:
        stream.stop.set()
        w.stop.set()
        w.join(5)


def test_a_cut_off_replica_releases_nothing_and_gets_its_share_back(
    cluster: PartitionCluster,
) -> None:
    c = cluster
    w = Watcher(c)
    w.start()
    stream = Stream(c)
    stream.start()
    try:
        a = _start(c, "rep-a")
        b = _start(c, "rep-b")
        t_join = max(_joined(c, "rep-a"), _joined(c, "rep-b"))
        two = {"rep-a", "rep-b"}
        _wait_placement(w, two, t_join, "two replicas")
        b_keys = [k for k in KEYS if w.current[k] == "rep-b"]
        assert len(b_keys) == 2

        t_cut = time.monotonic()
        c.proxies[b.name].blackhole()
        _wait_placement(w, {"rep-a"}, t_cut, "rep-b cut off")
        cut_times = {k: w.led_again(k, t_cut) for k in b_keys}
        print(f"cut off: led again after {cut_times}")
        for k, took in cut_times.items():
            # Not released (it cannot be confirmed): taken over only once the Lease ran out,
            # at least Lease - renew after the cut, and within Lease + renew + 1 s of it.
            assert took is not None and LEASE - RENEW - 0.3 <= took <= TAKEOVER_BOUND, (k, took)
        time.sleep(1.0)
        assert all(n <= 1 for n in w.moves(t_cut).values()), w.moves(t_cut)
        log_b = b.log_path.read_text(errors="replace")
        assert '"lease released"' not in log_b

        t_heal = time.monotonic()
        c.proxies[b.name].heal()
        _wait_placement(w, two, _joined(c, "rep-b"), "rep-b reachable again")
        time.sleep(1.0)
        assert all(n <= 1 for n in w.moves(t_heal).values()), w.moves(t_heal)
        _check_data(c, stream)
        assert a.alive() and b.alive()
    finally:
        stream.stop.set()
        w.stop.set()
        w.join(5)
