"""Replica membership: every host process keeps a row (MySQL), ``/status`` and ``apsup status``
show the replicas and what each leads, and ``apsup status`` finds a host's listener from them.

Two background replicas (global), then one in dedicated mode (its per-family processes share
its replica id). A clean stop removes the row; a kill -9 leaves it to go stale after the Lease.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from apsup.store.membership import gone_after
from tests.replicas.cluster import PREFIX, Cluster
from tests.replicas.support import http_get, wait_for

pytestmark = [pytest.mark.mysql_only, pytest.mark.timeout(240)]

LEASE = 3.0


@pytest.fixture
def cluster(db_url: str, tmp_path: Path) -> Iterator[Cluster]:
    Cluster.prepare(db_url)
    c = Cluster(db_url, tmp_path / "cluster", lease=LEASE, renew=1.0, poll=0.5)
    try:
        yield c
    finally:
        c.close()


def _status_cli(url: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(PREFIX)}
    env[PREFIX + "LEASE_SECONDS"] = str(LEASE)
    out = subprocess.run(
        [sys.executable, "-m", "apsup.cli", "status", "--db", url, "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return orjson.loads(out.stdout)


def test_replicas_are_listed_with_what_they_lead_and_found_by_status(cluster: Cluster) -> None:
    c = cluster
    a, b = c.start("background"), c.start("background")
    c.wait_ready(a, b)
    leader = c.wait_leader()

    def both_listed() -> list[dict] | None:
        _, body = http_get(int(leader.port or 0), "/status")
        reps = body.get("replicas", [])
        return reps if len(reps) == 2 and any(r["leads"] for r in reps) else None

    reps = wait_for(both_listed, 30, "both replicas in /status")
    by_pid = {r["pid"]: r for r in reps}
    assert set(by_pid) == {a.pid, b.pid}
    assert by_pid[leader.pid]["leads"] == ["global"]
    other = b if leader is a else a
    assert by_pid[other.pid]["leads"] == []
    for r in reps:
        assert r["role"] == "background" and r["mode"] == "global"
        assert r["http"].startswith("http://127.0.0.1:")
    # `apsup status --db` finds a listener by itself (no --url, no HTTP_PORT) and lists both.
    view = _status_cli(c.url)
    assert view["host"]["available"] is True, view["host"]
    assert _pids(view) == {a.pid: "live", b.pid: "live"}
    # The leader by replica name, not by holder id.
    (row,) = [r for r in view["replicas"] if r["leads"]]
    assert view["families"]["replica-work"]["leader"]["replica"] == row["replica"]
    # A clean stop removes its row at once; a kill -9 leaves it to go stale after the Lease.
    assert c.stop(other) == 0
    view = _status_cli(c.url)
    assert _pids(view) == {leader.pid: "live"}
    c.kill9(leader)
    # A row counts as gone once it is older than the margin (two Leases), not at once; it
    # stays listed as gone, with when it vanished, and the summary says the cluster is degraded.
    time.sleep(gone_after(LEASE) + 1.0)
    view = _status_cli(c.url)
    assert _pids(view) == {leader.pid: "gone"}
    assert view["replicas"][0]["vanished_at"]
    assert view["summary"]["status"] == "degraded", view["summary"]


def _pids(view: dict) -> dict[int, str]:
    return {p["pid"]: r["state"] for r in view["replicas"] for p in r["processes"]}


def test_dedicated_processes_share_their_replica_id(db_url: str, tmp_path: Path) -> None:
    Cluster.prepare(db_url)
    c = Cluster(db_url, tmp_path / "ded", lease=LEASE, renew=1.0, poll=0.5, mode="dedicated")
    try:
        r = c.start("background")
        c.wait_ready(r)

        def listed() -> list[dict] | None:
            reps = _status_cli(c.url)["replicas"]
            procs = [p for x in reps for p in x["processes"]]
            return reps if len(procs) == 2 and all(p["leads"] for p in procs) else None

        reps = wait_for(listed, 30, "both family processes listed, each leading its family")
        assert len(reps) == 1  # one row per replica, its family processes inside
        assert reps[0]["leads"] == ["artifact:replica-side", "artifact:replica-work"]
        # The launcher's listener serves the console of all its families (fan-in).
        with urllib.request.urlopen(f"http://127.0.0.1:{r.port}/", timeout=10) as resp:
            page = resp.read().decode()
        for name in ("replica-side", "replica-work"):
            assert f'data-family="{name}"' in page, page[-3000:]
        assert "<h2>Replicas</h2>" in page, page[:3000]
    finally:
        c.close()
