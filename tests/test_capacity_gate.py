"""A family whose Workers are all busy skips its due automatic check (RFC §2, §4).

Measured before: with 1 of 1 Workers busy and a 1 s interval, the scan generation went 2 -> 8
and the checkpoint advanced every second although no check could admit anything. Now a busy
family neither starts a scan nor advances its checkpoint, and the Worker exit that frees
capacity starts the skipped check at once.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from apsup.store import migrate, open_backend, scans
from apsup.supervisor.host import Host, LeasePolicy
from apsup.supervisor.launcher import build_host
from tests import boundary_families

pytestmark = pytest.mark.timeout(120)
BUSY_S = 4.0  # four intervals with the only Worker busy


def _generation(url: str) -> int:
    backend = open_backend(url)
    try:
        with backend.read() as conn:
            state = scans.get_state(conn, "busy-one")
        return 0 if state is None else state.scan_generation
    finally:
        backend.dispose()


def _cycle_for(host: Host, seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        host.cycle(max_wait=0.05)


def test_scan_generation_does_not_advance_while_every_worker_is_busy(
    db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    migrate(db_url)
    release = tmp_path / "release"
    monkeypatch.setenv("BOUNDARY_RELEASE", str(release))
    fam = boundary_families.busy_one
    backend = open_backend(db_url)
    try:
        with backend.transaction() as conn:
            fam.request(conn, "hold")
            for i in range(3):
                fam.mark_dirty(conn, f"dirty-{i}")
    finally:
        backend.dispose()
    bundle = build_host(db_url, list(boundary_families.registry), lease=LeasePolicy(10.0, 1.0, 0.5))
    try:
        host, sup = bundle.host, bundle.host.supervisors[0]
        host.start()
        deadline = time.monotonic() + 30
        while not sup.running:
            assert time.monotonic() < deadline, "the held Worker never started"
            host.cycle(max_wait=0.05)
        _cycle_for(host, 1.5)  # any check already due when the Worker started has settled
        before = _generation(db_url)
        _cycle_for(host, BUSY_S)
        during = _generation(db_url)
        assert during == before, f"scan generation went {before} -> {during} with 1/1 busy"
        release.touch()
        deadline = time.monotonic() + 30
        while _generation(db_url) == during:  # capacity returns: the check starts promptly
            assert time.monotonic() < deadline, "no check after the Worker became free"
            host.cycle(max_wait=0.05)
    finally:
        release.touch()
        bundle.host.shutdown()
        bundle.close()
