"""A long fenced transaction never costs the leader its term (elected backends, a real host).

Every fenced transaction locks the Lease row, and the leader's renewal needs that lock. Workers'
fenced transactions are therefore bounded by the database (OceanBase ``ob_trx_timeout``), at a
bound derived from the Lease so that a renewal waiting behind one still ends before the renew
deadline: ``0.8 x (renew deadline - renewal interval)``. A processor parked inside
``ctx.fenced()`` for twice the Lease has its transaction rolled back at the bound, its
invocation fails saying why, and the leader keeps renewing its term and dispatching meanwhile.
SQLite has no Lease to lose (its terms never expire), so this is a MySQL-mode guarantee.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from apsup.store import migrate, open_backend
from apsup.supervisor.host import LeasePolicy
from tests import liveness_families as lf
from tests.liveness_support import ExitRecorder, cycle_until, handled, live_host, request

pytestmark = [pytest.mark.timeout(120), pytest.mark.backends("mysql")]


def test_a_worker_parked_inside_its_fenced_transaction_does_not_cost_the_term(
    db_url: str, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    migrate(db_url)
    backend = open_backend(db_url)
    fam = lf.live_work
    lease = LeasePolicy(3.0, 1.0, 0.5)  # renew deadline 2 s: the bound is 0.8 s
    parked = "fencedpark.6"  # twice the Lease
    recorder = ExitRecorder()
    try:
        g = request(backend, fam, parked)
        with live_host(db_url, [fam], tmp_path, lease=lease, hooks=recorder) as b:
            sup = b.host.supervisors[0]
            cycle_until(b.host, (tmp_path / f"fenced.{parked}").exists, 30, "Worker in its txn")
            term = sup.term
            assert term is not None
            other = request(backend, fam, "ok.meanwhile")
            lost: list[float] = []
            t0 = time.monotonic()
            while time.monotonic() - t0 < 6.5:  # the whole park, and past it
                b.host.cycle(max_wait=0.05)
                if sup.term != term or not sup.leader:
                    lost.append(time.monotonic() - t0)
            assert not lost, f"the leader lost its term {lost[0]:.2f} s into the park"
            cycle_until(b.host, lambda: len(recorder.causes) >= 2, 30, "both exits classified")
            assert handled(backend, fam, "ok.meanwhile", other)  # dispatching went on
            assert not handled(backend, fam, parked, g)  # rolled back at the bound
            assert (fam.name, "failure") in recorder.causes
            assert sup.term == term
        err = capfd.readouterr().err  # the Worker's own line says why it failed
        assert (
            "FencedTransactionTimeout: the fenced transaction stayed open longer than its "
            "bound of 0.8 s" in err
        ), err[-2000:]
    finally:
        backend.dispose()
