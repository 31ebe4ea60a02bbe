"""The per-family chart of the last hour is cluster truth: on an elected backend each leader adds
what its Workers did to the per-minute activity table, so after a takeover the new leader's
view (and every replica's) still shows the old leader's invocations, succeeded and failed. A
SQLite host is the only one: its chart is its memory, and it writes no activity rows.
"""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import func, select

from apsup.observability import cluster
from apsup.observability.status_view import read_database
from apsup.store import activity
from apsup.store.schema import family_minutes
from tests.acceptance.families import configure
from tests.acceptance.harness import completed, request, scope_events

pytestmark = [pytest.mark.timeout(180), pytest.mark.backends("sqlite", "mysql", "postgresql")]


def _totals(history: list[list[int]] | tuple[Any, ...]) -> tuple[int, int]:
    return sum(int(m[1]) for m in history), sum(int(m[2]) for m in history)


def test_the_chart_comes_along_with_a_takeover(hosts, store, backend_name) -> None:
    fam = configure("acc-manual", disabled=True, max_workers=4)
    first = hosts.live_host([fam])
    for i in range(5):
        request(store, fam, f"ok.c{i}")
    request(store, fam, "fail.c")  # fails every time (a fast backoff here)
    first.run_until(lambda: completed(store, fam) >= 5, "five successes")
    first.run_until(lambda: len(scope_events(store, fam, "fail.c")) >= 2, "two failures")
    first.run_until(lambda: not first.supervisor.running, "no Worker left")
    done = first.supervisor.completed[fam.name], first.supervisor.failed[fam.name]
    first.close()  # a graceful stop writes its last counts, then releases the Lease
    with store.read() as conn:
        rows = conn.execute(select(func.count()).select_from(family_minutes)).scalar_one()
    if backend_name == "sqlite":
        assert rows == 0  # the only host: no write beside the Workers' for a chart
        return
    second = hosts.live_host([fam])
    second.run_until(lambda: second.supervisor.established, "the second host's term")
    assert second.supervisor.completed[fam.name] == 0  # its memory starts empty
    db = read_database(store)
    assert _totals(db.families[fam.binding_name].history) == done
    view = cluster.collect(store, store.url, lease_seconds=3.0)
    assert _totals(view["families"][fam.binding_name]["history"]) == done


def test_activity_rows_add_up_and_old_minutes_go(store) -> None:
    def add(counts: dict[tuple[str, int], tuple[int, int]]) -> None:
        store.run(lambda conn: activity.add(conn, counts))

    add({("fam-a", 100): (2, 1), ("fam-b", 100): (0, 0)})  # nothing to add: no row
    add({("fam-a", 100): (3, 0), ("fam-a", 101): (1, 4)})  # a second leader in minute 100
    with store.read() as conn:
        assert activity.recent(conn, ["fam-a", "fam-b"], 100) == {
            "fam-a": [[100, 5, 1], [101, 1, 4]]
        }
        assert activity.recent(conn, ["fam-a"], 101) == {"fam-a": [[101, 1, 4]]}
    assert store.run(lambda conn: activity.prune(conn, 101)) == 1
    with store.read() as conn:
        assert activity.recent(conn, ["fam-a"], 0) == {"fam-a": [[101, 1, 4]]}
