"""Worker processes for real: forkserver launches, exit codes, timeouts, signals, confirmation.

Every test uses real processes and real signals (targets in tests/worker_targets.py). No timing
assertion is tighter than "well before 30 s". Tests taking the ``flavour`` fixture run once with
the plain target and once with its ``async def`` twin (``a_<name>``), which runs in the Worker's
own event loop: outcomes, timeouts and signals must not depend on which one it is.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from multiprocess.connection import wait

from apsup.errors import ConfigError
from apsup.workers import ExitCode, ForkServerStuck, WorkerExit, WorkerHandle, WorkerPool

pytestmark = pytest.mark.timeout(120)

T = "tests.worker_targets"
REPO_ROOT = Path(__file__).resolve().parent.parent
LIMIT = 30.0  # generous bound for anything that must "happen"
GRACE = 3.0


def payload(**kwargs: Any) -> bytes:
    return orjson.dumps(kwargs)


def drive(
    pool: WorkerPool, worker_ids: set[str], *, skew: float = 0.0, limit: float = LIMIT
) -> dict[str, WorkerExit]:
    """Run the owner loop (wait on sentinels / next deadline, then poll) until these exit.

    ``skew`` shifts the pool's clock (``poll(now)``): tests launch with a long timeout, wait
    until the target is really running, then jump to its deadline. A short real timeout would
    race the child's start on a loaded machine (SIGTERM before the target's own handler)."""
    exits: dict[str, WorkerExit] = {}
    end = time.monotonic() + limit
    while not worker_ids <= exits.keys():
        assert time.monotonic() < end, f"{worker_ids - exits.keys()} did not exit in {limit}s"
        now = time.monotonic() + skew
        deadline = pool.next_deadline()
        timeout = 0.2 if deadline is None else min(max(deadline - now, 0.0), 0.2)
        wait(pool.sentinels(), timeout)
        exits.update((e.worker_id, e) for e in pool.poll(time.monotonic() + skew))
    return exits


def skew_to_deadline(handle: WorkerHandle) -> float:
    """The clock shift that makes ``handle``'s deadline "now"."""
    return handle.deadline - time.monotonic()


def wait_until(predicate: Callable[[], bool], what: str, limit: float = LIMIT) -> None:
    end = time.monotonic() + limit
    while not predicate():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.02)


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def started(path: Path) -> Callable[[], bool]:
    return lambda: "started" in lines(path)


