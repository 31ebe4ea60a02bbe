"""A failing Scope's history survives restarts and takeovers (both backends, real hosts).

Its consecutive-failure count and backoff continue from the durable failure state in the next
term: the first attempt there may come at once (nothing in memory says when it is due), and
the failure after it counts on from where the last term left off, with the backoff of that
count, so a Scope that fails every time is not retried every 30 s for ever under flapping
leadership, and the operator sees its true count.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from apsup.store import migrate, open_backend, operator_state
from tests import liveness_families as lf
from tests.liveness_support import FAST_BACKOFF, cycle_until, live_host, request

pytestmark = pytest.mark.timeout(120)


def _recorded(backend: object, scope: str) -> int:
    with backend.read() as conn:  # type: ignore[attr-defined]
        state = operator_state.scope_state(conn, lf.live_work.binding_name, scope)
    return 0 if state is None else state.consecutive_failures


def test_the_failure_count_and_backoff_continue_in_the_next_term(
    db_url: str, tmp_path: Path
) -> None:
    migrate(db_url)
    backend = open_backend(db_url)
    fam = lf.live_work
    scope = "fail.poison"
    try:
        request(backend, fam, scope)
        with live_host(db_url, [fam], tmp_path) as b:
            sup = b.host.supervisors[0]
            cycle_until(b.host, lambda: sup.failed[fam.name] >= 2, 30, "two failures")
        assert _recorded(backend, scope) == 2
        with live_host(db_url, [fam], tmp_path) as b:  # a new term
            sup = b.host.supervisors[0]
            cycle_until(b.host, lambda: sup.failed[fam.name] >= 1, 30, "a failure in term 2")
            assert sup.core is not None
            info = sup.core.key_info(fam.name, scope)
            assert info is not None and info.consecutive_failures == 3
            assert _recorded(backend, scope) == 3
            # The backoff of the third failure (0.3 s doubling: 1.2 s, with 10% jitter), not
            # the first one's 0.3 s again.
            assert info.retry_at is not None
            wait = (info.retry_at - sup.now()).total_seconds()
            expected = FAST_BACKOFF.delay(3)
            assert wait > FAST_BACKOFF.delay(2) * (1 + FAST_BACKOFF.jitter), (wait, expected)
    finally:
        backend.dispose()
