"""ExecutionContext: the Worker's only input, and its fenced commits (RFC §1, §3, §5, §6).

- orjson bytes round-trip to an equal context; no pickle is used or produced; unknown versions,
  malformed JSON, missing/unknown fields and wrong types fail with ContextError naming the issue.
- ``repr()`` never shows the database password (nor the settings, which may hold secrets).
- ``ctx.fenced()`` + ``ctx.acknowledge(conn)``: handled := claimed G only when the transaction
  commits (``ctx.acknowledged`` flips after COMMIT); an exception in the block rolls back the
  business writes and the acknowledgment; after a term bump ``fenced()`` raises StaleTermError
  and nothing of that transaction commits; acknowledge/mark_clean refuse any other connection.
- ``mark_clean`` records only the dirty generation of the processor's snapshot and never lowers.
- A child process rebuilt from the bytes alone commits and acknowledges under the fence.
- Before its exit, a Worker closes the connections it opened (on MySQL: a goodbye each), and
  leaves alone a backend it never connected (the forkserver's warm one): it stays cached and
  usable, and nothing of it is freed or closed in a process about to exit.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from sqlalchemy import text

from apsup.context import (
    CONTEXT_VERSION,
    ExecutionContext,
    backend_for,
    dispose_backends,
    release_before_exit,
)
from apsup.errors import ContextError, IntentError, StaleTermError
from apsup.store import intents, open_backend
from apsup.store.base import SqlBackend
from apsup.store.leases import Term

pytestmark = [pytest.mark.timeout(120), pytest.mark.backends("sqlite", "mysql", "postgresql")]

REPO_ROOT = Path(__file__).resolve().parent.parent
FAMILY = "ctx-family"
SCOPE = "scope-1"


def _public(ctx: ExecutionContext) -> dict[str, Any]:
    return {f.name: getattr(ctx, f.name) for f in dataclasses.fields(ctx) if f.init}


def _make(db_url: str, term: Term, generation: int, pending_sequence: int) -> ExecutionContext:
    return ExecutionContext(
        binding_name=FAMILY,
        artifact_family=FAMILY,
        scope_id=SCOPE,
        claimed_request_generation=generation,
        supervisor_key=term.supervisor_key,
        holder_id=term.holder_id,
        supervisor_generation=term.generation,
        worker_id="worker-7",
        pending_sequence=pending_sequence,
        entry_point="tests._contract_ctx_child:main",
        database_url=db_url,
        settings={"APSUP_MODE": "dedicated", "APSUP_ROLE": "background"},
    )


def _bump(backend: SqlBackend, key: str) -> Term:
    if backend.name != "sqlite":  # elected: invalidate, then take over
        backend.invalidate_terms([key])
        term = backend.claim_term(key, uuid.uuid4().hex, 600)
        assert term is not None
        return term
    return backend.claim_term(key, uuid.uuid4().hex, 0)


@pytest.fixture
def job(backend: SqlBackend, db_url: str) -> Iterator[ExecutionContext]:
    """A dispatched invocation: term held, intent dirty twice and requested once (G = 1)."""
    term = backend.claim_term(f"artifact:{FAMILY}", uuid.uuid4().hex, 600)
    assert term is not None
    with backend.transaction() as conn:
        conn.execute(
            text(
                "CREATE TABLE ctx_business (id "
                + {
                    "sqlite": "INTEGER PRIMARY KEY AUTOINCREMENT",
                    "mysql": "INTEGER PRIMARY KEY AUTO_INCREMENT",
                    "postgresql": "SERIAL PRIMARY KEY",
                }[backend.name]
                + ", scope_id VARCHAR(255) NOT NULL, note VARCHAR(255) NOT NULL)"
            )
        )
    with backend.transaction() as conn:
        intents.mark_dirty(conn, FAMILY, SCOPE)
        intents.mark_dirty(conn, FAMILY, SCOPE)
        generation = intents.request(conn, FAMILY, SCOPE)
        row = intents.get(conn, FAMILY, SCOPE)
    assert row is not None
    yield _make(db_url, term, generation, row.pending_sequence)
    dispose_backends()


def _handled(backend: SqlBackend) -> int:
    with backend.read() as conn:
        row = intents.get(conn, FAMILY, SCOPE)
    assert row is not None
    return row.handled_generation


def _business(backend: SqlBackend) -> list[str]:
    with backend.read() as conn:
        return [r[0] for r in conn.execute(text("SELECT note FROM ctx_business ORDER BY id"))]


def _write(conn: Any, note: str) -> None:
    conn.execute(
        text("INSERT INTO ctx_business (scope_id, note) VALUES (:s, :n)"), {"s": SCOPE, "n": note}
    )


# -- serialisation -----------------------------------------------------------------------------


def _sample(db_url: str = "sqlite:////tmp/apsup-ctx-sample.db") -> ExecutionContext:
    return _make(db_url, Term("artifact:x", "holder-hex", 42), 7, 1234)


def test_round_trip_is_equal_and_uses_no_pickle(monkeypatch: pytest.MonkeyPatch) -> None:
    ctx = _sample()

    def no_pickle(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("pickle used")

    for name in ("dumps", "loads", "dump", "load"):
        monkeypatch.setattr(pickle, name, no_pickle)
    payload = ctx.to_bytes()
    back = ExecutionContext.from_bytes(payload)
    monkeypatch.undo()

    assert isinstance(payload, bytes)
    assert _public(back) == _public(ctx)
    assert back.term == ctx.term
    # Plain JSON any process (or language) can read; a pickle would start with opcode 0x80.
    decoded = json.loads(payload)
    assert decoded["v"] == CONTEXT_VERSION
    assert decoded["claimed_request_generation"] == 7
    assert payload.startswith(b"{") and b"\x80" not in payload
    with pytest.raises(pickle.UnpicklingError):
        pickle.loads(payload)


def test_host_acknowledges_travels_only_when_set() -> None:
    """A Supervisor's context says it checked and will acknowledge; one built by hand (a
    test, a manual re-run) leaves both to the Worker and does not carry the field."""
    by_hand = _sample()
    assert not by_hand.host_acknowledges
    assert b"host_acknowledges" not in by_hand.to_bytes()
    assert not ExecutionContext.from_bytes(by_hand.to_bytes()).host_acknowledges
    by_hand.host_acknowledges = True
    assert ExecutionContext.from_bytes(by_hand.to_bytes()).host_acknowledges


def _payload(**changes: Any) -> bytes:
    data = orjson.loads(_sample().to_bytes())
    for key, value in changes.items():
        if value is KeyError:
            data.pop(key)
        else:
            data[key] = value
    return orjson.dumps(data)


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (b"", "not valid JSON"),
        (b"{not json", "not valid JSON"),
        (b"\xff\xfe", "not valid JSON"),
        (b"[1, 2]", "must be a JSON object"),
        (b'"text"', "must be a JSON object"),
        (_payload(v=2), "version 2 is not supported"),
        (_payload(v=KeyError), "version None is not supported"),
        (_payload(v="1"), "version '1' is not supported"),
        (_payload(scope_id=KeyError), r"missing=\['scope_id'\]"),
        (_payload(extra_field=1), r"unknown=\['extra_field'\]"),
        (_payload(claimed_request_generation="3"), "'claimed_request_generation' has the wrong"),
        (_payload(supervisor_generation=True), "'supervisor_generation' has the wrong type"),
        (_payload(pending_sequence=1.5), "'pending_sequence' has the wrong type"),
        (_payload(database_url=None), "'database_url' has the wrong type"),
        (_payload(settings=["a"]), "'settings' has the wrong type"),
        (_payload(settings={"a": 1}), "settings must map strings to strings"),
        (_payload(host_acknowledges=1), "'host_acknowledges' must be a boolean"),
        (_payload(host_acknowledges="yes"), "'host_acknowledges' must be a boolean"),
    ],
)
def test_malformed_payloads_raise_context_error(payload: bytes, message: str) -> None:
    with pytest.raises(ContextError, match=message):
        ExecutionContext.from_bytes(payload)


def test_repr_hides_password_and_settings() -> None:
    url = "mysql+pymysql://apsup:S3cr3t-PW@db.internal:2881/apsup?ssl_key=/keys/K3Y"
    ctx = _sample(url)
    ctx.settings["APSUP_DATABASE_URL"] = url
    ctx.settings["TOKEN"] = "hunter2"
    for shown in (repr(ctx), str(ctx), f"{ctx!r}", repr([ctx])):
        assert "S3cr3t-PW" not in shown
        assert "K3Y" not in shown
        assert "hunter2" not in shown
        assert "db.internal" in shown and "scope_id='scope-1'" in shown
    backend = open_backend(url)  # engines connect lazily: nothing is contacted here
    try:
        assert "S3cr3t-PW" not in repr(backend) and "S3cr3t-PW" not in backend.describe()
    finally:
        backend.dispose()


# -- fenced commits ------------------------------------------------------------------------------


def test_acknowledgment_is_durable_only_after_commit(
    job: ExecutionContext, backend: SqlBackend
) -> None:
    assert not job.already_handled()
    with job.fenced() as conn:
        _write(conn, "result")
        assert job.acknowledge(conn) is True
        assert job.acknowledged is False  # not committed yet
        # Another connection still sees the previous state.
        assert _handled(backend) == 0
        assert _business(backend) == []
    assert job.acknowledged is True
    assert _handled(backend) == job.claimed_request_generation == 1
    assert _business(backend) == ["result"]
    assert job.already_handled()
    # A duplicate invocation of the same G acknowledges nothing new.
    with job.fenced() as conn:
        assert job.acknowledge(conn) is False
    assert _handled(backend) == 1


def test_exception_in_fenced_rolls_back_writes_and_acknowledgment(
    job: ExecutionContext, backend: SqlBackend
) -> None:
    with pytest.raises(RuntimeError, match="processor failed"), job.fenced() as conn:
        _write(conn, "partial")
        job.acknowledge(conn)
        raise RuntimeError("processor failed")
    assert job.acknowledged is False
    assert _handled(backend) == 0
    assert _business(backend) == []
    # A later fenced transaction without acknowledge does not inherit the rolled-back one.
    with job.fenced() as conn:
        _write(conn, "progress")
    assert job.acknowledged is False
    with job.fenced() as conn:
        job.acknowledge(conn)
    assert job.acknowledged is True
    assert _handled(backend) == 1
    assert _business(backend) == ["progress"]


def test_stale_term_commits_nothing(job: ExecutionContext, backend: SqlBackend) -> None:
    newer = _bump(backend, job.supervisor_key)
    assert newer.generation > job.supervisor_generation
    entered = False
    with pytest.raises(StaleTermError), job.fenced() as conn:
        entered = True
        _write(conn, "stale")
        job.acknowledge(conn)
    assert entered is False
    assert job.acknowledged is False
    assert _handled(backend) == 0
    assert _business(backend) == []


def test_acknowledge_refuses_a_connection_that_is_not_fenced(
    job: ExecutionContext, backend: SqlBackend
) -> None:
    """An acknowledgment must commit under the term: an unfenced transaction (or a fenced one of
    another context) is refused even while the term is still valid."""
    inside = r"inside ctx\.fenced\(\)"
    # Another context's fenced transaction validates *its* term, not this one's.
    other_term = backend.claim_term("artifact:other", uuid.uuid4().hex, 600)
    assert other_term is not None
    other = dataclasses.replace(
        job,
        supervisor_key=other_term.supervisor_key,
        holder_id=other_term.holder_id,
        supervisor_generation=other_term.generation,
    )
    _bump(backend, job.supervisor_key)  # this context's term is lost ...
    with pytest.raises(StaleTermError, match=inside), backend.transaction() as conn:
        job.acknowledge(conn)  # ... so an unfenced acknowledgment would be a stale commit
    with pytest.raises(StaleTermError, match=inside), backend.transaction() as conn:
        job.mark_clean(conn, 1)
    with pytest.raises(StaleTermError, match=inside), other.fenced() as conn:
        job.acknowledge(conn)
    assert _handled(backend) == 0
    with backend.read() as conn:
        row = intents.get(conn, FAMILY, SCOPE)
    assert row is not None and row.clean_generation == 0
    assert job.acknowledged is False


def test_mark_clean_only_up_to_the_snapshot(job: ExecutionContext, backend: SqlBackend) -> None:
    with job.fenced() as conn:
        snapshot = job.dirty_generation(conn)  # the processor reads its domain snapshot
    assert snapshot == 2
    with backend.transaction() as conn:  # new input arrives while the Worker computes
        assert intents.mark_dirty(conn, FAMILY, SCOPE) == 3
    with job.fenced() as conn:
        assert job.mark_clean(conn, snapshot) is True
        job.acknowledge(conn)
    with backend.read() as conn:
        row = intents.get(conn, FAMILY, SCOPE)
    assert row is not None
    assert (row.clean_generation, row.dirty_generation) == (2, 3)  # the new input stays dirty
    assert row.dirty  # and is admitted by a later scan
    with job.fenced() as conn:
        assert job.mark_clean(conn, 1) is False  # never lowers
    with pytest.raises(IntentError, match="above dirty"), job.fenced() as conn:
        job.mark_clean(conn, 4)
    with backend.read() as conn:
        row = intents.get(conn, FAMILY, SCOPE)
    assert row is not None and row.clean_generation == 2


def _run_child(ctx: ExecutionContext) -> tuple[int, dict[str, Any]]:
    proc = subprocess.run(
        [sys.executable, "-m", "tests._contract_ctx_child"],
        input=ctx.to_bytes(),
        capture_output=True,
        cwd=REPO_ROOT,
        timeout=60,
        check=False,
    )
    assert proc.stdout, proc.stderr.decode()
    return proc.returncode, orjson.loads(proc.stdout)


def test_child_process_commits_from_the_bytes_alone(
    job: ExecutionContext, backend: SqlBackend
) -> None:
    code, report = _run_child(job)
    assert (code, report) == (0, {"moved": True, "acknowledged": True})
    assert _handled(backend) == 1
    assert _business(backend) == ["child worker-7"]

    _bump(backend, job.supervisor_key)
    with backend.transaction() as conn:
        g2 = intents.request(conn, FAMILY, SCOPE)
    stale = dataclasses.replace(job, claimed_request_generation=g2)
    code, report = _run_child(stale)
    assert code == 3 and "superseded" in report["stale"], report
    assert _handled(backend) == 1
    assert _business(backend) == ["child worker-7"]


# -- the wrapper's own duplicate check and acknowledgment (backend fast paths) -----------------


def test_wrapper_acknowledgment_moves_g_once(job: ExecutionContext, backend: SqlBackend) -> None:
    """``acknowledge_fenced`` (the invoke wrapper's final step) = ``fenced() + acknowledge()``:
    handled := G, then a no-op; the duplicate check sees it."""
    assert not job.already_handled()
    assert job.acknowledge_fenced() is True
    assert job.acknowledged and _handled(backend) == 1
    assert job.already_handled()
    assert job.acknowledge_fenced() is False  # already handled: nothing moves, no error
    assert _handled(backend) == 1


def test_wrapper_acknowledgment_is_fenced(job: ExecutionContext, backend: SqlBackend) -> None:
    _bump(backend, job.supervisor_key)
    with pytest.raises(StaleTermError, match="superseded"):
        job.acknowledge_fenced()
    assert not job.acknowledged and _handled(backend) == 0
    # The connection went back clean: the next transaction on this database works.
    with backend.transaction() as conn:
        intents.request(conn, FAMILY, SCOPE)


def test_wrapper_acknowledgment_refuses_another_incarnation(
    job: ExecutionContext, backend: SqlBackend
) -> None:
    """A row deleted and recreated since dispatch has a new pending_sequence: refused, rolled
    back, and G above the requested generation is refused too."""
    other = dataclasses.replace(job, pending_sequence=job.pending_sequence + 1000)
    with pytest.raises(IntentError, match="no longer has the claimed intent row"):
        other.acknowledge_fenced()
    above = dataclasses.replace(job, claimed_request_generation=5)
    with pytest.raises(IntentError, match="above requested"):
        above.acknowledge_fenced()
    assert _handled(backend) == 0


def test_point_read_matches_the_core_read(job: ExecutionContext, backend: SqlBackend) -> None:
    """``read_intent`` (the host's dispatch and classification read) returns what
    ``intents.get`` does, and None for an unknown Scope."""
    with backend.read() as conn:
        expected = intents.get(conn, FAMILY, SCOPE)
    assert expected is not None and backend.read_intent(FAMILY, SCOPE) == expected
    assert backend.read_intent(FAMILY, "no-such-scope") is None
    assert backend.handled_generation(FAMILY, SCOPE) == expected.handled_generation == 0


def _db_fds(path: str) -> int:
    """How many of this process's file descriptors open the database file itself."""
    real = str(Path(path).resolve())
    count = 0
    for fd in Path("/proc/self/fd").iterdir():
        try:
            count += Path(fd).resolve() == Path(real)
        except OSError:
            continue
    return count


@pytest.mark.backends("sqlite")
def test_wrapper_and_processor_share_one_connection(
    job: ExecutionContext, backend: SqlBackend
) -> None:
    """The duplicate check opens the Worker's connection; a processor's ``ctx.fenced()`` and
    the wrapper's acknowledgment reuse it: one connection per Worker, as before."""
    path = str(job.backend.engine.url.database)
    before = _db_fds(path)
    assert not job.already_handled()
    assert _db_fds(path) == before + 1
    with job.fenced() as conn:
        _write(conn, "business")
    assert job.acknowledge_fenced() is True
    assert _db_fds(path) == before + 1
    assert _business(backend) == ["business"] and _handled(backend) == 1


@pytest.mark.backends("sqlite")
def test_wrapper_connection_does_not_cross_a_fork(
    job: ExecutionContext, backend: SqlBackend
) -> None:
    """A process forked after the duplicate check opens its own connection; it never runs a
    statement on (or closes) the one it inherited."""
    import os

    path = str(job.backend.engine.url.database)
    assert not job.already_handled()
    inherited = _db_fds(path)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through its exit code
        code = 1
        try:
            moved = job.acknowledge_fenced()
            code = 0 if moved and _db_fds(path) == inherited + 1 else 3
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert _handled(backend) == 1
    # The parent's connection still works (the child neither used nor closed it).
    assert job.already_handled()


def test_exit_closes_what_the_worker_opened_and_nothing_else(
    job: ExecutionContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``release_before_exit`` disposes a backend only if this process holds a connection of
    it, and only where the server would see an aborted client (``close_before_exit``); the
    backend stays cached and usable either way."""
    cached = backend_for(job.database_url)
    assert job.backend is cached
    disposed: list[SqlBackend] = []
    real_dispose = type(cached).dispose

    def counting_dispose(self: SqlBackend) -> None:
        disposed.append(self)
        real_dispose(self)

    monkeypatch.setattr(type(cached), "dispose", counting_dispose)
    assert not cached.connected()  # a Worker whose processor needed no session
    release_before_exit()
    assert disposed == [] and backend_for(job.database_url) is cached

    assert not job.already_handled()  # the duplicate check opens the Worker's connection
    assert cached.connected()
    release_before_exit()
    if cached.close_before_exit:
        assert disposed == [cached] and not cached.connected()
    else:  # SQLite: the kernel closes the file at exit, with nothing for a server to log
        assert disposed == [] and cached.connected()
    assert backend_for(job.database_url) is cached
    assert job.acknowledge_fenced() is True  # still usable: the same process may go on


def test_a_forked_worker_leaves_the_inherited_backend_alone_until_it_connects(
    job: ExecutionContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The forkserver's situation: its backend connected once (warming) and emptied its pool
    before forking. A Worker forked from it holds no connection of that backend, so at exit it
    neither disposes nor even asks the pool; once it opens a session, it closes it (where the
    server would log an aborted client)."""
    import os

    cached = backend_for(job.database_url)
    assert not job.already_handled()  # connected in this process, as the forkserver's warm-up
    cached.engine.pool.dispose()  # ... and emptied, as it is before any fork
    disposed: list[SqlBackend] = []
    real_dispose = type(cached).dispose

    def counting_dispose(self: SqlBackend) -> None:
        disposed.append(self)
        real_dispose(self)

    asked: list[SqlBackend] = []
    real_connected = type(cached).connected

    def counting_connected(self: SqlBackend) -> bool:
        asked.append(self)
        return real_connected(self)

    monkeypatch.setattr(type(cached), "dispose", counting_dispose)
    monkeypatch.setattr(type(cached), "connected", counting_connected)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through its exit code
        code = 1
        try:
            release_before_exit()
            if disposed or asked:
                code = 3  # it looked into (or disposed) a backend it never used
            else:
                assert not job.already_handled()  # the Worker's own first session
                release_before_exit()
                expected = [cached] if cached.close_before_exit else []
                code = 0 if disposed == expected else 4
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert disposed == []  # the parent disposed nothing either