def process_state(pid: int) -> str | None:
    """Kernel state letter of ``pid`` (``Z`` = zombie), ``None`` if it no longer exists."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return stat.rsplit(")", 1)[1].split()[0]


def is_dead(pid: int) -> bool:
    return process_state(pid) in (None, "Z", "X")


@pytest.fixture(params=["sync", "async"])
def flavour(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def tgt(flavour: str, name: str) -> str:
    """``tests.worker_targets:<name>``, or its async twin ``a_<name>``."""
    return f"{T}:{'a_' if flavour == 'async' else ''}{name}"


@pytest.fixture
def pool() -> Iterator[WorkerPool]:
    # A graceful exit must fit in the grace even on a loaded 2-CPU box, hence 3 s.
    p = WorkerPool([T], grace_seconds=GRACE, confirm_seconds=1.0)
    try:
        yield p
    finally:
        p.close()


# --- outcomes ------------------------------------------------------------------------------------


def test_success_and_handle_bookkeeping(pool: WorkerPool, flavour: str) -> None:
    handle = pool.launch("w1", tgt(flavour, "ok"), b"{}", timeout=LIMIT)
    assert handle.pid > 0 and handle.worker_id == "w1" and handle.state == "running"
    assert handle.deadline == pytest.approx(handle.started + LIMIT)
    assert pool.running() == [handle] and handle.sentinel in pool.sentinels()
    assert pool.next_deadline() == handle.deadline
    ex = drive(pool, {"w1"})["w1"]
    assert (ex.exitcode, ex.signal, ex.timed_out, ex.terminated) == (0, None, False, False)
    assert ex.pid == handle.pid and 0 <= ex.duration < LIMIT and ex.reason == "SUCCESS"
    assert pool.running() == [] and pool.sentinels() == [] and pool.next_deadline() is None


@pytest.mark.parametrize(
    ("target", "args", "expected"),
    [
        ("raise_error", {"secret": "s"}, ExitCode.PROCESSOR_FAILURE),
        ("raise_context", {}, ExitCode.BAD_CONTEXT),
        ("raise_conflict", {}, ExitCode.PROGRESS_CONFLICT),
        ("raise_stale", {}, ExitCode.STALE_TERM),
        ("exit_with", {"code": 7}, 7),
        ("sys_exit", {"code": 6}, 6),
        ("return_value", {"value": None}, ExitCode.PROCESSOR_FAILURE),
        ("return_value", {"value": True}, ExitCode.PROCESSOR_FAILURE),
        ("return_value", {"value": 200}, ExitCode.PROCESSOR_FAILURE),
        ("no_such_function", {}, ExitCode.BAD_CONTEXT),
    ],
)
def test_exit_codes(
    pool: WorkerPool, flavour: str, target: str, args: dict[str, Any], expected: int
) -> None:
    pool.launch("w", tgt(flavour, target), payload(**args), timeout=LIMIT)
    ex = drive(pool, {"w"})["w"]
    assert (ex.exitcode, ex.signal, ex.timed_out) == (expected, None, False)


def test_unimportable_target_module_is_bad_context(pool: WorkerPool) -> None:
    pool.launch("w", "tests.no_such_module:run", b"{}", timeout=LIMIT)
    assert drive(pool, {"w"})["w"].exitcode == ExitCode.BAD_CONTEXT


def test_failure_report_names_type_not_payload(flavour: str) -> None:
    """Uncaught exception: exit 1, stderr names the type, never the payload or message."""
    code = (
        "from apsup.workers.child import main; "
        f"main('{tgt(flavour, 'raise_error')}', b'{{\"secret\": \"TOPSECRET-123\"}}')"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT, timeout=60
    )
    assert proc.returncode == ExitCode.PROCESSOR_FAILURE
    assert "builtins.RuntimeError" in proc.stderr and "raise_error" in proc.stderr
    assert "TOPSECRET" not in proc.stderr and "processing failed" not in proc.stderr


def test_worker_has_own_process_group_session_and_random_state(
    pool: WorkerPool, tmp_path: Path, flavour: str
) -> None:
    out = tmp_path / "ids"
    ids = {f"w{i}" for i in range(4)}
    for wid in ids:
        pool.launch(wid, tgt(flavour, "report_identity"), payload(path=str(out)), timeout=LIMIT)
    assert {e.exitcode for e in drive(pool, ids).values()} == {0}
    rows = [line.split() for line in lines(out)]
    assert len(rows) == 4
    for pid, pgid, sid, _ in rows:
        assert pid == pgid == sid  # setsid: group leader, away from our terminal's group
        assert int(pgid) != os.getpgrp()
    assert len({r[3] for r in rows}) == 4  # reseeded: no two Workers share a random stream


# --- timeouts and termination --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flavour", "target"),
    [
        ("sync", "sleep_with_finally"),
        ("async", "sleep_with_finally"),  # suspended in an await: the task is cancelled
        ("async", "blocking_sleep_with_finally"),  # blocking inside the coroutine: raised there
    ],
)
def test_timeout_terminates_gracefully_and_finally_runs(
    pool: WorkerPool, tmp_path: Path, flavour: str, target: str
) -> None:
    marker = tmp_path / "m"
    h = pool.launch("w", tgt(flavour, target), payload(path=str(marker), seconds=120), LIMIT)
    wait_until(lambda: lines(marker) == ["started"], "worker start")
    ex = drive(pool, {"w"}, skew=skew_to_deadline(h))["w"]
    assert ex.timed_out and ex.exitcode == ExitCode.TERMINATED and ex.signal is None
    assert lines(marker) == ["started", "finally"]


def test_sigterm_ignoring_worker_is_killed_after_grace(
    pool: WorkerPool, tmp_path: Path, flavour: str
) -> None:
    marker = tmp_path / "m"
    handle = pool.launch(
        "w", tgt(flavour, "ignore_sigterm"), payload(path=str(marker), seconds=120), LIMIT
    )
    wait_until(lambda: lines(marker) == ["started"], "worker start")
    skew = skew_to_deadline(handle)
    states: set[str] = set()
    exits: list[WorkerExit] = []
    end = time.monotonic() + LIMIT
    while not exits:
        assert time.monotonic() < end
        exits = pool.poll(time.monotonic() + skew)
        if not exits:
            assert pool.running() == [handle]  # capacity held until the exit is confirmed
            states.add(handle.state)
        wait(pool.sentinels(), 0.05)
    (ex,) = exits
    assert {"terminating", "killing"} <= states
    assert (ex.exitcode, ex.signal, ex.timed_out) == (ExitCode.KILLED_SIGKILL, 9, True)
    assert ex.reason == "KILLED_SIGKILL"
    assert pool.running() == []


def test_second_sigterm_exits_immediately_with_143(
    pool: WorkerPool, tmp_path: Path, flavour: str
) -> None:
    marker = tmp_path / "m"
    handle = pool.launch(
        "w", tgt(flavour, "slow_cleanup"), payload(path=str(marker), seconds=120), LIMIT
    )
    wait_until(lambda: lines(marker) == ["started"], "worker start")
    os.kill(handle.pid, signal.SIGTERM)
    wait_until(lambda: lines(marker) == ["started", "cleanup"], "graceful cleanup to begin")
    os.kill(handle.pid, signal.SIGTERM)
    ex = drive(pool, {"w"})["w"]
    assert (ex.exitcode, ex.timed_out) == (ExitCode.FORCED_EXIT, False)


@pytest.mark.parametrize("child_ignores_sigterm", [False, True])
def test_timeout_kills_grandchildren_too(
    pool: WorkerPool, tmp_path: Path, child_ignores_sigterm: bool, flavour: str
) -> None:
    marker = tmp_path / "m"
    args = payload(path=str(marker), seconds=120, child_ignores_sigterm=child_ignores_sigterm)
    h = pool.launch("w", tgt(flavour, "spawn_grandchild"), args, LIMIT)
    wait_until(lambda: len(lines(marker)) == 2, "worker and grandchild ready")
    (grandchild,) = (int(x.split()[1]) for x in lines(marker) if x.startswith("grandchild"))
    assert not is_dead(grandchild)
    ex = drive(pool, {"w"}, skew=skew_to_deadline(h))["w"]
    assert ex.timed_out
    expected = ExitCode.KILLED_SIGKILL if child_ignores_sigterm else ExitCode.TERMINATED
    assert ex.exitcode == expected
    # The grandchild ignores SIGTERM: it dies from the group SIGKILL (after the grace when the
    # Worker ignores SIGTERM too, or as a straggler once the Worker's exit is confirmed).
    wait_until(lambda: is_dead(grandchild), "grandchild death")


def test_sigint_does_not_kill_workers_or_forkserver(
    pool: WorkerPool, tmp_path: Path, flavour: str
) -> None:
    """Ctrl-C reaches the host's process group; Workers (own session) and the forkserver ignore
    SIGINT even when it is sent to them directly, and the Worker finishes normally."""
    marker = tmp_path / "m"
    handle = pool.launch(
        "w", tgt(flavour, "sleep_then_finish"), payload(path=str(marker), seconds=3.0), LIMIT
    )
    wait_until(lambda: lines(marker) == ["started"], "worker start")
    fs_pid = pool.forkserver_pid
    assert fs_pid is not None
    os.kill(handle.pid, signal.SIGINT)
    os.kill(fs_pid, signal.SIGINT)
    time.sleep(0.2)
    assert not is_dead(handle.pid) and not is_dead(fs_pid)
    ex = drive(pool, {"w"})["w"]
    assert (ex.exitcode, ex.timed_out) == (0, False)
    assert lines(marker) == ["started", "done"]
    assert pool.forkserver_pid == fs_pid  # the same forkserver still serves launches
    pool.launch("w2", f"{T}:ok", b"{}", LIMIT)
    assert drive(pool, {"w2"})["w2"].exitcode == 0


def test_terminate_all_stops_every_group_and_confirms(
    pool: WorkerPool, tmp_path: Path, flavour: str
) -> None:
    markers = {wid: tmp_path / wid for wid in ("a", "b", "c")}
    sleeper, ignorer = tgt(flavour, "sleep_with_finally"), tgt(flavour, "ignore_sigterm")
    pool.launch("a", sleeper, payload(path=str(markers["a"]), seconds=120), 60)
    pool.launch("b", sleeper, payload(path=str(markers["b"]), seconds=120), 60)
    pool.launch("c", ignorer, payload(path=str(markers["c"]), seconds=120), 60)
    for m in markers.values():
        wait_until(started(m), "worker start")
    exits = {e.worker_id: e for e in pool.terminate_all(grace=GRACE)}
    assert set(exits) == {"a", "b", "c"}
    assert exits["a"].exitcode == exits["b"].exitcode == ExitCode.TERMINATED
    assert exits["c"].exitcode == ExitCode.KILLED_SIGKILL
    assert all(e.terminated and not e.timed_out for e in exits.values())
    assert lines(markers["a"]) == lines(markers["b"]) == ["started", "finally"]
    assert pool.running() == []


def test_nonblocking_terminate_escalates_through_poll(pool: WorkerPool, tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    pool.launch("a", f"{T}:sleep_with_finally", payload(path=str(a), seconds=120), LIMIT)
    pool.launch("b", f"{T}:ignore_sigterm", payload(path=str(b), seconds=120), LIMIT)
    pool.launch(
        "c", f"{T}:sleep_then_finish", payload(path=str(tmp_path / "c"), seconds=0.5), LIMIT
    )
    wait_until(lambda: "started" in lines(a) and "started" in lines(b), "workers start")
    pool.terminate(["a", "b", "unknown"])
    assert {h.worker_id: h.state for h in pool.running()}["a"] == "terminating"
    exits = drive(pool, {"a", "b", "c"})
    assert (exits["a"].exitcode, exits["a"].terminated) == (ExitCode.TERMINATED, True)
    assert (exits["b"].exitcode, exits["b"].terminated) == (ExitCode.KILLED_SIGKILL, True)
    assert (exits["c"].exitcode, exits["c"].terminated) == (0, False)
    assert not any(e.timed_out for e in exits.values())


# --- exit confirmation ---------------------------------------------------------------------------


def test_dead_worker_stays_running_until_forkserver_confirms(
    pool: WorkerPool, tmp_path: Path
) -> None:
    """A Worker that is dead (a zombie: the forkserver is stopped and cannot reap it) is not an
    exit: it keeps its capacity, becomes "unconfirmed", and is reported only once the status
    written by the forkserver's waitpid arrives."""
    marker = tmp_path / "m"
    handle = pool.launch(
        "w", f"{T}:sleep_with_finally", payload(path=str(marker), seconds=120), LIMIT
    )
    wait_until(lambda: lines(marker) == ["started"], "worker start")
    skew = skew_to_deadline(handle)
    fs_pid = pool.forkserver_pid
    assert fs_pid is not None
    os.kill(fs_pid, signal.SIGSTOP)
    try:
        end = time.monotonic() + LIMIT
        while handle.state != "unconfirmed":
            assert time.monotonic() < end, handle.state
            assert pool.poll(time.monotonic() + skew) == []
            time.sleep(0.05)
        wait_until(lambda: process_state(handle.pid) == "Z", "zombie")  # dead, not confirmed
        assert pool.running() == [handle] and handle.sentinel in pool.sentinels()
        assert pool.poll(time.monotonic() + skew) == []
    finally:
        os.kill(fs_pid, signal.SIGCONT)
    ex = drive(pool, {"w"}, skew=skew)["w"]
    assert (ex.exitcode, ex.timed_out) == (ExitCode.TERMINATED, True)
    assert lines(marker) == ["started", "finally"]


