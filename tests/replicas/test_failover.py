"""Fault tests with real replica processes on the real servers (MySQL-compatible, PostgreSQL).

Three background replicas (+ one api replica that accepts requests) of ``tests.replicas.replica``
run against one database with lease 3 s / renew 1 s / poll 0.5 s:

- kill -9 of the leader: a standby takes over within lease + one renewal interval (measured in
  database time from the lease table), and no accepted request is lost;
- SIGSTOP of the leader *and its Workers* past its lease, takeover and a commit by the new
  leader, then SIGCONT: no business row of the old generation lands after the takeover, checked
  over the commit-ordered journal (``tests/replicas/families.py``);
- Workers killed at random points (before the business commit, inside its transaction, between
  the commit and the acknowledgment): every request is eventually handled and no business row is
  written twice (progress CAS + ``handled >= G`` duplicate skip).

The CI run is bounded (a few rounds/trials, well under the module budget); ``APSUP_SOAK=1``
runs the full version (>= 200 SIGSTOP trials). Timing bounds are generous and only catch hangs;
the figures are printed and appended to ``var/replicas-figures.jsonl``.
"""

from __future__ import annotations

import json
import os
import random
import signal
import statistics
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from tests.replicas import families
from tests.replicas.cluster import REPO_ROOT, Cluster, db_seconds

SOAK = os.environ.get("APSUP_SOAK", "").strip().lower() in {"1", "true", "yes", "on"}
KILL_ROUNDS = 10 if SOAK else 2
STOP_TRIALS = 200 if SOAK else 5
KILL_REQUESTS = 300 if SOAK else 60

pytestmark = [
    pytest.mark.backends("mysql", "postgresql"),
    pytest.mark.soak,
    pytest.mark.timeout(3600 if SOAK else 240),
]

LEASE, RENEW, POLL = 3.0, 1.0, 0.5
FENCE_TIMEOUT = 4.0
#: Generous: catches a takeover that never happens, not a slow one.
TAKEOVER_BOUND = LEASE + RENEW + 15.0


def _figures(name: str, data: dict[str, object]) -> None:
    line = json.dumps({"test": name, "soak": SOAK, **data}, default=str)
    print(f"\nFIGURES {line}")
    out = REPO_ROOT / "var" / "replicas-figures.jsonl"
    out.parent.mkdir(exist_ok=True)
    with open(out, "a") as fh:
        fh.write(line + "\n")


@pytest.fixture
def cluster(db_url: str, tmp_path: Path) -> Iterator[Cluster]:
    Cluster.prepare(db_url)
    # A paused process inside a fenced transaction holds the Lease row lock: the server aborts
    # that transaction after FENCE_TIMEOUT so a standby can take over while it is still paused.
    url = f"{db_url}?apsup_fence_timeout={FENCE_TIMEOUT:g}"
    c = Cluster(url, tmp_path / "cluster", lease=LEASE, renew=RENEW, poll=POLL)
    try:
        yield c
    finally:
        c.close()


def _check_journal(c: Cluster) -> list[object]:
    rows = c.journal()
    assert families.fencing_violations(rows) == []
    assert families.duplicate_commits(rows) == []
    return rows


def _stop_writer(c: Cluster, api: object) -> None:
    info = api.info_path  # type: ignore[attr-defined]
    Path(str(info) + ".stop-writer").write_text("stop")
    deadline = time.monotonic() + 20
    while not Path(str(info) + ".writer-done").exists():
        assert time.monotonic() < deadline, "request writer did not stop"
        time.sleep(0.05)


def test_kill9_leader_standby_takes_over_and_no_request_is_lost(cluster: Cluster) -> None:
    c = cluster
    bg = [c.start("background") for _ in range(3)]
    api = c.start("api", "--requests", "100000", "--interval", "0.05", "--scopes", "25")
    c.wait_ready(*bg, api)
    latencies, after_expiry = [], []
    rounds = 0
    while len(latencies) < KILL_ROUNDS:
        rounds += 1
        assert rounds <= KILL_ROUNDS * 3, "leadership kept moving by itself"
        leader = c.wait_leader()
        before = c.lease()
        assert before is not None
        # Let the leader commit under its term first, so the kill lands on a working leader.
        deadline = time.monotonic() + 30
        while c.commits_since(before.generation) == 0:
            assert time.monotonic() < deadline, "the leader never committed"
            time.sleep(0.05)
        time.sleep(random.uniform(0.0, 0.8))
        view = c.lease()
        assert view is not None
        if view.generation != before.generation or c.leader() is not leader:
            continue  # leadership moved by itself meanwhile (a loaded machine): pick again
        killed_at = view.db_now
        c.kill9(leader)
        new = c.wait_generation_above(view.generation, timeout=TAKEOVER_BOUND)
        assert new is not None, f"no takeover within {TAKEOVER_BOUND}s of kill -9"
        assert new.expires_at is not None and view.expires_at is not None
        claimed_at = new.expires_at - timedelta(seconds=LEASE)
        latencies.append(db_seconds(killed_at, claimed_at))
        after_expiry.append(db_seconds(view.expires_at, claimed_at))
        c.stamp_takeover("global", new)
        assert new.holder_id != leader.holder_id
        # Keep three candidates: start a replacement (it becomes a standby).
        replacement = c.start("background")
        c.wait_ready(replacement)
    _stop_writer(c, api)
    drained = c.wait_all_handled(timeout=120)
    assert c.uncovered() == []
    rows = _check_journal(c)
    requested, handled = c.intent_totals()
    assert requested == handled
    for lat in latencies:
        assert lat <= TAKEOVER_BOUND
    _figures(
        "kill9_takeover",
        {
            "rounds": len(latencies),
            "takeover_after_kill_s": [round(x, 3) for x in latencies],
            "takeover_after_old_expiry_s": [round(x, 3) for x in after_expiry],
            "max_takeover_after_kill_s": round(max(latencies), 3),
            "median_takeover_after_kill_s": round(statistics.median(latencies), 3),
            "bound_lease_plus_renew_s": LEASE + RENEW,
            "within_lease_plus_renew": sum(1 for x in latencies if x <= LEASE + RENEW + 0.25),
            "commits": sum(1 for r in rows if r.kind == "commit"),  # type: ignore[attr-defined]
            "accepted_requests_handled": True,
            "drain_s": round(drained, 2),
        },
    )


