"""Non-blocking launches (``WorkerPool.submit``): several in flight at once, each holding
capacity until its pid arrives, stopped like any Worker, never left unsupervised.

Real forkserver, real Workers, real signals. A forkserver held with SIGSTOP stands for one that
is slow to fork (a loaded machine) or wedged. No timing assertion is tighter than "within 30 s".
"""

from __future__ import annotations

import array
import contextlib
import fcntl
import os
import signal
import termios
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from apsup.scheduling import Backoff
from apsup.store import migrate, open_backend
from apsup.supervisor.host import LeasePolicy
from apsup.supervisor.launcher import build_host
from apsup.workers import ExitCode, WorkerHandle, WorkerPool
from tests import liveness_families
from tests.test_worker_processes import (
    GRACE,
    LIMIT,
    T,
    drive,
    is_dead,
    lines,
    payload,
    process_state,
    wait_until,
)

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def pool() -> Iterator[WorkerPool]:
    p = WorkerPool([T], grace_seconds=GRACE, confirm_seconds=1.0, launch_timeout=LIMIT)
    try:
        yield p
    finally:
        p.close()


def _stopped_forkserver(p: WorkerPool) -> int:
    fs_pid = p.forkserver_pid
    assert fs_pid is not None
    os.kill(fs_pid, signal.SIGSTOP)
    return fs_pid


def test_several_launches_in_flight_hold_capacity_until_their_pids_arrive(
    pool: WorkerPool,
) -> None:
    fs_pid = _stopped_forkserver(pool)  # it cannot fork: submit must not wait for it
    handles = [pool.submit(f"w{i}", f"{T}:ok", b"{}", LIMIT) for i in range(3)]
    assert [h.state for h in handles] == ["launching"] * 3
    assert all(h.pid == 0 for h in handles)
    assert len(pool) == 3 and len(pool.sentinels()) == 3  # capacity held, woken on the pid
    assert pool.poll() == []  # nothing to confirm: no exit is invented for a pending launch
    resumed = time.monotonic()
    os.kill(fs_pid, signal.SIGCONT)
    exits = drive(pool, {"w0", "w1", "w2"})
    assert {wid: ex.exitcode for wid, ex in exits.items()} == dict.fromkeys(exits, 0)
    assert all(ex.pid > 0 and ex.launch_error is None for ex in exits.values())
    assert len({ex.pid for ex in exits.values()}) == 3
    # The timeout counts from the Worker's start (its pid), not from the submit.
    assert all(ex.duration < time.monotonic() - resumed + 0.001 for ex in exits.values())


def test_a_worker_that_exits_before_its_pid_is_read_is_confirmed_with_its_status(
    pool: WorkerPool,
) -> None:
    """Pid and exit status both wait in the pipe: one poll reads both (the pidfd opened for a
    number that may already be reused is dropped), and the real exit code is reported."""
    h = pool.submit("w", f"{T}:hard_exit", payload(code=3), LIMIT)
    wait_until(lambda: Path(f"/proc/{pool.forkserver_pid}").exists() and _pipe_has(h, 16), "exit")
    exits = pool.poll()
    assert [(ex.worker_id, ex.exitcode) for ex in exits] == [("w", 3)]
    assert h.pidfd is None and pool.running() == []


def _pipe_has(h: WorkerHandle, size: int) -> bool:
    """Whether ``h``'s status pipe holds ``size`` unread bytes (the pid and the status)."""
    buf = array.array("i", [0])
    fcntl.ioctl(h.sentinel, termios.FIONREAD, buf)
    return buf[0] >= size


def test_deadline_counts_from_the_pid_not_from_the_submit(pool: WorkerPool, tmp_path: Path) -> None:
    marker = tmp_path / "m"
    fs_pid = _stopped_forkserver(pool)
    h = pool.submit("w", f"{T}:sleep_with_finally", payload(path=str(marker), seconds=120), 60)
    time.sleep(1.0)
    resumed = time.monotonic()
    os.kill(fs_pid, signal.SIGCONT)
    wait_until(lambda: (pool.poll(), h.state)[1] == "running", "the pid")
    assert h.pid > 0 and h.started >= resumed and h.deadline == h.started + 60
    wait_until(lambda: lines(marker) == ["started"], "worker start")
    pool.terminate(["w"])
    ex = drive(pool, {"w"})["w"]
    assert ex.exitcode == ExitCode.TERMINATED and ex.terminated and not ex.timed_out