def test_forkserver_death_hands_its_workers_to_the_pool(pool: WorkerPool, tmp_path: Path) -> None:
    """When the forkserver dies, multiprocess reports exit code 255 for its children; that is
    not an exit. The pool (a child subreaper) adopts the still-running Worker, keeps enforcing
    its deadline, and confirms its real exit with its own waitpid."""
    assert pool.subreaper
    marker = tmp_path / "m"
    handle = pool.launch(
        "w", f"{T}:sleep_with_finally", payload(path=str(marker), seconds=120), LIMIT
    )
    wait_until(lambda: lines(marker) == ["started"], "worker start")
    fs_pid = pool.forkserver_pid
    assert fs_pid is not None
    os.kill(fs_pid, signal.SIGKILL)
    end = time.monotonic() + LIMIT
    while not handle.adopted:
        assert time.monotonic() < end
        assert pool.poll() == []
        time.sleep(0.02)
    assert not handle.status_lost and handle.state == "running" and not is_dead(handle.pid)
    assert handle.sentinel in pool.sentinels()  # its pidfd: wakes the owner when it exits
    assert pool.running() == [handle] and pool.unconfirmed() == []
    # New launches get a fresh forkserver meanwhile.
    pool.launch("w2", f"{T}:ok", b"{}", LIMIT)
    assert drive(pool, {"w2"})["w2"].exitcode == 0
    assert pool.forkserver_pid not in (None, fs_pid)
    # Its deadline still applies: SIGTERM, graceful exit, confirmed by our own waitpid.
    ex = drive(pool, {"w"}, skew=skew_to_deadline(handle))["w"]
    assert (ex.exitcode, ex.timed_out) == (ExitCode.TERMINATED, True)
    assert lines(marker) == ["started", "finally"]
    assert pool.running() == []


