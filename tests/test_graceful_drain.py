"""Graceful drain on a real host process and a real SIGTERM (both backends): discovery and
dispatch stop, a running 3 s invocation finishes and is acknowledged within the drain window;
a second SIGTERM skips the drain, and the interrupted request stays pending."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable

import pytest

from apsup.store import intents, open_backend
from tests import visibility_families as fams
from tests.test_worker_visibility import Host, host_factory, http, metric, request, wait_for

__all__ = ["host_factory"]  # the fixture, imported for this module's tests

pytestmark = pytest.mark.timeout(240)


def _generations(db_url: str, fam: object, scope: str) -> tuple[int, int]:
    backend = open_backend(db_url)
    try:
        with backend.read() as conn:
            row = intents.get(conn, fam.binding_name, scope)  # type: ignore[attr-defined]
    finally:
        backend.dispose()
    assert row is not None
    return row.requested_generation, row.handled_generation


def _running(h: Host, family: str) -> None:
    wait_for(
        lambda: (metric(h.port, "apsup_oldest_running_seconds", family) or 0) > 0.2,
        f"a running {family} invocation",
    )


def test_sigterm_lets_a_running_invocation_finish(
    host_factory: Callable[..., Host], db_url: str
) -> None:
    h = host_factory("SHUTDOWN_DRAIN_SECONDS=30", "SHUTDOWN_GRACE_SECONDS=2")
    request(db_url, fams.vis_slow, "s1")
    _running(h, "vis-slow")
    assert _generations(db_url, fams.vis_slow, "s1") == (1, 0)
    started = time.monotonic()
    h.proc.send_signal(signal.SIGTERM)
    assert h.proc.wait(timeout=60) == 0, h.text()[-3000:]
    elapsed = time.monotonic() - started
    assert _generations(db_url, fams.vis_slow, "s1") == (1, 1), h.text()[-3000:]
    assert elapsed < 25, elapsed  # it ended when the Worker did, not at the end of the window
    assert "drain finished" in h.text()


def test_second_sigterm_skips_the_drain_and_keeps_the_request(
    host_factory: Callable[..., Host], db_url: str
) -> None:
    h = host_factory("SHUTDOWN_DRAIN_SECONDS=120", "SHUTDOWN_GRACE_SECONDS=2")
    request(db_url, fams.vis_hang, "s1")
    _running(h, "vis-hang")
    started = time.monotonic()
    h.proc.send_signal(signal.SIGTERM)
    time.sleep(1.0)
    assert h.proc.poll() is None  # draining: the hung Worker keeps the host waiting
    h.proc.send_signal(signal.SIGTERM)
    assert h.proc.wait(timeout=60) == 0, h.text()[-3000:]
    assert time.monotonic() - started < 60
    assert _generations(db_url, fams.vis_hang, "s1") == (1, 0)  # still pending for a restart


def _running_in_status(port: int, family: str) -> bool:
    code, body = http(port, "/status")
    if code != 200:
        return False
    snap = json.loads(body)
    return any(
        (sup.get("families", {}).get(family) or {}).get("running", 0) >= 1
        for sup in snap.get("supervisors", [])
    )


def test_dedicated_mode_drains_too(host_factory: Callable[..., Host], db_url: str) -> None:
    """MySQL: the launcher forwards SIGTERM to each Family's process, which drains; SQLite: one
    host with a Supervisor per Family."""
    h = host_factory(
        "ARTIFACT_PROCESSING_SUPERVISOR_MODE=dedicated",
        "SHUTDOWN_DRAIN_SECONDS=30",
        "SHUTDOWN_GRACE_SECONDS=2",
    )
    request(db_url, fams.vis_slow, "s1")
    wait_for(lambda: _running_in_status(h.port, "vis-slow"), "a running vis-slow invocation")
    h.proc.send_signal(signal.SIGTERM)
    assert h.proc.wait(timeout=90) == 0, h.text()[-3000:]
    assert _generations(db_url, fams.vis_slow, "s1") == (1, 1), h.text()[-3000:]