def test_stop_requested_while_launching_reaches_the_worker_once_forked(
    pool: WorkerPool, tmp_path: Path
) -> None:
    """Lease loss or shutdown while the pid has not arrived: the Worker is stopped as soon as
    it exists, never left running unsupervised."""
    marker = tmp_path / "m"
    fs_pid = _stopped_forkserver(pool)
    pool.submit("w", f"{T}:sleep_with_finally", payload(path=str(marker), seconds=120), 60)
    pool.terminate(["w"])
    os.kill(fs_pid, signal.SIGCONT)
    ex = drive(pool, {"w"})["w"]
    assert ex.terminated and ex.exitcode in (
        ExitCode.TERMINATED,  # its handler ran
        ExitCode.KILLED_SIGTERM,  # SIGTERM arrived before the child installed its handler
    )
    assert is_dead(ex.pid) and lines(marker) in ([], ["started", "finally"])


def test_shutdown_with_a_wedged_forkserver_leaves_no_pending_launch(
    pool: WorkerPool, tmp_path: Path
) -> None:
    """``terminate_all`` with a launch whose pid never comes: the forkserver is killed (it can
    fork nothing later), the launch is reported as failed, nothing is left holding capacity."""
    marker = tmp_path / "m"
    running = pool.launch(
        "a", f"{T}:sleep_with_finally", payload(path=str(marker), seconds=120), 60
    )
    wait_until(lambda: lines(marker) == ["started"], "worker start")
    fs_pid = _stopped_forkserver(pool)
    pool.submit("b", f"{T}:ok", b"{}", LIMIT)
    exits = {ex.worker_id: ex for ex in pool.terminate_all(grace=1.0)}
    assert process_state(fs_pid) is None  # killed and reaped
    assert exits["b"].launch_error == "ForkServerStuck" and exits["b"].pid == 0
    assert exits["b"].reason == "LAUNCH_FAILED"
    assert exits["a"].terminated and is_dead(running.pid)  # adopted, stopped, confirmed
    assert pool.running() == []


def test_wedged_forkserver_fails_a_submitted_launch_after_launch_timeout(tmp_path: Path) -> None:
    marker = tmp_path / "m"
    with WorkerPool([T], grace_seconds=GRACE, confirm_seconds=1.0, launch_timeout=1.0) as p:
        running = p.launch(
            "w", f"{T}:sleep_with_finally", payload(path=str(marker), seconds=120), 60
        )
        wait_until(lambda: lines(marker) == ["started"], "worker start")
        fs_pid = _stopped_forkserver(p)
        pending = p.submit("w2", f"{T}:ok", b"{}", LIMIT)
        assert pending.state == "launching"
        assert p.poll() == []  # not stuck yet
        deadline = p.next_deadline()
        assert deadline is not None and deadline <= pending.deadline  # the loop wakes for it
        exits = drive(p, {"w2"})
        assert exits["w2"].launch_error == "ForkServerStuck"
        assert process_state(fs_pid) is None  # killed: it can never fork "w2" later
        assert [h.worker_id for h in p.running()] == ["w"]
        p.poll()
        assert running.adopted and not is_dead(running.pid)  # ours to confirm now
        p.submit("w3", f"{T}:ok", b"{}", LIMIT)  # a fresh forkserver serves new launches
        assert drive(p, {"w3"})["w3"].exitcode == 0
        p.terminate(["w"])
        assert drive(p, {"w"})["w"].exitcode == ExitCode.TERMINATED