def test_worker_that_died_with_its_forkserver_is_confirmed_from_its_zombie(
    pool: WorkerPool, tmp_path: Path
) -> None:
    """A Worker that exited while its forkserver could not reap it is a zombie; when the
    forkserver dies the zombie is ours, and its real status is the confirmation."""
    pool.launch("w", f"{T}:hard_exit", payload(code=3), LIMIT)
    handle = pool.running()[0]
    fs_pid = pool.forkserver_pid
    assert fs_pid is not None
    os.kill(fs_pid, signal.SIGSTOP)
    wait_until(lambda: process_state(handle.pid) == "Z", "zombie")
    os.kill(fs_pid, signal.SIGKILL)
    ex = drive(pool, {"w"})["w"]
    assert ex.exitcode == 3 and pool.running() == []


def test_real_exit_255_is_confirmed_while_forkserver_lives(pool: WorkerPool) -> None:
    """255 is also what multiprocess fabricates on a dead forkserver; with the forkserver alive
    a real 255 is an ordinary confirmed exit."""
    pool.launch("w", f"{T}:hard_exit", payload(code=255), LIMIT)
    assert drive(pool, {"w"})["w"].exitcode == 255


def test_wedged_forkserver_launch_times_out_and_is_replaced(tmp_path: Path) -> None:
    marker = tmp_path / "m"
    with WorkerPool([T], grace_seconds=GRACE, confirm_seconds=1.0, launch_timeout=1.0) as p:
        running = p.launch(
            "w", f"{T}:sleep_with_finally", payload(path=str(marker), seconds=120), 60
        )
        wait_until(lambda: lines(marker) == ["started"], "worker start")
        fs_pid = p.forkserver_pid
        assert fs_pid is not None
        os.kill(fs_pid, signal.SIGSTOP)  # wedged: accepts nothing, forks nothing
        with pytest.raises(ForkServerStuck):
            p.launch("w2", f"{T}:ok", b"{}", LIMIT)
        assert process_state(fs_pid) is None  # killed and reaped: it can never fork "w2" later
        assert [h.worker_id for h in p.running()] == ["w"]
        p.poll()
        assert running.adopted and not is_dead(running.pid)  # ours to confirm now
        p.launch("w3", f"{T}:ok", b"{}", LIMIT)  # a fresh forkserver serves new launches
        assert drive(p, {"w3"})["w3"].exitcode == 0
        ex = drive(p, {"w"}, skew=skew_to_deadline(running))["w"]
        assert (ex.exitcode, ex.timed_out) == (ExitCode.TERMINATED, True)


