"""Leadership under partitions and process faults: step down on time, one leader in sight.

Real replicas (``tests.replicas.replica``) on the real MySQL-compatible server, in ``global``
and ``dedicated`` mode, each background replica reaching the server through its *own* TCP fault
proxy, so one replica can be cut off while the others are not. Lease 3 s, renewal every 1 s,
renew deadline 2 s; the URL carries no time limits of its own (the defaults, 5 s reads, are
longer than the Lease: only the renew deadline keeps a cut-off leader's calls short).

Per fault (black hole of the leader's network, kill -9, SIGSTOP of the leader's processes
but not its Workers; and a reset of all the leader's connections, after which it may keep its
term) the test reads the Lease row directly every 50 ms and every replica's
``/status`` at 10 Hz, and asserts:

- the old leader reports itself not leader within the renew deadline of its last successful
  renewal (+ sampling slack), before its Lease runs out in database time;
- a standby establishes a new term within Lease + renew + 1 s of that renewal;
- at no sample do two replicas report themselves leader of one key, and no replica reports
  itself leader of a term after that term's Lease ran out (no zombie window);
- afterwards every accepted request is handled, no business row of an old term lands after a
  newer term took over, and no (family, Scope, G) commits twice.

CI runs one round of each fault per mode; ``APSUP_SOAK=1`` runs ten. The figures go to
``var/leadership-figures.jsonl`` and docs/faults.md.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import statistics
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import orjson
import pytest

from tests.faults.campaign import RequestStream, _cmdline
from tests.faults.partition import PartitionCluster
from tests.replicas import families
from tests.replicas.cluster import REPO_ROOT, Cluster, Replica, descendants

SOAK = os.environ.get("APSUP_SOAK", "").strip().lower() in {"1", "true", "yes", "on"}
ROUNDS = 10 if SOAK else 1
LEASE, RENEW, DEADLINE, POLL = 3.0, 1.0, 2.0, 0.5
#: Bound on a takeover, from the old leader's last successful renewal (database time): the
#: Lease runs out, a standby's next claim (every RENEW) takes it, plus a second of slack.
TAKEOVER_BOUND = LEASE + RENEW + 1.0
#: Dedicated mode places each family: while a stopped or cut-off leader's membership row is
#: within its margin it is still the family's preferred replica, and the others claim a free
#: Lease only once it has been free for one renewal interval (their grace).
PLACEMENT_GRACE = RENEW
#: /status sampling period, and the slack allowed for it (a sample every 100 ms, an HTTP
#: round trip, the clock mapping).
SAMPLE_SECONDS = 0.1
SLACK = 0.35

pytestmark = [
    pytest.mark.mysql_only,
    pytest.mark.soak,
    pytest.mark.timeout(3600 if SOAK else 420),
]


@dataclass
class StatusSample:
    at: float  # database time, estimated from the test's clock (seconds since the epoch)
    replica: str
    leaders: dict[str, int]  # key -> generation, for the keys it reports leading
    #: database time the request was sent: the replica judged its leadership after it
    asked: float = 0.0


def _epoch(dt: datetime) -> float:
    return (dt - datetime(1970, 1, 1)).total_seconds()


class Observer(threading.Thread):
    """The Lease rows every 50 ms and every replica's ``/status`` every 100 ms (two threads),
    stamped in database time (the test's monotonic clock plus an offset measured against the
    server)."""

    def __init__(self, cluster: PartitionCluster, keys: list[str]) -> None:
        super().__init__(name="leadership-observer", daemon=True)
        self.cluster = cluster
        self.keys = keys
        self.stop = threading.Event()
        self.samples: list[StatusSample] = []
        #: (key, generation) -> latest expires_at seen (epoch seconds): its Lease end
        self.expiry: dict[tuple[str, int], float] = {}
        #: (key, generation) -> first time seen, as claim time = expires_at - Lease
        self.claimed: dict[tuple[str, int], float] = {}
        self.holders: dict[tuple[str, int], str] = {}
        #: key -> database times of the successful reads of its Lease row
        self.reads: dict[str, list[float]] = {}
        self.http_errors = 0
        self.offset = self._measure_offset()
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        self._next_status = 0.0

    def _measure_offset(self) -> float:
        t0 = time.monotonic()
        now = _epoch(self.cluster.db_now())
        t1 = time.monotonic()
        return now - (t0 + t1) / 2

    def db_time(self, mono: float | None = None) -> float:
        return (time.monotonic() if mono is None else mono) + self.offset

    def run(self) -> None:
        # /status in a thread of its own: a replica that does not answer (stopped) holds its
        # round for the request's timeout, and must not hold the Lease reads with it.
        status = threading.Thread(target=self._status_loop, name="status-sampler", daemon=True)
        status.start()
        while not self.stop.wait(0.05):
            for key in self.keys:
                with contextlib.suppress(Exception):
                    self._lease(key)
        status.join(5)

    def _status_loop(self) -> None:
        while not self.stop.wait(max(0.0, self._next_status - time.monotonic())):
            self._next_status = time.monotonic() + SAMPLE_SECONDS
            self._status_round()

    def _lease(self, key: str) -> None:
        view = self.cluster.lease(key)
        self.reads.setdefault(key, []).append(self.db_time())
        if view is None or not view.holder_id or view.expires_at is None:
            return
        ident = (key, view.generation)
        end = _epoch(view.expires_at)
        self.expiry[ident] = max(self.expiry.get(ident, end), end)
        self.claimed.setdefault(ident, end - LEASE)
        self.holders[ident] = view.holder_id

    def _status_round(self) -> None:
        replicas = [r for r in self.cluster.replicas if r.role == "background" and r.alive()]
        for r in replicas:
            if r.port is None:
                continue
            asked = self.db_time()
            try:
                url = f"http://127.0.0.1:{r.port}/status"
                with self._opener.open(url, timeout=0.5) as resp:
                    body = orjson.loads(resp.read())
            except Exception:
                self.http_errors += 1  # a stopped replica does not answer: it leads nothing
                continue
            at = self.db_time()
            leaders = {
                s["key"]: int(s["generation"])
                for s in body.get("supervisors", [])
                if s.get("leader") and s.get("generation") is not None
            }
            self.samples.append(StatusSample(at, r.name, leaders, asked))

    # -- checks -----------------------------------------------------------------------------
    def two_leaders(self) -> list[str]:
        """Sampling rounds (100 ms apart) in which two replicas report leading one key."""
        rounds: dict[int, dict[str, set[str]]] = {}
        for s in self.samples:
            slot = rounds.setdefault(round(s.at / SAMPLE_SECONDS), {})
            for key in s.leaders:
                slot.setdefault(key, set()).add(s.replica)
        return [
            f"{slot * SAMPLE_SECONDS:.1f}: {key} led by {sorted(names)}"
            for slot, keys in sorted(rounds.items())
            for key, names in keys.items()
            if len(names) > 1
        ]

    def zombie_samples(self) -> list[str]:
        """Samples reporting a term as leading after its Lease ran out in database time.

        Judged from when the request was sent (the replica decided what to answer after it, so
        a slow answer is not counted late), and only where the Lease row was read between the
        expiry and that moment: the expiry seen is then the term's last one, not one whose
        renewals this observer missed while its own reads were failing."""
        out = []
        for s in self.samples:
            for key, gen in s.leaders.items():
                end = self.expiry.get((key, gen))
                if end is None or s.asked <= end + 0.05:
                    continue
                if not any(end < t <= s.asked for t in self.reads.get(key, ())):
                    continue
                out.append(
                    f"{s.replica} reported {key}#{gen} asked {s.asked - end:.2f}s after expiry "
                    f"(answered after {s.at - s.asked:.2f}s)"
                )
        return out

    def unconfirmed_zombies(self) -> int:
        """Samples after a seen expiry that no Lease read confirms (see ``zombie_samples``)."""
        count = 0
        for s in self.samples:
            for key, gen in s.leaders.items():
                end = self.expiry.get((key, gen))
                if end is not None and s.asked > end + 0.05:
                    count += not any(end < t <= s.asked for t in self.reads.get(key, ()))
        return count

    def longest_read_gap(self) -> float:
        """The longest time without a successful read of some key's Lease row (seconds)."""
        gaps = [b - a for times in self.reads.values() for a, b in itertools.pairwise(times)]
        return max(gaps, default=0.0)

    def last_leading(self, replica: str, key: str, gen: int) -> float | None:
        times = [s.at for s in self.samples if s.replica == replica and s.leaders.get(key) == gen]
        return max(times, default=None)

    def leader_of(self, key: str) -> tuple[str, int] | None:
        """(replica, generation) the newest samples show leading ``key``."""
        for s in reversed(self.samples[-30:]):
            if key in s.leaders:
                return s.replica, s.leaders[key]
        return None


