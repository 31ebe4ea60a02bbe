"""A schedule checkpoint ahead of database time (the clock went back, or a host with a fast clock
wrote it) is clamped and counted in ``apsup_clock_rewinds`` once, not once per cycle, and the
interval family keeps scanning from the present (both backends, a real host).

The clamp itself is covered in ``test_cron_time.py`` (scheduler) and, black-box with a moved
clock, in ``acceptance/test_cron_faketime.py``; this module checks what an operator sees."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from apsup.store import migrate, open_backend, scans
from apsup.supervisor.host import Host
from apsup.supervisor.runtime import HostObserver
from tests import liveness_families as lf
from tests.liveness_support import cycle_for, cycle_until, live_host

pytestmark = pytest.mark.timeout(120)


def _rewinds(host: Host, family: str) -> float | None:
    observer = host.on_cycle
    assert isinstance(observer, HostObserver)
    prefix = f'apsup_clock_rewinds_total{{family="{family}"}} '
    for line in generate_latest(observer.metrics.registry).decode().splitlines():
        if line.startswith(prefix):
            return float(line[len(prefix) :])
    return None


def _scan_generation(db_url: str, binding: str) -> int:
    backend = open_backend(db_url)
    try:
        with backend.read() as conn:
            state = scans.get_state(conn, binding)
        return 0 if state is None else state.scan_generation
    finally:
        backend.dispose()


def test_a_checkpoint_ahead_of_database_time_is_counted_once(db_url: str, tmp_path: Path) -> None:
    fam = lf.live_scan
    migrate(db_url)
    ahead = datetime.now(UTC).replace(tzinfo=None, microsecond=0) + timedelta(hours=1)
    backend = open_backend(db_url)
    try:
        with backend.transaction() as conn:
            scans.set_checkpoint(conn, fam.binding_name, ahead)
    finally:
        backend.dispose()

    with live_host(db_url, [fam], tmp_path) as bundle:
        host = bundle.host
        host.cycle(max_wait=0.05)
        start = _scan_generation(db_url, fam.binding_name)
        cycle_until(host, lambda: _rewinds(host, fam.name) == 1, 30, "one clamp counted")
        # The interval (1 s) resumes from the present instead of waiting out the hour...
        cycle_until(
            host,
            lambda: _scan_generation(db_url, fam.binding_name) >= start + 2,
            30,
            "two scans after the clamp",
        )
        # ... and the one clamp stays one: the counter does not grow with every cycle.
        cycle_for(host, 1.5)
        assert _rewinds(host, fam.name) == 1