@pytest.mark.parametrize(
    ("body", "match"),
    [("raise RuntimeError('boom')", "raised at import"), ("time.sleep(600)", "hangs")],
)
def test_broken_preload_module_is_a_startup_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str, match: str
) -> None:
    (tmp_path / "apsup_broken_family.py").write_text(f"import time\n{body}\n")
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    started = time.monotonic()
    with pytest.raises(ConfigError, match=match):
        WorkerPool(["apsup_broken_family"], start_timeout=2.0)
    assert time.monotonic() - started < LIMIT
    assert WorkerPool([T]).close() == []  # nothing left behind that blocks a new pool


# --- forkserver preload, throughput, API guards -------------------------------------------------


def test_many_launches_reuse_the_preloaded_forkserver(pool: WorkerPool, tmp_path: Path) -> None:
    out = tmp_path / "imports"
    fs_pid = pool.forkserver_pid
    for i in range(200):
        pool.launch(f"w{i}", f"{T}:report_import", payload(path=str(out)), LIMIT)
        assert drive(pool, {f"w{i}"})[f"w{i}"].exitcode == 0
    rows = [tuple(map(int, line.split())) for line in lines(out)]
    assert len(rows) == 200
    # The module was imported once, in the forkserver (every Worker's parent), never per child.
    assert {imported_in for imported_in, _, _ in rows} == {fs_pid}
    assert {ppid for _, _, ppid in rows} == {fs_pid}
    assert all(pid != imported_in for imported_in, pid, _ in rows)
    assert "tests.worker_targets" not in sys.modules  # and not by this process either


