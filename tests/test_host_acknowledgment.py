"""A processor that returns without acknowledging is acknowledged by its Supervisor, fenced by the
term that dispatched it (both backends, a real host, real Workers).

The Supervisor's dispatch read is the duplicate check (``handled < G`` right before the launch),
so a Worker whose processor needs no database opens no session at all: it exits with
``ExitCode.RETURNED_UNACKNOWLEDGED`` and the host commits the acknowledgment in a fenced
transaction of its own. What must hold:

- the acknowledgment is durable before the invocation counts as a success, and the Worker held
  no database descriptor while its processor ran;
- the host's acknowledgment is refused once the dispatching term is no longer the valid one:
  nothing is written, no success is counted, and the Supervisor steps down;
- when the database refuses the host's acknowledgment (the intent table is gone), the exit
  stays unclassified and its key occupied (no second Worker), and the acknowledgment is made
  once the database accepts it: the processor ran once;
- the exits confirmed together are acknowledged together (one fenced transaction; on MySQL one
  round trip), each with its own outcome: moved, already handled, or its claimed row gone;
  an exit's acknowledgment is held briefly while other Workers run, so that the exits that
  follow share it; with no other Worker running it is made at once;
- a Scope whose row was deleted and recreated while its Worker ran is a progress conflict: the
  exit is classified (the key is not held), and the new row is processed;
- a confirmed exit frees its slot before it is acknowledged (the key stays occupied until
  then), and the rows of the keys the next freed slots will take are read with the
  acknowledgments (on MySQL in the same round trip, after the UPDATEs): those dispatches then
  read nothing themselves.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from apsup.errors import IntentError, StaleTermError
from apsup.store import backend_kind, intents, migrate, open_backend
from apsup.store.base import ExitAck
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

pytestmark = [pytest.mark.timeout(120), pytest.mark.backends("sqlite", "mysql", "postgresql")]


def _record_exit_codes(sup: object) -> list[int]:
    """The raw exit codes reaching the Supervisor (before it classifies them)."""
    codes: list[int] = []
    on_exit = sup.on_exit  # type: ignore[attr-defined]

    def recording(ex: WorkerExit, *args: object) -> None:
        codes.append(ex.exitcode)
        on_exit(ex, *args)

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
            assert codes == [ExitCode.RETURNED_UNACKNOWLEDGED, ExitCode.RETURNED_UNACKNOWLEDGED]
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
            assert codes == [ExitCode.RETURNED_UNACKNOWLEDGED]
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
            assert codes == [ExitCode.RETURNED_UNACKNOWLEDGED, ExitCode.RETURNED_UNACKNOWLEDGED]
            assert sup.failed[fam.name] == 0
    finally:
        backend.dispose()


def test_the_acknowledgment_reports_the_requested_generation_where_it_can(db_url: str) -> None:
    """What the Supervisor classifies the exit with: on MySQL the acknowledging UPDATE reports
    the row's requested generation (a request made meanwhile shows as more work) and no read
    follows; SQLite reports nothing and the Supervisor reads the row. Nothing moved: None."""
    migrate(db_url)
    backend = open_backend(db_url, control=True)  # the host's backend
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
        exits = [ExitAck(fam.binding_name, "noack.1", g, row.pending_sequence)]
        assert backend.acknowledge_exits(term, exits) == [
            later if backend_kind(db_url) == "mysql" else None
        ]
        assert handled(backend, fam, "noack.1", g)
        assert not handled(backend, fam, "noack.1", later)
        assert backend.acknowledge_exits(term, exits) == [None]  # already acknowledged
    finally:
        backend.dispose()


def _pending_sequence(backend: object, fam: object, scope: str) -> int:
    with backend.read() as conn:  # type: ignore[attr-defined]
        row = intents.get(conn, fam.binding_name, scope)  # type: ignore[attr-defined]
    assert row is not None
    return row.pending_sequence


def _delete_row(backend: object, fam: object, scope: str) -> None:
    with backend.transaction() as conn:  # type: ignore[attr-defined]
        conn.execute(
            text(f"DELETE FROM {INTENTS} WHERE binding_name = :b AND scope_id = :s"),
            {"b": fam.binding_name, "s": scope},  # type: ignore[attr-defined]
        )


def test_exits_acknowledged_together_each_get_their_own_outcome(db_url: str) -> None:
    migrate(db_url)
    backend = open_backend(db_url, control=True)  # the host's backend
    fam = lf.live_work
    try:
        term = backend.claim_term(GLOBAL_KEY, new_holder_id(), 60)
        assert term is not None
        fresh = request(backend, fam, "noack.fresh")
        done = request(backend, fam, "noack.done")
        gone = request(backend, fam, "noack.gone")
        exits = [
            ExitAck(fam.binding_name, scope, g, _pending_sequence(backend, fam, scope))
            for scope, g in (("noack.fresh", fresh), ("noack.done", done), ("noack.gone", gone))
        ]
        assert backend.acknowledge_exits(term, [exits[1]]) is not None  # handled already
        _delete_row(backend, fam, "noack.gone")
        request(backend, fam, "noack.gone")  # recreated: a new pending sequence
        results = backend.acknowledge_exits(term, exits)
        reported = fresh if backend_kind(db_url) == "mysql" else None
        assert results[:2] == [reported, None]
        assert isinstance(results[2], IntentError)
        assert handled(backend, fam, "noack.fresh", fresh)
        assert handled(backend, fam, "noack.done", done)
        assert not handled(backend, fam, "noack.gone", 1), "the recreated row was acknowledged"

        # A term that is no longer valid writes nothing, for any of them.
        more = [request(backend, fam, scope) for scope in ("noack.fresh", "noack.done")]
        later = [
            ExitAck(fam.binding_name, scope, g, _pending_sequence(backend, fam, scope))
            for scope, g in zip(("noack.fresh", "noack.done"), more, strict=True)
        ]
        backend.invalidate_terms()
        with pytest.raises(StaleTermError):
            backend.acknowledge_exits(term, later)
        assert not handled(backend, fam, "noack.fresh", more[0])
        assert not handled(backend, fam, "noack.done", more[1])
    finally:
        backend.dispose()


def _gone(pid: str) -> bool:
    return not Path(f"/proc/{pid}").exists()


def _count_acknowledgments(host: Any) -> list[int]:
    """Per call of the host's acknowledgment transaction, how many exits it carried."""
    calls: list[int] = []
    acknowledge = host.backend.acknowledge_exits_and_read

    def counting(term: object, exits: list[ExitAck], reads: object) -> object:
        calls.append(len(exits))
        return acknowledge(term, exits, reads)

    host.backend.acknowledge_exits_and_read = counting
    return calls


