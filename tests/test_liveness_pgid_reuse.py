"""The pool never signals a process group whose Worker was already reaped and whose number now
belongs to someone else.

The reuse is real, not simulated: once the forkserver has reaped a Worker (its status waits in
the pipe, not yet collected), the test makes the kernel hand the Worker's pid to a new, unrelated
process that leads its own session and group (``/proc/sys/kernel/ns_last_pid``, root only), then
lets the pool terminate and confirm the Worker. The unrelated process must survive. No database:
this is the pool alone.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
from multiprocess.connection import wait

from apsup.workers.pool import WorkerPool

T = "tests.worker_targets"
NS_LAST_PID = Path("/proc/sys/kernel/ns_last_pid")

pytestmark = pytest.mark.timeout(120)


def _can_choose_pids() -> bool:
    try:
        with NS_LAST_PID.open("w") as fh:
            fh.write(NS_LAST_PID.read_text().strip())
        return True
    except OSError:
        return False


@pytest.fixture
def pool() -> Iterator[WorkerPool]:
    if not _can_choose_pids():
        pytest.skip("needs a writable /proc/sys/kernel/ns_last_pid (root) to reuse a pid")
    p = WorkerPool([T], grace_seconds=1.0, confirm_seconds=1.0)
    try:
        yield p
    finally:
        p.close()


def _process_with_pid(pid: int, attempts: int = 200) -> subprocess.Popen[bytes] | None:
    """A new session leader (so it leads process group ``pid``) that gets exactly ``pid``;
    other processes on the machine may take the number first, hence the attempts."""
    for _ in range(attempts):
        with NS_LAST_PID.open("w") as fh:
            fh.write(str(pid - 1))
        proc = subprocess.Popen(["sleep", "300"], start_new_session=True)
        if proc.pid == pid:
            return proc
        proc.kill()
        proc.wait()
    return None


@pytest.mark.parametrize("how", ["deadline", "terminate", "confirm"])
def test_a_reaped_workers_number_reused_by_another_group_is_never_signalled(
    pool: WorkerPool, tmp_path: Path, how: str
) -> None:
    payload = orjson.dumps({"path": str(tmp_path / "m"), "seconds": 0.3})
    timeout = 0.5 if how == "deadline" else 60.0
    handle = pool.launch("w", f"{T}:sleep_then_finish", payload, timeout)
    # The Worker exits; the forkserver reaps it and writes its status (not collected yet).
    assert wait([handle.sentinel], 30), "the Worker did not exit"
    victim = _process_with_pid(handle.pid)
    if victim is None:
        pytest.skip(f"pid {handle.pid} was taken by another process each time")
    try:
        assert os.getpgid(victim.pid) == handle.pid  # the number now names another group
        if how == "deadline":
            time.sleep(timeout)  # its deadline has passed: the pool would SIGTERM its group
            pool._enforce(handle, time.monotonic())
        elif how == "terminate":
            pool.terminate(["w"])  # lease loss / shutdown: SIGTERM to its group
        exits = []
        end = time.monotonic() + 30
        while not exits and time.monotonic() < end:
            exits = pool.poll()  # confirms, then SIGKILLs the stragglers of its group
            time.sleep(0.02)
        assert [e.worker_id for e in exits] == ["w"]
        time.sleep(0.2)
        assert victim.poll() is None, f"an unrelated process was killed: {victim.returncode}"
    finally:
        victim.kill()
        victim.wait()


def test_stragglers_of_a_reaped_worker_are_still_killed(pool: WorkerPool, tmp_path: Path) -> None:
    """The pidfd keeps naming the Worker's group after the Worker itself is gone: a grandchild
    left behind in it dies when the exit is confirmed."""
    path = tmp_path / "m"
    payload = orjson.dumps({"path": str(path), "seconds": 0.3, "child_ignores_sigterm": True})
    handle = pool.launch("w", f"{T}:spawn_grandchild", payload, 60.0)
    assert wait([handle.sentinel], 30), "the Worker did not exit"
    grandchild = int(
        next(
            line.split()[1]
            for line in path.read_text().splitlines()
            if line.startswith("grandchild")
        )
    )
    exits = []
    end = time.monotonic() + 30
    while not exits and time.monotonic() < end:
        exits = pool.poll()
        time.sleep(0.02)
    assert exits and exits[0].worker_id == "w"
    end = time.monotonic() + 10
    while time.monotonic() < end:
        try:
            with open(f"/proc/{grandchild}/stat") as fh:
                if fh.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
        except OSError:
            break
        time.sleep(0.05)
    else:
        raise AssertionError("the straggler outlived its Worker")
