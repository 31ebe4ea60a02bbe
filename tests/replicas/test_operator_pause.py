"""An operator's pause holds on every replica and across a leadership change (MySQL).

Two background replicas of ``tests.replicas.replica``; ``apsup.operator.pause`` from another
process: the leader starts nothing new within one poll, the standby that takes over after a
kill -9 of the leader starts nothing either, and ``resume`` runs every request that waited.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from apsup import operator
from tests.replicas import families
from tests.replicas.cluster import Cluster

pytestmark = [pytest.mark.mysql_only, pytest.mark.timeout(240)]


@pytest.fixture
def cluster(db_url: str, tmp_path: Path) -> Iterator[Cluster]:
    Cluster.prepare(db_url)
    c = Cluster(db_url, tmp_path / "cluster", lease=3.0, renew=1.0, poll=0.5)
    try:
        yield c
    finally:
        c.close()


def _commits(c: Cluster) -> int:
    return sum(1 for r in c.journal() if r.kind == "commit")


def test_pause_holds_on_both_replicas_and_across_a_takeover(cluster: Cluster) -> None:
    c = cluster
    bg = [c.start("background") for _ in range(2)]
    c.wait_ready(*bg)
    leader = c.wait_leader()
    c.request(families.work.name, "warm")
    c.wait_all_handled(timeout=60)
    with c.backend.transaction() as conn:
        operator.pause(conn, families.work)
    time.sleep(1.5)  # > one poll (0.5 s) and a dispatch cycle
    before = _commits(c)
    for i in range(5):
        c.request(families.work.name, f"p{i}")
    time.sleep(3.0)
    assert _commits(c) == before, "the leader dispatched a paused family"
    view = c.lease()
    assert view is not None
    c.kill9(leader)
    new = c.wait_generation_above(view.generation, timeout=20)
    assert new is not None, "no takeover"
    time.sleep(3.0)  # the new leader established its term and polled several times
    assert _commits(c) == before, "the new leader dispatched a paused family"
    assert len(c.unhandled()) == 5  # kept, not lost
    with c.backend.transaction() as conn:
        operator.resume(conn, families.work)
    c.wait_all_handled(timeout=60)
    assert _commits(c) == before + 5