def test_exits_confirmed_together_are_acknowledged_in_one_call(db_url: str, tmp_path: Path) -> None:
    migrate(db_url)
    backend = open_backend(db_url)
    fam = lf.live_work  # four Workers at most
    scopes = ["noackwait.1", "noackwait.2", "noackwait.3"]
    try:
        wanted = {scope: request(backend, fam, scope) for scope in scopes}
        with live_host(db_url, [fam], tmp_path) as b:
            host, sup = b.host, b.host.supervisors[0]
            calls = _count_acknowledgments(host)
            started = [tmp_path / f"started.{scope}" for scope in scopes]
            cycle_until(host, lambda: all(p.exists() for p in started), 30, "all Workers started")
            pids = [p.read_text() for p in started]
            for scope in scopes:
                (tmp_path / f"go.{scope}").touch()
            deadline = time.monotonic() + 30  # exited and reaped, before the host looks
            while not all(_gone(pid) for pid in pids):
                assert time.monotonic() < deadline, "the Workers did not exit"
                time.sleep(0.02)
            cycle_until(host, lambda: sup.completed[fam.name] == 3, 30, "all acknowledged")
            assert calls == [3]
            assert all(handled(backend, fam, s, g) for s, g in wanted.items())
            assert sup.failed[fam.name] == 0 and not sup.unclassified
    finally:
        backend.dispose()