def test_host_dispatch_does_not_wait_for_a_wedged_forkserver_and_shutdown_stops_it(
    db_url: str,
) -> None:
    """A host whose forkserver cannot fork keeps cycling (exits, renewal, control) instead of
    blocking up to ``launch_timeout`` per launch; shutdown leaves no launch behind (the
    forkserver is killed, so it forks nothing later) and the requests stay pending."""
    fam = liveness_families.live_work
    migrate(db_url)
    backend = open_backend(db_url)
    try:
        with backend.transaction() as conn:
            for i in range(2):
                fam.request(conn, f"ok.{i}")
    finally:
        backend.dispose()
    bundle = build_host(db_url, [fam], lease=LeasePolicy(10.0, 1.0, 0.5), shutdown_grace=1.0)
    host, sup, pool = bundle.host, bundle.host.supervisors[0], bundle.pool
    try:
        host.start()
        fs_pid = _stopped_forkserver(pool)
        end = time.monotonic() + LIMIT
        while len(sup.running) < 2:
            assert time.monotonic() < end, "nothing dispatched"
            began = time.monotonic()
            host.cycle(max_wait=0.05)
            assert time.monotonic() - began < LIMIT / 3, "a cycle waited for the forkserver"
        assert [h.state for h in pool.running()] == ["launching", "launching"]
        host.shutdown()
        assert process_state(fs_pid) is None  # killed: no late fork of either launch
        assert pool.running() == [] and sup.running == {}
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(fs_pid, signal.SIGCONT)
        bundle.close()
    backend = open_backend(db_url)
    try:
        for i in range(2):
            row = backend.read_intent(fam.binding_name, f"ok.{i}")
            assert row is not None and row.handled_generation == 0  # durable, not completed
    finally:
        backend.dispose()


def test_host_fails_a_launch_the_wedged_forkserver_never_forks_and_retries_it(
    db_url: str,
) -> None:
    """``ForkServerStuck`` through the Supervisor: after ``launch_timeout`` the forkserver is
    killed, the invocation counts as failed and backs off, and a fresh forkserver runs the
    retry. The host kept cycling meanwhile."""
    fam = liveness_families.live_work
    migrate(db_url)
    backend = open_backend(db_url)
    try:
        with backend.transaction() as conn:
            fam.request(conn, "ok.stuck")
    finally:
        backend.dispose()
    bundle = build_host(
        db_url,
        [fam],
        lease=LeasePolicy(10.0, 1.0, 0.5),
        shutdown_grace=1.0,
        backoff=Backoff(base=0.2, cap=0.5, jitter=0.0),
    )
    host, sup, pool = bundle.host, bundle.host.supervisors[0], bundle.pool
    pool.launch_timeout = 6.0
    try:
        host.start()
        fs_pid = _stopped_forkserver(pool)
        end = time.monotonic() + LIMIT
        while sup.failed[fam.name] == 0:
            assert time.monotonic() < end, "the stuck launch never failed"
            began = time.monotonic()
            host.cycle(max_wait=0.05)
            assert time.monotonic() - began < pool.launch_timeout / 2, "a cycle blocked"
        assert process_state(fs_pid) is None  # killed: it can never fork the failed launch
        while sup.completed[fam.name] == 0:
            assert time.monotonic() < end, "the retry never completed"
            host.cycle(max_wait=0.05)
        assert sup.failed[fam.name] == 1 and pool.forkserver_pid not in (None, fs_pid)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(fs_pid, signal.SIGCONT)
        host.shutdown()
        bundle.close()


def test_payloads_of_any_length_arrive_intact(pool: WorkerPool, tmp_path: Path) -> None:
    """A launch longer than one record of the zygote's channel continues in the records that
    follow; launches sent back to back do not mix."""
    import hashlib

    from apsup.workers.zygote import _HEADER, _RECORD

    edge = _RECORD - _HEADER.size - len(f"{T}:payload_digest")
    sizes = [0, 1, edge - 1, edge, edge + 1, 3 * _RECORD + 17, 1 << 20]
    report = tmp_path / "digests.txt"
    blobs = [
        os.urandom(size - len(str(report)) - 1) if size > 100 else os.urandom(size)
        for size in sizes
    ]
    for i, blob in enumerate(blobs):
        pool.submit(f"w{i}", f"{T}:payload_digest", str(report).encode() + b"\n" + blob, LIMIT)
    exits = drive(pool, {f"w{i}" for i in range(len(blobs))})
    assert {ex.exitcode for ex in exits.values()} == {0}
    got = sorted(report.read_text().splitlines())
    assert got == sorted(f"{len(b)} {hashlib.sha256(b).hexdigest()}" for b in blobs)