@pytest.fixture(params=["global", "dedicated"])
def mode(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def cluster(db_url: str, tmp_path: Path, mode: str) -> Iterator[PartitionCluster]:
    Cluster.prepare(db_url)
    c = PartitionCluster(
        db_url,
        tmp_path / "cluster",
        lease=LEASE,
        renew=RENEW,
        poll=POLL,
        mode=mode,
        deadline=DEADLINE,
        env={"REPLICA_TEST_WORK": "0.2,0.6"},
    )
    try:
        yield c
    finally:
        c.close()


def _figures(data: dict[str, Any]) -> None:
    line = json.dumps({"test": "leadership-timing", "soak": SOAK, **data}, default=str)
    print(f"\nFIGURES {line}")
    out = REPO_ROOT / "var" / "leadership-figures.jsonl"
    out.parent.mkdir(exist_ok=True)
    with open(out, "a") as fh:
        fh.write(line + "\n")


def _wait(predicate: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def _hosts(victim: Replica) -> list[int]:
    """The replica's host processes: the replica itself and, in dedicated mode, its per-family
    Supervisor processes (each in a session of its own); not the Worker zygotes, nor Workers
    (forks of a zygote, whose command line they keep)."""
    out = [victim.pid]
    for pid in descendants(victim.pid):
        cmd = _cmdline(pid)
        if cmd and b"apsup.workers.zygote" not in cmd:
            out.append(pid)
    return out


def _inject(c: PartitionCluster, victim: Replica, fault: str) -> list[int]:
    hosts = _hosts(victim)
    if fault == "blackhole":
        c.proxies[victim.name].blackhole()
    elif fault == "drop":
        c.proxies[victim.name].drop()  # every connection reset at once; new ones work
    elif fault == "kill9":
        c.signal_all(hosts, signal.SIGKILL)
    elif fault == "sigstop":
        c.signal_all(hosts, signal.SIGSTOP)
    else:  # pragma: no cover
        raise AssertionError(fault)
    return hosts


def _recover(c: PartitionCluster, victim: Replica, fault: str, hosts: list[int]) -> None:
    if fault == "blackhole":
        proxy = c.proxies[victim.name]
        proxy.heal()
        proxy.drop()  # the dead connections are reset when the network comes back
    elif fault == "drop":
        pass
    elif fault == "sigstop":
        c.signal_all(hosts, signal.SIGCONT)
    else:
        victim.proc.wait(10)
        replacement = c.start("background")
        c.wait_ready(replacement)


def test_step_down_and_takeover_are_bounded_with_one_leader_in_sight(
    cluster: PartitionCluster, mode: str
) -> None:
    c = cluster
    key = "global" if mode == "global" else f"artifact:{families.work.name}"
    keys = [key] if mode == "global" else [f"artifact:{f.name}" for f in families.registry]
    bg = [c.start("background") for _ in range(3)]
    c.wait_ready(*bg)
    obs = Observer(c, keys)
    obs.start()
    stream = RequestStream(c, interval=0.05, scopes=20, seed=7)
    stream.start()
    results: list[dict[str, Any]] = []
    kept: list[bool] = []
    try:
        for _round in range(ROUNDS):
            for fault in ("blackhole", "kill9", "sigstop"):
                results.append(_one_fault(c, obs, key, fault))
            kept.append(_drop_keeps_leadership(c, obs, key))
        stream.stop.set()
        stream.join(10)
        c.wait_all_handled(timeout=120)
    finally:
        stream.stop.set()
        obs.stop.set()
        obs.join(10)
    rows = c.journal()
    assert families.fencing_violations(rows) == []
    assert families.duplicate_commits(rows) == []
    assert c.uncovered() == []
    two = obs.two_leaders()
    zombies = obs.zombie_samples()
    takeovers = [r["takeover_s"] for r in results]
    steps = [r["step_down_s"] for r in results if r["step_down_s"] is not None]
    _figures(
        {
            "mode": mode,
            "lease": LEASE,
            "renew": RENEW,
            "renew_deadline": DEADLINE,
            "faults": results,
            "takeover_p50_s": round(statistics.median(takeovers), 3),
            "takeover_max_s": round(max(takeovers), 3),
            "step_down_max_s": round(max(steps), 3) if steps else None,
            "samples": len(obs.samples),
            "two_leader_rounds": len(two),
            "zombie_samples": len(zombies),
            "unconfirmed_zombie_samples": obs.unconfirmed_zombies(),
            "longest_lease_read_gap_s": round(obs.longest_read_gap(), 3),
            "accepted": stream.accepted,
            "leader_kept_after_drop": kept,
        }
    )
    assert two == [], two[:5]
    assert zombies == [], zombies[:5]
    bound = TAKEOVER_BOUND + (PLACEMENT_GRACE if mode == "dedicated" else 0.0)
    for r in results:
        assert r["takeover_s"] <= bound, r
        if r["step_down_s"] is not None:
            assert r["step_down_s"] <= DEADLINE + SLACK, r


def _one_fault(c: PartitionCluster, obs: Observer, key: str, fault: str) -> dict[str, Any]:
    # A leader that has committed under its term, seen leading in /status.
    def seen_leader() -> tuple[Replica, int] | None:
        found = obs.leader_of(key)
        if found is None:
            return None
        name, gen = found
        replica = next(r for r in c.replicas if r.name == name)
        if not replica.alive() or c.commits_since(gen, key) == 0:
            return None
        return replica, gen

    victim, gen = _wait(seen_leader, 60, f"a committing leader of {key}")
    hosts = _inject(c, victim, fault)
    faulted_at = obs.db_time()
    try:
        new_gen = _wait(
            lambda: next(
                (g for (k, g) in list(obs.claimed) if k == key and g > gen),
                None,
            ),
            TAKEOVER_BOUND + 20,
            f"a takeover of {key} after {fault}",
        )
        time.sleep(0.3)  # a few more samples of the old leader
    finally:
        _recover(c, victim, fault, hosts)
    last_renewal = obs.expiry[(key, gen)] - LEASE
    claimed = obs.claimed[(key, new_gen)]
    last_leading = obs.last_leading(victim.name, key, gen)
    step_down = None
    if fault == "blackhole" and last_leading is not None:
        step_down = round(last_leading - last_renewal, 3)
    # The next round starts from a settled cluster: the old leader reports standby again.
    _wait(lambda: obs.leader_of(key) not in (None, (victim.name, gen)), 30, "a settled leader")
    return {
        "fault": fault,
        "old_generation": gen,
        "new_generation": new_gen,
        "takeover_s": round(claimed - last_renewal, 3),
        "after_fault_s": round(claimed - faulted_at, 3),
        "step_down_s": step_down,
        "renewal_before_fault_s": round(faulted_at - last_renewal, 3),
    }


def _drop_keeps_leadership(c: PartitionCluster, obs: Observer, key: str) -> bool:
    """Reset every connection of the leader: it reconnects and, normally, keeps its term (a
    takeover is allowed, but only as any other: bounded, one leader in sight, checked by the
    caller's sampling). Returns whether the same term still leads afterwards."""
    found = _wait(lambda: obs.leader_of(key), 60, f"a leader of {key}")
    name, gen = found
    victim = next(r for r in c.replicas if r.name == name)
    _inject(c, victim, "drop")
    time.sleep(LEASE + RENEW)
    now = obs.leader_of(key)
    return now == (name, gen)
