"""The launch path under faults: never two Workers for one key, every child reaped, and a
transient fault or a stop during startup is never reported as a configuration error.

Faults are injected inside the forkserver process (``tests.forkserver_faults``):

- the forkserver SIGKILLs itself right after forking a Worker, before reporting its pid: the
  Worker runs on, reparented to the host. Its launch must hold the key until that Worker is
  found and confirmed gone; before, the launch counted as failed and the retry started a second
  Worker for the same key, claimed generation and term while the first still ran;
- the forkserver's first fork is refused once (EAGAIN): the host must retry, not exit 2;
- SIGINT to the whole process group (a terminal's Ctrl-C) while the forkserver imports its
  preloads: the host must exit cleanly, without a traceback or a configuration error.
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest
from multiprocess import connection

from apsup.errors import WorkerStartError
from apsup.workers.pool import WorkerPool
from tests.forkserver_faults import ENV
from tests.replicas.cluster import REPO_ROOT, descendants

pytestmark = pytest.mark.timeout(180)

PRELOAD = ["tests.forkserver_faults", "tests.worker_targets"]
PREFIX = "POWERCONTEXT_SERVER_RUNTIME_"


@pytest.fixture
def faults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "faults"
    folder.mkdir()
    monkeypatch.setenv(ENV, str(folder))
    return folder


def _zombie_children(parent: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                fields = fh.read().decode(errors="replace").rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] == "Z" and int(fields[1]) == parent:
            out.append(int(entry))
    return out


def test_a_worker_whose_forkserver_died_before_reporting_it_holds_its_launch(
    faults: Path, tmp_path: Path
) -> None:
    pool = WorkerPool(PRELOAD, grace_seconds=1.0, confirm_seconds=2.0)
    try:
        forkserver = pool.forkserver_pid
        (faults / "die-after-fork").touch()
        marks = tmp_path / "marks"
        payload = orjson.dumps({"path": str(marks), "seconds": 2.0})
        pool.submit("w1", "tests.worker_targets:sleep_then_finish", payload, 30.0)
        deadline = time.monotonic() + 30
        exits = []
        while not exits and time.monotonic() < deadline:
            connection.wait(pool.sentinels(), 0.2)
            exits = pool.poll()
            if not exits:
                assert len(pool) == 1, "the launch let go of its Worker's capacity"
        assert not (faults / "die-after-fork").exists(), "the fault did not fire"
        assert exits, "the Worker's exit was never confirmed"
        (ex,) = exits
        # Confirmed only once the Worker had finished, with its real status (our own waitpid).
        assert ex.launch_error is None, ex
        assert marks.read_text().split() == ["started", "done"]
        assert ex.exitcode == 0 and ex.pid > 0
        pool.poll()  # the next poll reaps the dead forkserver too
        zombies = set(_zombie_children(os.getpid()))
        assert ex.pid not in zombies and forkserver not in zombies, zombies
    finally:
        pool.close()


def test_a_refused_first_fork_is_transient_not_a_configuration_error(faults: Path) -> None:
    (faults / "fail-next-fork").touch()
    with pytest.raises(WorkerStartError, match="preload modules import fine"):
        WorkerPool(PRELOAD)
    assert not (faults / "fail-next-fork").exists()
    WorkerPool(PRELOAD).close()  # the next start works


APSUP_RUN = ["-m", "apsup.cli", "run", "--app", "tests.fork_fault_app"]
#: The same host with a 0.3 s failure backoff.
FAST_RETRY_HOST = ["-m", "tests.fork_fault_host"]


def _run(
    db_url: str, tmp_path: Path, cmd: list[str] = APSUP_RUN, **env: str
) -> subprocess.Popen[str]:
    from apsup.store import migrate

    migrate(db_url)
    full = {k: v for k, v in os.environ.items() if not k.startswith(PREFIX)}
    full.update(
        {
            PREFIX + "DATABASE_URL": db_url,
            PREFIX + "HTTP_PORT": "off",
            "PYTHONPATH": str(REPO_ROOT),
            "APSUP_TEST_MARKS": str(tmp_path / "marks"),
            **env,
        }
    )
    return subprocess.Popen(
        [sys.executable, *cmd],
        env=full,
        cwd=str(tmp_path),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _request(db_url: str, scope: str) -> int:
    import tests.fork_fault_app  # noqa: F401
    from apsup.registry import default_registry
    from apsup.store import open_backend
    from apsup.supervisor.control import notify

    fam = default_registry.get("fork-fault")
    backend = open_backend(db_url)
    try:
        with backend.transaction() as conn:
            g = fam.request(conn, scope)
    finally:
        backend.dispose()
    notify(db_url, fam.name)
    return g


def _handled(db_url: str, scope: str) -> int:
    from apsup.store import intents, open_backend

    backend = open_backend(db_url)
    try:
        with backend.read() as conn:
            row = intents.get(conn, "fork-fault", scope)
    finally:
        backend.dispose()
    return 0 if row is None else row.handled_generation


def _holds_term(db_url: str) -> bool:
    """Whether a host claimed its term (it starts its Worker forkserver before it claims)."""
    from apsup.store import open_backend

    backend = open_backend(db_url)
    try:
        return any(row.holder_id for row in backend.lease_rows())
    except Exception:
        return False
    finally:
        backend.dispose()


def _forkserver_of(pid: int) -> int | None:
    for child in descendants(pid):
        try:
            with open(f"/proc/{child}/cmdline", "rb") as fh:
                if b"apsup.workers.zygote" in fh.read():
                    return child
        except OSError:
            continue
    return None


def _stop(proc: subprocess.Popen[str]) -> tuple[int, str]:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
    return proc.returncode, err


def test_no_two_workers_for_one_key_when_the_forkserver_dies_mid_launch(
    db_url: str, tmp_path: Path, faults: Path
) -> None:
    """A real host: the forkserver dies right after forking the Worker of ``k``. The Worker runs
    on for 3 s; a retry after the failure backoff (0.3 s here) must not start a second Worker for
    ``k`` meanwhile, and the exited Worker must be reaped."""
    proc = _run(db_url, tmp_path, FAST_RETRY_HOST, APSUP_TEST_SLEEP="3")
    try:
        deadline = time.monotonic() + 60
        while not _holds_term(db_url):  # its forkserver is up: the fault hits no startup probe
            assert proc.poll() is None, proc.communicate()[1][-2000:]
            assert time.monotonic() < deadline, "the host never claimed its term"
            time.sleep(0.05)
        (faults / "die-after-fork").touch()
        g = _request(db_url, "k")
        while _handled(db_url, "k") < g:
            assert proc.poll() is None, proc.communicate()[1][-2000:]
            assert time.monotonic() < deadline, "the request was never handled"
            time.sleep(0.1)
        assert not (faults / "die-after-fork").exists(), "the fault did not fire"
        time.sleep(0.5)
        zombies = _zombie_children(proc.pid)
    finally:
        code, err = _stop(proc)
    lines = (tmp_path / "marks").read_text().split("\n")
    spans: list[tuple[float, float]] = []
    open_at: dict[str, float] = {}
    for line in filter(None, lines):
        what, _scope, pid, at = line.split()
        if what == "start":
            open_at[pid] = float(at)
        else:
            spans.append((open_at.pop(pid), float(at)))
    spans.extend((start, float("inf")) for start in open_at.values())
    spans.sort()
    overlaps = [(a, b) for a, b in itertools.pairwise(spans) if b[0] < a[1]]
    assert overlaps == [], f"two Workers ran for one key at once: {overlaps}"
    assert zombies == [], "an exited child was left unreaped"
    assert code == 0, err[-2000:]


def test_a_refused_first_fork_retries_instead_of_exiting_as_misconfigured(
    db_url: str, tmp_path: Path, faults: Path
) -> None:
    (faults / "fail-next-fork").touch()
    proc = _run(db_url, tmp_path)
    try:
        deadline = time.monotonic() + 60
        g = _request(db_url, "r")
        while _handled(db_url, "r") < g:
            assert proc.poll() is None, f"exited {proc.returncode}: {proc.communicate()[1][-2000:]}"
            assert time.monotonic() < deadline, "the request was never handled"
            time.sleep(0.1)
    finally:
        code, err = _stop(proc)
    assert code == 0, err[-2000:]
    assert "worker forkserver failed to start; retrying" in err
    assert "configuration error" not in err


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_the_host_starts_exits_cleanly(
    db_url: str, tmp_path: Path, sig: signal.Signals
) -> None:
    """The signal reaches the whole process group (a terminal's Ctrl-C, a service manager's
    stop) while the forkserver is still importing its preloads."""
    proc = _run(db_url, tmp_path, APSUP_TEST_SLOW_IMPORT="3")
    deadline = time.monotonic() + 60
    while _forkserver_of(proc.pid) is None:
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        assert time.monotonic() < deadline, "the host's forkserver never started"
        time.sleep(0.02)
    time.sleep(0.5)  # inside the slow preload import
    os.killpg(proc.pid, sig)
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    assert proc.returncode in (0, 130, 143), err[-2000:]
    assert "Traceback" not in err, err[-2000:]
    assert "configuration error" not in err, err[-2000:]
    assert "KeyboardInterrupt" not in err, err[-2000:]
