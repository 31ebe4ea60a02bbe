"""A processor that returns without acknowledging is acknowledged by its Supervisor, fenced by the
term that dispatched it (both backends, a real host, real Workers).

The Supervisor's dispatch read is the duplicate check (``handled < G`` right before the launch),
so a Worker whose processor needs no database opens no session at all: it exits with
``ExitCode.ACKNOWLEDGE`` and the host commits the acknowledgment in a fenced transaction of its
own. What must hold:

- the acknowledgment is durable before the invocation counts as a success, and the Worker held
  no database descriptor while its processor ran;
- the host's acknowledgment is refused once the dispatching term is no longer the valid one:
  nothing is written, no success is counted, and the Supervisor steps down;
- when the database refuses the host's acknowledgment (the intent table is gone), the exit
  stays unclassified and its key occupied (no second Worker), and the acknowledgment is made
  once the database accepts it: the processor ran once.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from apsup.store import backend_kind, intents, migrate, open_backend
from apsup.store.leases import GLOBAL_KEY, new_holder_id
from apsup.supervisor.host import LeasePolicy
from apsup.workers.exit_codes import ExitCode
from apsup.workers.pool import WorkerExit
from tests import liveness_families as lf
from tests.liveness_support import (
    INTENTS,
    ExitRecorder,
    cycle_for,
    cycle_until,
    handled,
    live_host,
    rename_table,
    request,
    still_occupied,
)

pytestmark = pytest.mark.timeout(120)


def _record_exit_codes(sup: object) -> list[int]:
    """The raw exit codes reaching the Supervisor (before it classifies them)."""
    codes: list[int] = []
    on_exit = sup.on_exit  # type: ignore[attr-defined]

    def recording(ex: WorkerExit) -> None:
        codes.append(ex.exitcode)
        on_exit(ex)

    sup.on_exit = recording  # type: ignore[attr-defined]
    return codes


def test_the_host_acknowledges_a_processor_that_returned(db_url: str, tmp_path: Path) -> None:
    migrate(db_url)
    backend = open_backend(db_url)
    fam = lf.live_work
    recorder = ExitRecorder()
    try:
        g1 = request(backend, fam, "noack.1")
        g2 = request(backend, fam, "noack.2")
        with live_host(db_url, [fam], tmp_path, hooks=recorder) as b:
            sup = b.host.supervisors[0]
            codes = _record_exit_codes(sup)
            cycle_until(b.host, lambda: sup.completed[fam.name] == 2, 30, "both acknowledged")
            assert handled(backend, fam, "noack.1", g1)
            assert handled(backend, fam, "noack.2", g2)
            assert sup.failed[fam.name] == 0 and not sup.unclassified
            assert recorder.causes == [(fam.name, None), (fam.name, None)]
            assert codes == [ExitCode.ACKNOWLEDGE, ExitCode.ACKNOWLEDGE]
        for scope in ("noack.1", "noack.2"):
            held = int((tmp_path / f"dbconns.{scope}").read_text())
            assert held == 0, f"the Worker held {held} database descriptor(s) while it ran"
    finally:
        backend.dispose()


def test_the_host_acknowledgment_is_fenced_by_the_dispatching_term(
    db_url: str, tmp_path: Path
) -> None:
    migrate(db_url)
    backend = open_backend(db_url)
    fam = lf.live_work
    try:
        g = request(backend, fam, "noackwait.1")
        lease = LeasePolicy(120.0, 40.0, 0.5)  # no renewal during the test
        with live_host(db_url, [fam], tmp_path, lease=lease) as b:
            sup = b.host.supervisors[0]
            codes = _record_exit_codes(sup)
            started = tmp_path / "started.noackwait.1"
            cycle_until(b.host, started.exists, 30, "Worker started")
            backend.invalidate_terms()  # a takeover or a mode switch
            (tmp_path / "go.noackwait.1").touch()
            cycle_until(b.host, lambda: codes, 30, "Worker exit confirmed")
            cycle_until(b.host, lambda: sup.term is None, 30, "the Supervisor stepped down")
            assert codes == [ExitCode.ACKNOWLEDGE]
            assert sup.completed[fam.name] == 0
            assert not handled(backend, fam, "noackwait.1", g)
    finally:
        backend.dispose()


def test_a_refused_host_acknowledgment_keeps_the_key_until_it_is_made(
    db_url: str, tmp_path: Path
) -> None:
    migrate(db_url)
    backend = open_backend(db_url)
    fam = lf.live_work
    try:
        g = request(backend, fam, "noackwait.1")
        with live_host(db_url, [fam], tmp_path) as b:
            host, sup = b.host, b.host.supervisors[0]
            started = tmp_path / "started.noackwait.1"
            cycle_until(host, started.exists, 30, "Worker started")
            pid = started.read_text()
            rename_table(db_url, INTENTS, "live_moved_intents")
            try:
                (tmp_path / "go.noackwait.1").touch()
                cycle_until(host, lambda: not b.pool.running(), 30, "Worker exit confirmed")

                cycle_for(host, 2.0, still_occupied(sup, fam, "noackwait.1"))
                assert sup.unclassified, "the exit should wait for its acknowledgment"
            finally:
                rename_table(db_url, "live_moved_intents", INTENTS)
            cycle_until(host, lambda: sup.completed[fam.name] == 1, 30, "acknowledged")
            assert handled(backend, fam, "noackwait.1", g)
            assert sup.failed[fam.name] == 0 and not sup.unclassified and not sup.running
            assert started.read_text() == pid, "the processor ran a second time"
            assert sup.established
    finally:
        backend.dispose()


def test_a_request_made_while_the_worker_ran_runs_after_the_host_acknowledgment(
    db_url: str, tmp_path: Path
) -> None:
    """The host acknowledges G, not the request that arrived meanwhile (G + 1): the exit is
    classified with more work pending and the Scope runs again, at once."""
    migrate(db_url)
    backend = open_backend(db_url)
    fam = lf.live_work
    try:
        g = request(backend, fam, "noackwait.1")
        with live_host(db_url, [fam], tmp_path) as b:
            sup = b.host.supervisors[0]
            codes = _record_exit_codes(sup)
            started = tmp_path / "started.noackwait.1"
            cycle_until(b.host, started.exists, 30, "Worker started")
            first = started.read_text()
            later = request(backend, fam, "noackwait.1")
            assert later == g + 1
            (tmp_path / "go.noackwait.1").touch()
            cycle_until(b.host, lambda: sup.completed[fam.name] == 2, 30, "both invocations")
            assert started.read_text() != first, "the second invocation did not run"
            assert handled(backend, fam, "noackwait.1", later)
            assert codes == [ExitCode.ACKNOWLEDGE, ExitCode.ACKNOWLEDGE]
            assert sup.failed[fam.name] == 0
    finally:
        backend.dispose()


def test_the_acknowledgment_reports_the_requested_generation_where_it_can(db_url: str) -> None:
    """What the Supervisor classifies the exit with: on MySQL the acknowledging UPDATE reports
    the row's requested generation (a request made meanwhile shows as more work) and no read
    follows; SQLite reports nothing and the Supervisor reads the row. Nothing moved: None."""
    migrate(db_url)
    backend = open_backend(db_url)
    fam = lf.live_work
    try:
        g = request(backend, fam, "noack.1")
        later = request(backend, fam, "noack.1")
        assert later == g + 1
        term = backend.claim_term(GLOBAL_KEY, new_holder_id(), 60)
        assert term is not None
        with backend.read() as conn:
            row = intents.get(conn, fam.binding_name, "noack.1")
        assert row is not None
        args = (term, fam.binding_name, "noack.1", g, row.pending_sequence)
        reported = backend.acknowledge_for_exit(*args)
        assert reported == (later if backend_kind(db_url) == "mysql" else None)
        assert handled(backend, fam, "noack.1", g)
        assert not handled(backend, fam, "noack.1", later)
        assert backend.acknowledge_for_exit(*args) is None  # already acknowledged
    finally:
        backend.dispose()
