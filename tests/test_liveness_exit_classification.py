"""A database error while classifying a Worker exit never kills the host (both backends).

The Worker acknowledges, then the intent table is renamed away (a real database error for every
read of it) before the Worker exits. ``Host.cycle`` must keep running; the exit stays
unclassified and its key stays occupied (no second Worker, the budget slot still taken) until
the table is back, then the exit is classified as the success it was.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from apsup.store import migrate, open_backend
from tests import liveness_families as lf
from tests.liveness_support import (
    INTENTS,
    cycle_for,
    cycle_until,
    handled,
    live_host,
    rename_table,
    request,
    still_occupied,
)

pytestmark = pytest.mark.timeout(120)


def test_exit_classification_survives_a_database_error(db_url: str, tmp_path: Path) -> None:
    migrate(db_url)
    backend = open_backend(db_url)
    fam = lf.live_work
    try:
        g = request(backend, fam, "ackwait.1")
        with live_host(db_url, [fam], tmp_path) as b:
            host = b.host
            sup = host.supervisors[0]
            cycle_until(host, (tmp_path / "acked.ackwait.1").exists, 30, "Worker acknowledged")
            assert handled(backend, fam, "ackwait.1", g)
            rename_table(db_url, INTENTS, "live_moved_intents")
            try:
                (tmp_path / "go.ackwait.1").touch()
                cycle_until(host, lambda: not b.pool.running(), 30, "Worker exit confirmed")

                cycle_for(
                    host, 2.0, still_occupied(sup, fam, "ackwait.1")
                )  # on today's main: OperationalError here
                assert sup.unclassified, "the exit should wait for classification"
            finally:
                rename_table(db_url, "live_moved_intents", INTENTS)
            cycle_until(host, lambda: sup.completed[fam.name] == 1, 30, "exit classified")
            assert sup.failed[fam.name] == 0 and not sup.unclassified and not sup.running
            assert sup.core is not None and sup.core.key_state(fam.name, "ackwait.1") is None
            assert sup.established
    finally:
        backend.dispose()