def test_concurrent_launches(pool: WorkerPool) -> None:
    ids = {f"w{i}" for i in range(16)}
    for wid in ids:
        pool.launch(wid, f"{T}:ok", b"{}", LIMIT)
    assert len(pool.running()) == 16
    assert {e.exitcode for e in drive(pool, ids).values()} == {0}


def test_launch_validation(pool: WorkerPool) -> None:
    with pytest.raises(TypeError):
        pool.launch("w", f"{T}:ok", bytearray(b"{}"), LIMIT)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        pool.launch("w", "tests.worker_targets.ok", b"{}", LIMIT)
    with pytest.raises(ValueError):
        pool.launch("w", f"{T}:ok", b"{}", 0)
    pool.launch("w", f"{T}:sleep_then_finish", payload(path=os.devnull, seconds=0.2), LIMIT)
    with pytest.raises(ValueError, match="still running"):
        pool.launch("w", f"{T}:ok", b"{}", LIMIT)
    with pytest.raises(RuntimeError, match="already open"):
        WorkerPool([T])
    drive(pool, {"w"})
    pool.close()
    with pytest.raises(RuntimeError, match="closed"):
        pool.launch("w", f"{T}:ok", b"{}", LIMIT)


def test_missing_preload_module_is_a_startup_error() -> None:
    with pytest.raises(ConfigError, match="apsup_no_such_family_module"):
        WorkerPool(["apsup_no_such_family_module"])
    with WorkerPool([T]) as p:  # the failed pool released the process-wide slot
        p.launch("w", f"{T}:ok", b"{}", LIMIT)
        assert drive(p, {"w"})["w"].exitcode == 0


def test_close_terminates_running_workers_and_stops_forkserver(tmp_path: Path) -> None:
    marker = tmp_path / "m"
    p = WorkerPool([T], grace_seconds=GRACE, confirm_seconds=1.0)
    handle = p.launch("w", f"{T}:sleep_with_finally", payload(path=str(marker), seconds=120), 60)
    wait_until(lambda: lines(marker) == ["started"], "worker start")
    fs_pid = p.forkserver_pid
    assert fs_pid is not None
    assert p.close() == []
    assert lines(marker) == ["started", "finally"]
    assert is_dead(handle.pid) and process_state(fs_pid) is None  # forkserver reaped
    assert p.closed and p.close() == []


def test_pool_cannot_be_inherited_across_fork(pool: WorkerPool) -> None:
    """The forkserver is per process: a forked child of a pool owner must create pools only
    after the owner's pool is gone, and is told so clearly instead of failing obscurely."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the forked child
        code = 3
        try:
            WorkerPool([T])
            code = 1
        except RuntimeError as exc:
            code = 0 if "forked" in str(exc) else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


# --- async specifics -----------------------------------------------------------------------------


def test_async_target_that_swallows_the_cancellation_is_still_terminated(
    pool: WorkerPool, tmp_path: Path
) -> None:
    """A stopped invocation never counts as a success, even if the coroutine catches the
    cancellation that the first SIGTERM caused and returns normally."""
    marker = tmp_path / "m"
    h = pool.launch("w", f"{T}:a_swallow_cancel", payload(path=str(marker), seconds=120), LIMIT)
    wait_until(lambda: lines(marker) == ["started"], "worker start")
    ex = drive(pool, {"w"}, skew=skew_to_deadline(h))["w"]
    assert (ex.exitcode, ex.timed_out) == (ExitCode.TERMINATED, True)
    assert lines(marker) == ["started", "swallowed"]


def test_forkserver_has_no_event_loop_even_with_async_drivers_preloaded(tmp_path: Path) -> None:
    """The async drivers are preloaded as modules only: no loop (nor aiosqlite thread) exists
    in the forkserver, so nothing of one is forked into Workers; each Worker makes its own."""
    marker = tmp_path / "m"
    preload = [T, "apsup.store.async_engine", "aiosqlite", "aiomysql", "apsup.workers.invoke"]
    with WorkerPool(preload, grace_seconds=GRACE, confirm_seconds=1.0) as p:
        p.launch("w", f"{T}:loop_state", payload(path=str(marker)), LIMIT)
        assert drive(p, {"w"})["w"].exitcode == 0
        p.launch("w2", f"{T}:a_ok", b"{}", LIMIT)  # and the Worker's own loop works
        assert drive(p, {"w2"})["w2"].exitcode == 0
    assert lines(marker) == ["inherited=False"]
