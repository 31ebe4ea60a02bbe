"""The leader's loop never waits on a row lock an application transaction holds (MySQL mode:
real row locks, a real host, real Workers).

An application transaction that called ``fam.request(conn, x)`` and stays open holds x's intent
row lock. When x's Worker exits, the host's acknowledgment meets that lock: it is deferred, not
waited for (the Lease row is never held while waiting on another row). x's key stays occupied
(no second Worker), other Scopes keep dispatching, no host cycle lasts anywhere near a lock
wait, and once the application commits, the acknowledgment is made and the request it added
runs as the successor: nothing is lost. (SQLite has no row locks: a write transaction there
locks the whole database, and the host waits at most its ``apsup_lock_wait``.)
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

from apsup.scheduling import KeyState
from apsup.store import intents, migrate, open_backend
from apsup.supervisor import nudge
from apsup.supervisor.nudge import NudgeListener
from tests import liveness_families as lf
from tests.liveness_support import ExitRecorder, cycle_until, handled, live_host, request

pytestmark = [pytest.mark.timeout(120), pytest.mark.backends("mysql")]


def test_an_open_application_request_defers_the_acknowledgment_and_blocks_nothing(
    db_url: str, tmp_path: Path
) -> None:
    migrate(db_url)
    backend = open_backend(db_url)
    app = open_backend(db_url)
    fam = lf.live_work
    locked = "noackwait.locked"
    recorder = ExitRecorder()
    try:
        g = request(backend, fam, locked)
        with live_host(db_url, [fam], tmp_path, hooks=recorder) as b:
            sup = b.host.supervisors[0]
            cycle_until(b.host, (tmp_path / f"started.{locked}").exists, 30, "Worker started")
            with app.transaction() as conn:  # the application's transaction, left open
                g2 = fam.request(conn, locked)
                (tmp_path / f"go.{locked}").touch()  # its Worker exits meanwhile
                cycle_until(b.host, lambda: sup.unclassified, 30, "the acknowledgment deferred")
                other = request(backend, fam, "ok.other")
                longest = 0.0
                deadline = time.monotonic() + 3.0
                while time.monotonic() < deadline or not handled(backend, fam, "ok.other", other):
                    t0 = time.monotonic()
                    b.host.cycle(max_wait=0.05)
                    longest = max(longest, time.monotonic() - t0)
                    assert time.monotonic() < deadline + 30, "ok.other was never run"
                    assert sup.core is not None
                    assert sup.core.key_state(fam.name, locked) is KeyState.EXITED
                assert sup.term is not None and sup.leader  # the Lease was renewed meanwhile
                assert not handled(backend, fam, locked, g)
                assert longest < 1.0, f"a host cycle took {longest:.2f} s: it waited on a lock"
            # Committed: the acknowledgment goes through, and the request it added runs.
            cycle_until(b.host, lambda: handled(backend, fam, locked, g), 30, "acknowledged")
            cycle_until(b.host, lambda: handled(backend, fam, locked, g2), 30, "successor ran")
            assert sup.failed[fam.name] == 0
        with backend.read() as conn:
            row = intents.get(conn, fam.binding_name, locked)
        assert row is not None and row.handled_generation == row.requested_generation == g2
    finally:
        app.dispose()
        backend.dispose()


def test_a_nudge_for_a_locked_scope_does_not_stall_the_loop(db_url: str, tmp_path: Path) -> None:
    """A datagram (unauthenticated) naming a Scope whose row an open transaction holds: the
    barrier that waits for the publisher's commit tries without blocking, cycle by cycle."""
    migrate(db_url)
    app = open_backend(db_url)
    backend = open_backend(db_url)
    fam = lf.live_work
    try:
        with live_host(db_url, [fam], tmp_path) as b:
            sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
            sock.close()
            b.host.nudges = NudgeListener("127.0.0.1", port)
            sender = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            sup = b.host.supervisors[0]
            cycle_until(b.host, lambda: sup.established, 30, "the term established")
            with backend.transaction() as conn:
                fam.mark_dirty(conn, "ok.nudged")  # the row exists (a disabled policy: no run)
            with app.transaction() as conn:
                g = fam.request(conn, "ok.nudged")  # held open: its row stays locked
                sender.sendto(nudge.encode(fam.name, "ok.nudged"), ("127.0.0.1", port))
                longest = 0.0
                deadline = time.monotonic() + 3.0
                while time.monotonic() < deadline:
                    t0 = time.monotonic()
                    b.host.cycle(max_wait=0.05)
                    longest = max(longest, time.monotonic() - t0)
                assert longest < 1.0, f"a host cycle took {longest:.2f} s: it waited on a lock"
                assert sup.leader
            cycle_until(b.host, lambda: handled(backend, fam, "ok.nudged", g), 30, "it ran")
            sender.close()
            b.host.nudges.close()
    finally:
        app.dispose()
        backend.dispose()