def test_sigstop_leader_past_its_lease_old_generation_never_commits(cluster: Cluster) -> None:
    c = cluster
    bg = [c.start("background") for _ in range(3)]
    api = c.start("api", "--requests", "1000000", "--interval", "0.03", "--scopes", "25")
    c.wait_ready(*bg, api)
    rng = random.Random(int.from_bytes(os.urandom(4), "big"))
    takeovers_while_paused = 0
    blocked_by_paused_txn = 0
    takeover_s: list[float] = []
    t0 = time.monotonic()
    for _ in range(STOP_TRIALS):
        leader = c.wait_leader(timeout=60)
        view = c.lease()
        assert view is not None
        deadline = time.monotonic() + 30
        while c.commits_since(view.generation) == 0:
            assert time.monotonic() < deadline, "the leader never committed"
            time.sleep(0.05)
        time.sleep(rng.uniform(0.0, 1.0))
        tree = c.process_tree(leader)  # the host, its forkserver and its Workers
        c.signal_all(tree, signal.SIGSTOP)
        stopped = c.lease()
        assert stopped is not None
        try:
            new = c.wait_generation_above(
                stopped.generation, timeout=LEASE + RENEW + FENCE_TIMEOUT + 8
            )
            if new is None:
                # A paused process holds the Lease row lock inside a fenced transaction: nobody
                # can take over until the server ends that transaction (or it resumes).
                blocked_by_paused_txn += 1
                continue
            takeovers_while_paused += 1
            assert new.expires_at is not None
            takeover_s.append(db_seconds(stopped.db_now, new.expires_at - timedelta(seconds=LEASE)))
            c.stamp_takeover("global", new)
            deadline = time.monotonic() + 30
            while c.commits_since(new.generation) == 0:
                assert time.monotonic() < deadline, "the new leader never committed"
                time.sleep(0.05)
        finally:
            if rng.random() < 0.5:
                # Adversarial order: the old Workers resume first and try their commits with the
                # old term while their host is still paused (it cannot terminate them yet).
                c.signal_all(tree[1:], signal.SIGCONT)
                time.sleep(0.7)
                c.signal_all(tree[:1], signal.SIGCONT)
            else:
                c.signal_all(tree, signal.SIGCONT)
        # The old host notices its late renewal and terminates its Workers.
        time.sleep(1.0)
    elapsed = time.monotonic() - t0
    _stop_writer(c, api)
    c.wait_all_handled(timeout=120)
    assert c.uncovered() == []
    rows = _check_journal(c)
    events = c.event_counts()
    gens = sorted({int(r.generation) for r in rows if r.kind == "commit"})  # type: ignore[attr-defined]
    _figures(
        "sigstop_trials",
        {
            "trials": STOP_TRIALS,
            "takeovers_while_paused": takeovers_while_paused,
            "blocked_by_paused_fenced_txn": blocked_by_paused_txn,
            "old_generation_commits_after_takeover": 0,
            "stale_commits_rejected": events.get("stale_rejected", 0),
            "generations_committing": len(gens),
            "commits": sum(1 for r in rows if r.kind == "commit"),  # type: ignore[attr-defined]
            "takeover_after_stop_s_median": round(statistics.median(takeover_s), 3)
            if takeover_s
            else None,
            "takeover_after_stop_s_max": round(max(takeover_s), 3) if takeover_s else None,
            "elapsed_s": round(elapsed, 1),
        },
    )
    assert takeovers_while_paused >= 1


def test_workers_killed_at_random_points_every_request_handled_once(cluster: Cluster) -> None:
    c = cluster
    c.extra_env["REPLICA_TEST_KILL"] = "0.5"
    c.extra_env["REPLICA_TEST_WORK"] = "0.01,0.1"
    bg = [c.start("background") for _ in range(2)]
    c.wait_ready(*bg)
    scopes = [f"k{i}" for i in range(12)]
    for i in range(KILL_REQUESTS):
        c.request("replica-work", scopes[i % len(scopes)])
        if i % 10 == 9:
            time.sleep(0.3)  # spread requests so that some arrive while a Worker is running
    drained = c.wait_all_handled(timeout=180)
    assert c.uncovered() == []
    rows = _check_journal(c)
    events = c.event_counts()
    kills = {k: v for k, v in events.items() if k.startswith("killed:")}
    assert sum(kills.values()) >= 1, events
    requested, handled = c.intent_totals()
    assert requested == handled
    _figures(
        "worker_kills",
        {
            "requests": KILL_REQUESTS,
            "kills": kills,
            "attempts": events.get("attempt", 0),
            "commits": sum(1 for r in rows if r.kind == "commit"),  # type: ignore[attr-defined]
            "duplicate_business_rows": 0,
            "drain_s": round(drained, 2),
        },
    )
