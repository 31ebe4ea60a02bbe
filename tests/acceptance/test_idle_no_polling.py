"""RFC §8: SQLite scheduling wakes on notifications, automatic deadlines, retry deadlines and
Worker exits; it adds no periodic database polling while idle.

Once the host has nothing to do (and its file watch has seen its own last commits), a
SQLAlchemy ``before_cursor_execute`` listener on the host's engine counts every statement over a
quiet period: there must be none. A notification then
wakes it (the listener sees the host's queries, proving it was attached to the right engine).
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import event

from apsup.supervisor.control import WATCH_SECONDS
from tests.acceptance.families import configure
from tests.acceptance.harness import handled, mark_dirty, request, scan_state

pytestmark = [pytest.mark.timeout(120), pytest.mark.backends("sqlite")]


def test_idle_sqlite_host_makes_no_database_queries(hosts, store):
    manual = configure("acc-manual", disabled=True, max_workers=2)
    hourly = configure("acc-a", interval=3600, max_workers=2)
    mark_dirty(store, hourly, "ok.first")
    request(store, manual, "ok.m1")
    host = hosts.live_host([manual, hourly])

    def idle() -> bool:
        snaps = host.snapshot()
        st = scan_state(store, hourly)
        return (
            handled(store, manual, "ok.m1")
            and handled(store, hourly, "ok.first")
            and st is not None
            and not st.scan_in_progress
            and len(host.bundle.pool) == 0
            and all(
                s.step_in_flight is None and not s.request_pass_active and s.running == 0
                for s in snaps.values()
            )
        )

    host.run_until(idle, "startup recovery and the first check are done")
    # Settle: the file watch sees the host's and Workers' own last commits once and runs one
    # request pass (reads) for them; after that nothing changes and nothing is read.
    host.run_for(WATCH_SECONDS + 0.5)

    statements: list[str] = []

    def count(conn, cursor, statement, parameters, context, executemany):
        statements.append(statement)

    engine = host.bundle.backend.engine
    event.listen(engine, "before_cursor_execute", count)
    try:
        wakeup = host.supervisor.next_wakeup()
        assert wakeup is not None and wakeup - host.supervisor.now() > timedelta(minutes=30)
        host.run_for(2.0)
        assert statements == [], f"idle host queried the database: {statements[:5]}"

        request(store, manual, "ok.m2")  # committed + notified: the host wakes and queries
        host.run_until(lambda: handled(store, manual, "ok.m2"), "the notification wakes it")
        assert statements, "the listener saw nothing: it is not on the host's engine"
    finally:
        event.remove(engine, "before_cursor_execute", count)
