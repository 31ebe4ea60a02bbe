"""Exit classification details that used to punish healthy work (both backends).

- A Worker that acknowledged and was then stopped at its deadline succeeded: no timeout, no
  failure count, no delayed successor.
- A Worker that reports ``STALE_TERM`` while the Supervisor's term is still valid (checked in the
  database) is neither a failure nor a leadership loss: the key is retried without backoff growth
  and the term stands.
- A step that stops at ``max_steps`` with work left asks the loop to come back at once instead
  of sleeping until the next heartbeat.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from apsup.store import migrate, open_backend
from tests import liveness_families as lf
from tests.liveness_support import ExitRecorder, cycle_until, handled, live_host, request

pytestmark = pytest.mark.timeout(120)


def test_acknowledged_then_past_deadline_is_a_success(db_url: str, tmp_path: Path) -> None:
    migrate(db_url)
    backend = open_backend(db_url)
    fam = lf.live_late  # 1 s timeout; ``lateack`` acknowledges, then sleeps 30 s
    rec = ExitRecorder()
    try:
        g = request(backend, fam, "lateack.1")
        with live_host(db_url, [fam], tmp_path, hooks=rec) as b:
            host, sup = b.host, b.host.supervisors[0]
            cycle_until(host, lambda: rec.causes, 30, "the exit classified")
            assert handled(backend, fam, "lateack.1", g)
            assert rec.causes == [(fam.name, None)]
            assert sup.completed[fam.name] == 1 and sup.failed[fam.name] == 0
            assert sup.core is not None and sup.core.key_state(fam.name, "lateack.1") is None
    finally:
        backend.dispose()


def test_stale_term_report_while_the_term_stands_is_no_failure(db_url: str, tmp_path: Path) -> None:
    migrate(db_url)
    backend = open_backend(db_url)
    fam = lf.live_work  # ``fakestale``: attempt 1 raises StaleTermError, attempt 2 acknowledges
    rec = ExitRecorder()
    try:
        g = request(backend, fam, "fakestale.1")
        with live_host(db_url, [fam], tmp_path, hooks=rec) as b:
            host, sup = b.host, b.host.supervisors[0]
            assert sup.term is not None
            term = sup.term
            cycle_until(host, lambda: rec.causes, 30, "first exit classified")
            assert rec.causes == [(fam.name, "stale_term")]
            assert sup.term == term and sup.core is not None  # the term stands
            assert sup.failed[fam.name] == 0
            assert sup.core is not None
            info = sup.core.key_info(fam.name, "fakestale.1")
            assert info is not None and info.consecutive_failures == 0
            cycle_until(host, lambda: handled(backend, fam, "fakestale.1", g), 30, "retry acked")
            assert sup.term == term and sup.failed[fam.name] == 0
    finally:
        backend.dispose()


def test_step_cut_by_max_steps_asks_to_run_again_at_once(db_url: str, tmp_path: Path) -> None:
    migrate(db_url)
    backend = open_backend(db_url)
    fam = lf.live_work
    try:
        for i in range(3):
            request(backend, fam, f"ok.{i}")
        with live_host(db_url, [fam], tmp_path) as b:
            sup = b.host.supervisors[0]
            assert sup.step(max_steps=1) == 1  # request discovery; three dispatches remain
            wake = sup.next_wakeup()
            assert wake is not None and wake <= sup.now()
    finally:
        backend.dispose()
