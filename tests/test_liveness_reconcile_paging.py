"""Reconciliation runs in pages across loop iterations: renewal keeps running between pages, it
resumes where it stopped and it never stops silently.

- MySQL, short lease (2 s): a reconciliation of 15 pages x 0.3 s of real query time (6.75 s in
  all, more than three leases) completes under one term: no leadership churn, no restart from
  page 1; while it runs the family reports itself not ready (``reconciling``), afterwards it
  dispatches.
- Both backends: 1,200 pages are all run (no page cap that ends reconciliation unannounced).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from apsup.store import migrate, open_backend
from apsup.supervisor.host import LeasePolicy
from tests import liveness_families as lf
from tests.liveness_support import cycle_until, handled, live_host, readiness, request

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def recon() -> Iterator[dict[str, object]]:
    saved = dict(lf.RECON)
    try:
        yield lf.RECON
    finally:
        lf.RECON.clear()
        lf.RECON.update(saved)


@pytest.mark.mysql_only
def test_reconciliation_longer_than_the_lease_keeps_one_term(
    db_url: str, tmp_path: Path, recon: dict[str, object]
) -> None:
    recon.update(pages=15, page_seconds=0.45, seen=0)
    migrate(db_url)
    backend = open_backend(db_url)
    fam = lf.live_recon
    try:
        g = request(backend, fam, "ok.1")
        with live_host(db_url, [fam], tmp_path, lease=LeasePolicy(2.0, 0.5, 0.5)) as b:
            host, sup = b.host, b.host.supervisors[0]
            assert sup.term is not None
            generation = sup.term.generation
            reasons: set[str] = set()

            def one_term_throughout() -> bool:
                assert sup.term is not None, "leadership lost during reconciliation"
                assert sup.term.generation == generation, "leadership churned"
                status = readiness(host)
                if recon["seen"] != 15:  # still reconciling: not dispatching, so not ready
                    assert status["status"] != "ok", status
                    reasons.add(str(status["families"].get(fam.name, {}).get("reason")))
                return handled(backend, fam, "ok.1", g)

            t0 = time.monotonic()
            cycle_until(host, one_term_throughout, 60, "request handled after reconciliation")
            print(f"\nreconciliation + dispatch under one term: {time.monotonic() - t0:.2f}s")
            assert recon["seen"] == 15
            assert any("reconciling" in r for r in reasons), reasons
            assert fam.name not in sup.unreconciled
    finally:
        backend.dispose()


def test_reconciliation_has_no_silent_page_cap(
    db_url: str, tmp_path: Path, recon: dict[str, object]
) -> None:
    recon.update(pages=1200, page_seconds=0.0, seen=0)
    migrate(db_url)
    backend = open_backend(db_url)
    fam = lf.live_recon
    try:
        g = request(backend, fam, "ok.1")
        with live_host(db_url, [fam], tmp_path) as b:
            host, sup = b.host, b.host.supervisors[0]
            cycle_until(host, lambda: handled(backend, fam, "ok.1", g), 120, "request handled")
            assert recon["seen"] == 1200
            assert not sup.reconciling and fam.name not in sup.unreconciled
    finally:
        backend.dispose()
