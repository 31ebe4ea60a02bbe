"""Drive real hosts for the acceptance tests: in-process (``LiveHost``) or as a subprocess
(``HostProcess``, which runs ``tests.acceptance.host_runner`` so it can be SIGKILLed/SIGTERMed).

Both run the real Supervisor, Worker pool and database. Hosts get a short failure backoff
through ``build_host(backoff=...)`` (the RFC's ~30 s base would make every retry test slow). The
only test seam is the scheduler class the Supervisor instantiates: :func:`scheduler_class`
returns a ``Scheduler`` subclass with optionally a smaller discovery page and crash points for
the kill -9 tests; its decisions are untouched.

Waits are bounded by generous deadlines and fail with a message naming what did not happen;
no assertion is made on durations.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from sqlalchemy import Connection

import apsup.supervisor.supervisor as supervisor_module
from apsup.registry import Family
from apsup.scheduling import Backoff, Scheduler
from apsup.store import SqlBackend, intents, scans
from apsup.store.intents import Intent
from apsup.store.scans import ScanState
from apsup.supervisor.control import notify
from apsup.supervisor.host import LeasePolicy
from apsup.supervisor.launcher import HostBundle, build_host
from tests.acceptance import families as fams

REPO_ROOT = Path(__file__).resolve().parents[2]
LIMIT = 60.0  # generous bound for anything that must happen; never a performance assertion
FAST_BACKOFF = (0.3, 1.5)  # base, cap (seconds): exponential with 10 % jitter, as in the RFC


def make_backoff(backoff: tuple[float, float]) -> Backoff:
    base, cap = backoff
    return Backoff(base=base, factor=2.0, cap=cap, jitter=0.1)


def scheduler_class(
    *,
    page_size: int | None = None,
    kill_after_admissions: int | None = None,
    kill_after_scan_start: bool = False,
) -> type[Scheduler]:
    """A ``Scheduler`` with a test page size; the crash points SIGKILL this process.

    ``kill_after_admissions=N``: right after the N-th admission committed, before the core puts
    the Scope in its ready queue (RFC acceptance 6). ``kill_after_scan_start``: right after the
    scan-start transaction committed, before any page is read.
    """

    class AcceptanceScheduler(Scheduler):
        admissions = 0

        def __init__(self, specs: list[Any], **kwargs: Any) -> None:
            if page_size is not None:
                specs = [dataclasses.replace(s, page_size=page_size) for s in specs]
            kwargs.setdefault("conflict_delay", 0.3)
            kwargs.setdefault("error_delay", 1.0)
            super().__init__(specs, **kwargs)

        def on_admitted(self, family: str, scope_id: str, admitted: bool) -> None:
            if admitted and kill_after_admissions is not None:
                AcceptanceScheduler.admissions += 1
                if AcceptanceScheduler.admissions >= kill_after_admissions:
                    os.kill(os.getpid(), signal.SIGKILL)
            super().on_admitted(family, scope_id, admitted)

        def on_scan_started(self, family: str, *args: Any) -> None:
            if kill_after_scan_start:
                os.kill(os.getpid(), signal.SIGKILL)
            super().on_scan_started(family, *args)

    return AcceptanceScheduler


@contextlib.contextmanager
def patched_scheduler(cls: type[Scheduler]) -> Iterator[None]:
    original = supervisor_module.Scheduler
    supervisor_module.Scheduler = cls  # type: ignore[misc]
    try:
        yield
    finally:
        supervisor_module.Scheduler = original  # type: ignore[misc]


def lease_policy(poll_seconds: float = 0.3) -> LeasePolicy:
    return LeasePolicy(lease_seconds=15.0, renew_seconds=3.0, poll_seconds=poll_seconds)


# --- in-process host ---------------------------------------------------------------------------


class LiveHost:
    """A real host driven by the test thread: ``run_until(predicate)`` cycles it."""

    def __init__(
        self,
        url: str,
        families: list[Family],
        *,
        worker_settings: dict[str, str] | None = None,
        backoff: tuple[float, float] = FAST_BACKOFF,
        page_size: int | None = None,
        shutdown_grace: float = 3.0,
        grace_seconds: float = 1.0,
        start: bool = True,
        hooks: Any = None,
    ) -> None:
        self.url = url
        self._patch = patched_scheduler(scheduler_class(page_size=page_size))
        self._patch.__enter__()
        try:
            self.bundle: HostBundle = build_host(
                url,
                families,
                worker_settings=worker_settings,
                shutdown_grace=shutdown_grace,
                grace_seconds=grace_seconds,
                lease=lease_policy(),
                backoff=make_backoff(backoff),
                hooks=hooks,
            )
        except BaseException:
            self._patch.__exit__(None, None, None)
            raise
        self.host = self.bundle.host
        self.closed = False
        if start:
            self.host.start()

    @property
    def supervisor(self) -> supervisor_module.Supervisor:
        return self.host.supervisors[0]

    def snapshot(self) -> dict[str, Any]:
        core = self.supervisor.core
        return {} if core is None else core.snapshot()

    def cycle(self, max_wait: float = 0.05) -> None:
        self.host.cycle(max_wait=max_wait)

    def run_until(self, predicate: Callable[[], Any], what: str, limit: float = LIMIT) -> Any:
        end = time.monotonic() + limit
        while True:
            value = predicate()
            if value:
                return value
            if time.monotonic() > end:
                raise AssertionError(
                    f"host did not reach: {what} (within {limit:.0f}s); core: {self.snapshot()}"
                )
            self.cycle()

    def run_for(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.cycle(max_wait=min(0.05, max(end - time.monotonic(), 0)))

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self.host.shutdown()
        finally:
            try:
                self.bundle.close()
            finally:
                self._patch.__exit__(None, None, None)


# --- subprocess host ---------------------------------------------------------------------------


class HostProcess:
    """``python -m tests.acceptance.host_runner CONFIG`` with stdout/stderr in files."""

    def __init__(self, workdir: Path, name: str, config: dict[str, Any]) -> None:
        self.workdir = workdir
        self.name = name
        self.config = config
        self.stdout_path = workdir / f"{name}.out"
        self.stderr_path = workdir / f"{name}.err"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> HostProcess:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p
        )
        with open(self.stdout_path, "wb") as out, open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.acceptance.host_runner", json.dumps(self.config)],
                stdout=out,
                stderr=err,
                stdin=subprocess.DEVNULL,
                cwd=REPO_ROOT,
                env=env,
            )
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def output(self) -> str:
        return self.stdout_path.read_text() if self.stdout_path.exists() else ""

    def errors(self) -> str:
        return self.stderr_path.read_text() if self.stderr_path.exists() else ""

    def wait_ready(self, limit: float = LIMIT) -> None:
        end = time.monotonic() + limit
        while "READY" not in self.output():
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"host {self.name} exited with {self.proc.returncode} before READY:\n"
                    f"{self.errors()[-3000:]}"
                )
            if time.monotonic() > end:
                raise AssertionError(f"host {self.name} not ready within {limit:.0f}s")
            time.sleep(0.02)

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def wait(self, limit: float = LIMIT) -> int:
        assert self.proc is not None
        try:
            return self.proc.wait(limit)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"host {self.name} did not exit within {limit:.0f}s:\n{self.errors()[-3000:]}"
            ) from None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """Teardown: make sure nothing outlives the test."""
        if self.alive():
            self.signal(signal.SIGKILL)
            with contextlib.suppress(Exception):
                self.wait(10)


def wait_for(predicate: Callable[[], Any], what: str, limit: float = LIMIT) -> Any:
    end = time.monotonic() + limit
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {limit:.0f}s waiting for: {what}")
        time.sleep(0.05)


# --- database facts ----------------------------------------------------------------------------


def intent(backend: SqlBackend, fam: Family, scope_id: str) -> Intent | None:
    with backend.read() as conn:
        return intents.get(conn, fam.binding_name, scope_id)


def all_intents(backend: SqlBackend, fam: Family) -> dict[str, Intent]:
    from sqlalchemy import select

    from apsup.store.schema import intents as table

    with backend.read() as conn:
        rows = conn.execute(
            select(table.c.scope_id).where(table.c.binding_name == fam.binding_name)
        ).scalars()
        out = {}
        for scope in list(rows):
            row = intents.get(conn, fam.binding_name, scope)
            assert row is not None
            out[scope] = row
        return out


def scan_state(backend: SqlBackend, fam: Family) -> ScanState | None:
    with backend.read() as conn:
        return scans.get_state(conn, fam.binding_name)


def handled(backend: SqlBackend, fam: Family, scope_id: str) -> bool:
    row = intent(backend, fam, scope_id)
    return row is not None and row.requested_generation > 0 and not row.pending_request


def events(backend: SqlBackend, fam: Family | str | None = None) -> list[dict[str, Any]]:
    name = fam.name if isinstance(fam, Family) else fam
    with backend.read() as conn:
        return fams.event_rows(conn, name)


def scope_events(backend: SqlBackend, fam: Family, scope_id: str) -> list[dict[str, Any]]:
    return [e for e in events(backend, fam) if e["scope_id"] == scope_id]


def completed(backend: SqlBackend, fam: Family, scope_id: str | None = None) -> int:
    return sum(
        1
        for e in events(backend, fam)
        if e["outcome"] == "ok" and (scope_id is None or e["scope_id"] == scope_id)
    )


def write(backend: SqlBackend, fn: Callable[[Connection], Any]) -> Any:
    with backend.transaction() as conn:
        return fn(conn)


def request(backend: SqlBackend, fam: Family, scope_id: str, *, tell: bool = True) -> int:
    """Accept an explicit request. ``fam.request`` wakes a local host (SQLite) when it commits;
    ``tell=False`` writes the intent below that hook, as a lost wake-up (the notification is
    never sent)."""
    if not tell:
        return int(write(backend, lambda c: intents.request(c, fam.binding_name, scope_id)))
    generation = write(backend, lambda c: fam.request(c, scope_id))
    notify(backend.url, fam.name)  # redundant with the commit hook; harmless
    return int(generation)


def mark_dirty(backend: SqlBackend, fam: Family, scope_id: str, *, tell: bool = True) -> int:
    if not tell:
        return int(write(backend, lambda c: intents.mark_dirty(c, fam.binding_name, scope_id)))
    generation = write(backend, lambda c: fam.mark_dirty(c, scope_id))
    notify(backend.url, fam.name)
    return int(generation)


def set_flag(backend: SqlBackend, name: str) -> None:
    write(backend, lambda c: fams.set_flag(c, name))


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie still answers kill(0); it no longer runs.
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def max_overlap(intervals: list[tuple[int, int]]) -> int:
    """The largest number of [start, end] intervals open at one instant."""
    points = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    depth = best = 0
    for _, delta in points:  # at equal times -1 sorts first: touching intervals do not overlap
        depth += delta
        best = max(best, depth)
    return best
