"""A stale term found outside renewal stops the Supervisor's Workers, as renewal does (both
backends).

The term is invalidated in the database (as a mode switch or a takeover would) while a slow
Worker runs. Renewal is far away (long lease), so the loss is found either by a Worker whose
fenced acknowledgment is refused (``STALE_TERM`` exit, confirmed with the database) or by the
Supervisor's own next fenced control write (a scheduled check's StartScan). Either way the slow
Worker must be stopped and its exit confirmed promptly, so that no later term runs a second
Worker for its key beside it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from apsup.store import migrate, open_backend
from apsup.supervisor.host import LeasePolicy
from tests import liveness_families as lf
from tests.liveness_support import cycle_until, live_host, request

pytestmark = pytest.mark.timeout(120)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("found_by", ["worker", "step"])
def test_stale_term_outside_renewal_terminates_workers(
    db_url: str, tmp_path: Path, found_by: str
) -> None:
    migrate(db_url)
    backend = open_backend(db_url)
    fam = lf.live_work if found_by == "worker" else lf.live_scan
    try:
        request(backend, fam, "slow.1")
        if found_by == "worker":
            request(backend, fam, "stalewait.2")
        lease = LeasePolicy(120.0, 40.0, 0.5)  # no renewal during the test
        with live_host(db_url, [fam], tmp_path, lease=lease) as b:
            host, sup = b.host, b.host.supervisors[0]
            started = [tmp_path / "started.slow.1"]
            if found_by == "worker":
                started.append(tmp_path / "started.stalewait.2")
            cycle_until(host, lambda: all(p.exists() for p in started), 30, "Workers started")
            pid = int(started[0].read_text())
            assert sup.term is not None
            old = sup.term.generation
            backend.invalidate_terms()
            t0 = time.monotonic()
            if found_by == "worker":
                (tmp_path / "go.stalewait.2").touch()
            cycle_until(
                host, lambda: sup.term is None or sup.term.generation != old, 30, "term loss"
            )
            # The slow Worker (two minutes of sleep) is stopped and its exit confirmed.
            cycle_until(host, lambda: not b.pool.running(), 30, "old-term Workers stopped")
            assert not sup.running
            assert not _alive(pid)
            print(f"\n{found_by}: slow Worker stopped {time.monotonic() - t0:.2f}s after loss")
    finally:
        backend.dispose()