def test_exits_close_in_time_share_one_acknowledgment_and_a_lone_exit_is_not_held(
    db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The host holds a confirmed exit's acknowledgment while other Workers run, so that the
    exits that follow within the hold share its transaction; an exit with no other Worker
    running is acknowledged at once. (The hold is set long here so the test does not depend
    on timing, then ended.)"""
    import apsup.supervisor.supervisor as supervisor_module

    migrate(db_url)
    backend = open_backend(db_url)
    fam = lf.live_work  # four Workers at most
    scopes = ["noackwait.1", "noackwait.2", "noackwait.3"]
    try:
        wanted = {scope: request(backend, fam, scope) for scope in scopes}
        with live_host(db_url, [fam], tmp_path) as b:
            host, sup = b.host, b.host.supervisors[0]
            calls = _count_acknowledgments(host)
            started = [tmp_path / f"started.{scope}" for scope in scopes]
            cycle_until(host, lambda: all(p.exists() for p in started), 30, "all Workers started")
            pids = {scope: p.read_text() for scope, p in zip(scopes, started, strict=True)}

            def exit_of(scope: str) -> list[WorkerExit]:
                (tmp_path / f"go.{scope}").touch()
                deadline = time.monotonic() + 30
                while not _gone(pids[scope]):
                    assert time.monotonic() < deadline, f"{scope} did not exit"
                    time.sleep(0.02)
                found: list[WorkerExit] = []
                while not found:
                    assert time.monotonic() < deadline, f"{scope}'s exit not confirmed"
                    found = list(host.pool.poll())
                    time.sleep(0.01)
                return found

            monkeypatch.setattr(supervisor_module, "ACK_HOLD_SECONDS", 30.0)
            sup.on_exits(exit_of("noackwait.1"))
            sup.classify_exits(hold=True)
            assert calls == [] and sup.classify_due() is not None  # held: .2 and .3 run
            sup.on_exits(exit_of("noackwait.2"))
            sup.classify_exits(hold=True)
            assert calls == []
            monkeypatch.setattr(supervisor_module, "ACK_HOLD_SECONDS", 0.0)  # the hold ends
            assert sup.classify_due() is None
            sup.classify_exits(hold=True)
            assert calls == [2]  # both exits, one transaction
            monkeypatch.setattr(supervisor_module, "ACK_HOLD_SECONDS", 30.0)
            sup.on_exits(exit_of("noackwait.3"))
            sup.classify_exits(hold=True)
            assert calls == [2, 1]  # no other Worker runs: nothing to wait for
            assert sup.completed[fam.name] == 3
            assert all(handled(backend, fam, s, g) for s, g in wanted.items())
            assert sup.failed[fam.name] == 0 and not sup.unclassified
    finally:
        backend.dispose()


def test_a_row_recreated_while_its_worker_ran_is_a_progress_conflict(
    db_url: str, tmp_path: Path
) -> None:
    migrate(db_url)
    backend = open_backend(db_url)
    fam = lf.live_work
    recorder = ExitRecorder()
    try:
        request(backend, fam, "noackwait.1")
        with live_host(db_url, [fam], tmp_path, hooks=recorder) as b:
            host, sup = b.host, b.host.supervisors[0]
            started = tmp_path / "started.noackwait.1"
            cycle_until(host, started.exists, 30, "Worker started")
            first = started.read_text()
            _delete_row(backend, fam, "noackwait.1")
            g = request(backend, fam, "noackwait.1")  # the new row: generation 1 again
            (tmp_path / "go.noackwait.1").touch()
            cycle_until(host, lambda: recorder.causes, 30, "the exit classified")
            assert recorder.causes[0] == (fam.name, "conflict")
            assert not sup.unclassified
            cycle_until(host, lambda: started.read_text() != first, 30, "the new row's Worker")
            cycle_until(host, lambda: sup.completed[fam.name] == 1, 30, "the new row handled")
            assert handled(backend, fam, "noackwait.1", g)
            assert sup.failed[fam.name] == 0
    finally:
        backend.dispose()


def test_the_dispatch_reads_of_several_scopes_are_one_read(db_url: str) -> None:
    """What the host reads ahead for the keys it is about to start: each row as a point read
    would return it, absent rows left out (one statement on MySQL)."""
    migrate(db_url)
    backend = open_backend(db_url, control=True)  # the host's backend
    fam = lf.live_work
    try:
        scopes = ["noack.a", "noack.b", "noack.c"]
        for scope in scopes:
            request(backend, fam, scope)
        request(backend, fam, "noack.b")
        rows = backend.read_intents(fam.binding_name, [*scopes, "noack.absent"])
        assert sorted(rows) == scopes
        for scope in scopes:
            assert rows[scope] == backend.read_intent(fam.binding_name, scope)
        assert rows["noack.b"].requested_generation == 2
        assert backend.read_intents(fam.binding_name, []) == {}
    finally:
        backend.dispose()


def test_rows_read_with_the_acknowledgments_are_as_a_point_read_returns_them(
    db_url: str, backend_name: str
) -> None:
    """What ``acknowledge_exits_and_read`` returns beside the acknowledgments: each row read as a
    point read returns it after the commit, None for an absent one, an exit's own key never
    (MySQL reads them in the batch; SQLite reads none: its dispatch read costs next to
    nothing)."""
    migrate(db_url)
    backend = open_backend(db_url, control=True)  # the host's backend
    fam = lf.live_work
    try:
        term = backend.claim_term(GLOBAL_KEY, new_holder_id(), 60.0)
        assert term is not None
        g = request(backend, fam, "noack.exit")
        request(backend, fam, "noack.next")
        request(backend, fam, "noack.next")
        row = backend.read_intent(fam.binding_name, "noack.exit")
        assert row is not None
        exits = [ExitAck(fam.binding_name, "noack.exit", g, row.pending_sequence)]
        reads = [(fam.binding_name, ["noack.next", "noack.exit", "noack.absent"])]
        results, rows = backend.acknowledge_exits_and_read(term, exits, reads)
        assert handled(backend, fam, "noack.exit", g)
        if backend_name == "mysql":
            assert results == [g]
            assert rows == {
                (fam.binding_name, "noack.next"): backend.read_intent(
                    fam.binding_name, "noack.next"
                ),
                (fam.binding_name, "noack.absent"): None,
            }
            assert rows[(fam.binding_name, "noack.next")].requested_generation == 2  # type: ignore[union-attr]
        else:
            assert results == [None] and rows == {}
        backend.release_term(term)
        with pytest.raises(StaleTermError):  # a stale term reads nothing and writes nothing
            backend.acknowledge_exits_and_read(term, exits, reads)
    finally:
        backend.dispose()


def test_the_next_dispatch_row_is_read_with_the_acknowledgment(
    db_url: str, backend_name: str, tmp_path: Path
) -> None:
    """Four Workers hold the family's budget and two keys wait. One Worker exits: its slot goes
    to the first waiting key at once (before the exit is acknowledged), and the row of the
    second comes with that acknowledgment, for the slot the next exit frees: its dispatch then
    reads nothing more on MySQL (on SQLite the dispatch reads it, as before). The first
    waiting key's Worker waits too, so that its exit cannot come within the acknowledgment's
    hold and take the second key before the acknowledgment reads it."""
    migrate(db_url)
    backend = open_backend(db_url)
    fam = lf.live_work  # four Workers at most
    holding = [f"noackwait.{i}" for i in range(4)]
    try:
        for scope in holding:
            request(backend, fam, scope)
        first = request(backend, fam, "noackwait.next1")
        second = request(backend, fam, "noack.next2")
        with live_host(db_url, [fam], tmp_path) as b:
            host, sup = b.host, b.host.supervisors[0]
            started = [tmp_path / f"started.{scope}" for scope in holding]
            cycle_until(host, lambda: all(p.exists() for p in started), 30, "four Workers started")
            assert len(sup.running) == 4
            asked: list[object] = []
            read: list[str] = []
            acknowledge = host.backend.acknowledge_exits_and_read
            read_intents, read_intent = host.backend.read_intents, host.backend.read_intent

            def acknowledging(term: object, exits: object, reads: object) -> object:
                asked.append(reads)
                return acknowledge(term, exits, reads)  # type: ignore[arg-type]

            def reading(binding: str, scope_ids: list[str]) -> object:
                read.extend(scope_ids)
                return read_intents(binding, scope_ids)

            def reading_one(binding: str, scope_id: str) -> object:
                read.append(scope_id)
                return read_intent(binding, scope_id)

            host.backend.acknowledge_exits_and_read = acknowledging  # type: ignore[method-assign]
            host.backend.read_intents = reading  # type: ignore[method-assign]
            host.backend.read_intent = reading_one  # type: ignore[method-assign]
            (tmp_path / "go.noackwait.0").touch()
            cycle_until(host, lambda: bool(asked), 30, "the first exit acknowledged")
            assert asked[0] == [(fam.binding_name, ["noack.next2"])]
            (tmp_path / "go.noackwait.next1").touch()
            cycle_until(host, lambda: sup.completed[fam.name] == 3, 30, "the waiting keys handled")
            assert handled(backend, fam, "noackwait.next1", first)
            assert handled(backend, fam, "noack.next2", second)
            if backend_name == "mysql":
                assert "noack.next2" not in read  # its dispatch took the row read with the ack
            else:
                assert "noack.next2" in read
            for scope in holding[1:]:
                (tmp_path / f"go.{scope}").touch()
            cycle_until(host, lambda: sup.completed[fam.name] == 6, 30, "all handled")
            assert sup.failed[fam.name] == 0 and not sup.unclassified
    finally:
        backend.dispose()
