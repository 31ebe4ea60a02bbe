"""Workers enforce their own deadline: a host killed with SIGKILL leaves no Worker running for
ever. With a healthy host the host stops its Workers first and classifies their exits; the
Worker's own backstop acts only one grace period later, when nobody else did."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from apsup.workers.exit_codes import ExitCode
from apsup.workers.pool import WorkerPool
from tests.acceptance.conftest import Hosts, hosts, store
from tests.acceptance.families import configure
from tests.acceptance.harness import pid_alive, request, scope_events, wait_for

__all__ = ["Hosts", "hosts", "store"]

pytestmark = pytest.mark.timeout(240)

TIMEOUT = 2.0
GRACE = 1.0
#: Generous: the Worker stops itself by TIMEOUT + 2 x GRACE + 1 s after its start.
GONE_WITHIN = 45.0


def _started_at(pid: int) -> str | None:
    """The process's start time in clock ticks (tells a reused pid from the Worker)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[19]
    except OSError:
        return None


def _running(pid: int, started: str | None) -> bool:
    return pid_alive(pid) and _started_at(pid) == started


def test_workers_of_a_host_killed_with_sigkill_stop_at_their_deadline(hosts, store):
    """A hung processor that handles SIGTERM and one that ignores it both end shortly after
    their deadline although their host was killed -9 while they ran."""
    proc = hosts.process(
        {"acc-manual": {"disabled": True, "max_workers": 2, "timeout": TIMEOUT}},
        grace_seconds=GRACE,
    )
    proc.wait_ready()
    fam = configure("acc-manual", disabled=True, max_workers=2, timeout=TIMEOUT)
    scopes = ["soft.orphan", "hang.orphan"]
    for scope in scopes:
        request(store, fam, scope)
    pids = wait_for(
        lambda: (
            [e["pid"] for s in scopes for e in scope_events(store, fam, s)]
            if all(scope_events(store, fam, s) for s in scopes)
            else None
        ),
        "both Workers started",
    )
    starts = {pid: _started_at(pid) for pid in pids}
    proc.signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    killed_at = time.monotonic()
    assert all(_running(pid, starts[pid]) for pid in pids)  # orphans now: nobody to stop them
    wait_for(
        lambda: not any(_running(pid, starts[pid]) for pid in pids),
        "the orphaned Workers stop themselves",
        limit=GONE_WITHIN,
    )
    assert time.monotonic() - killed_at < GONE_WITHIN


# --- the backstop itself, with a pool that never gets to enforce -----------------------------

T = "tests.worker_targets"


@pytest.fixture
def pool() -> Iterator[WorkerPool]:
    p = WorkerPool([T], grace_seconds=GRACE, confirm_seconds=1.0)
    try:
        yield p
    finally:
        p.close()


def _wait_exit(pool: WorkerPool, worker_id: str, limit: float) -> tuple[int, bool]:
    """Collect ``worker_id``'s exit without ever letting the pool enforce a deadline (a host
    whose loop is gone): only the sentinels are read."""
    from multiprocess.connection import wait

    end = time.monotonic() + limit
    while time.monotonic() < end:
        handle = next(h for h in pool.running() if h.worker_id == worker_id)
        wait([handle.sentinel], 0.2)
        for ex in pool._collect():
            if ex.worker_id == worker_id:
                return ex.exitcode, ex.timed_out
    raise AssertionError(f"{worker_id} did not stop itself within {limit}s")


@pytest.mark.parametrize(
    ("target", "expected"),
    [
        ("sleep_with_finally", ExitCode.TERMINATED),  # graceful stage: finally runs
        ("ignore_sigterm", ExitCode.KILLED_SIGKILL),  # hard stage
        ("slow_cleanup", ExitCode.KILLED_SIGKILL),  # its cleanup outlasts the grace
    ],
)
def test_a_worker_stops_itself_graceful_first_then_hard(
    pool: WorkerPool, tmp_path: Path, target: str, expected: int
) -> None:
    path = tmp_path / "marker"
    payload = orjson.dumps({"path": str(path), "seconds": 120})
    started = time.monotonic()
    handle = pool.launch("w", f"{T}:{target}", payload, TIMEOUT)
    code, timed_out = _wait_exit(pool, "w", GONE_WITHIN)
    elapsed = time.monotonic() - started
    assert code == expected
    assert handle.term_sent_at is None and handle.kill_sent_at is None  # the pool never acted
    assert timed_out  # still reported as a timeout: it was stopped past its deadline
    assert elapsed >= TIMEOUT + GRACE * 0.9  # never before a living host would have acted
    if target == "sleep_with_finally":
        assert "finally" in path.read_text()


def test_a_healthy_pool_acts_before_the_backstop(pool: WorkerPool, tmp_path: Path) -> None:
    """With the host's loop running, the pool's own SIGTERM at the deadline stops the Worker
    and the exit is a timeout, as before."""
    payload = orjson.dumps({"path": str(tmp_path / "m"), "seconds": 120})
    pool.launch("w", f"{T}:sleep_with_finally", payload, TIMEOUT)
    end = time.monotonic() + GONE_WITHIN
    while time.monotonic() < end:
        exits = pool.poll()
        if exits:
            assert exits[0].timed_out and exits[0].exitcode == ExitCode.TERMINATED
            return
        time.sleep(0.05)
    raise AssertionError("the pool did not stop its Worker")
