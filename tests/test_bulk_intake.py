"""Bulk intake: ``fam.request_many`` / ``fam.mark_dirty_many`` (and their async twins) in the
caller's own transaction behave exactly like ``request`` / ``mark_dirty`` called once per
distinct Scope, on both backends:

- a random mix of bulk and single calls (some transactions rolled back) leaves the same rows as
  single calls only: generations, and the order of first registration (pending_sequence);
- new rows take their pending sequences from one counter update and are inserted with one
  executemany; sequences are never reused after delete and recreation;
- rollback leaves nothing; an empty input writes nothing and wakes nobody; an invalid Scope id
  rejects the whole call before any write, like the single path;
- a publisher racing the bulk path (MySQL: rows created between its statements) is resolved by
  the single-row path, with no advance lost;
- on SQLite one commit wakes the host once, and a real host handles Scopes published in bulk.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import (
    Column,
    Connection,
    MetaData,
    String,
    Table,
    create_engine,
    event,
    insert,
    select,
)
from sqlalchemy.exc import OperationalError
from sqlalchemy.ext.asyncio import create_async_engine

from apsup.errors import ConfigError, IntentError
from apsup.registry import Family, Registry, family
from apsup.store import SqlBackend, intents
from apsup.store.async_engine import async_url
from apsup.store.schema import PENDING_SEQUENCE_COUNTER, counters
from apsup.store.schema import intents as intents_table
from apsup.supervisor.control import ControlChannel

pytestmark = [pytest.mark.timeout(240), pytest.mark.backends("sqlite", "mysql", "postgresql")]

metadata = MetaData()
inbox = Table("bulk_intake_inbox", metadata, Column("scope_id", String(255), primary_key=True))

c = intents_table.c
SCOPES = [f"s{i}" for i in range(8)]
BAD_IDS: list[Any] = ["", "x" * 256, "a\x00b", "tab\tin", "\x1f", 7, None, b"bytes", ["nested"]]


class Abort(Exception):
    pass


def _noop(scope_id: str, ctx: Any) -> None:
    return None


def _family(prefix: str) -> Family:
    """A family with a binding of its own, so examples sharing a database never interfere."""
    binding = f"{prefix}-{uuid.uuid4().hex[:10]}"
    return family(binding, registry=Registry())(_noop)


def _rows(conn: Connection, binding: str) -> list[tuple[Any, ...]]:
    """The binding's rows in pending_sequence order, sequences included."""
    return [
        tuple(r)
        for r in conn.execute(
            select(
                c.scope_id,
                c.pending_sequence,
                c.dirty_generation,
                c.clean_generation,
                c.requested_generation,
                c.handled_generation,
                c.last_auto_scan_generation,
            )
            .where(c.binding_name == binding)
            .order_by(c.pending_sequence)
        )
    ]


def _state(conn: Connection, binding: str) -> list[tuple[Any, ...]]:
    """Rows without the sequences themselves: the order of first registration and generations."""
    return [(r[0], *r[2:]) for r in _rows(conn, binding)]


def _counter(conn: Connection) -> int:
    return int(
        conn.execute(
            select(counters.c.value).where(counters.c.name == PENDING_SEQUENCE_COUNTER)
        ).scalar_one()
    )


# -- equivalence with the single-row path ----------------------------------------------------------

_op = st.one_of(
    st.tuples(st.just("one"), st.sampled_from(["request", "mark_dirty"]), st.sampled_from(SCOPES)),
    st.tuples(
        st.just("many"),
        st.sampled_from(["request", "mark_dirty"]),
        st.lists(st.sampled_from(SCOPES), max_size=10),
    ),
)
_transactions = st.lists(
    st.tuples(st.lists(_op, min_size=1, max_size=6), st.booleans()), min_size=1, max_size=6
)
EXAMPLES = {"sqlite": 60, "mysql": 20, "postgresql": 20}


def test_bulk_and_single_calls_leave_the_same_rows_as_single_calls_only(
    backend: SqlBackend, backend_name: str
) -> None:
    """Each transaction runs twice: on one binding as generated (bulk and single calls), on
    another with every bulk call expanded to single calls (each distinct Scope once, in order
    of first appearance); both commit, or both roll back."""

    @settings(
        max_examples=EXAMPLES[backend_name],
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    @given(_transactions)
    def check(transactions: list[tuple[list[tuple[Any, ...]], bool]]) -> None:
        mixed, single = _family("mixed"), _family("single")
        for ops, rollback in transactions:
            got: list[Any] = []
            want: list[Any] = []
            for fam, results, expand in ((mixed, got, False), (single, want, True)):
                try:
                    with backend.engine.begin() as conn:
                        for how, kind, arg in ops:
                            if how == "one":
                                results.append(getattr(fam, kind)(conn, arg))
                            elif expand:
                                step = getattr(fam, kind)
                                results.append({s: step(conn, s) for s in dict.fromkeys(arg)})
                            else:
                                results.append(getattr(fam, f"{kind}_many")(conn, arg))
                        if rollback:
                            raise Abort
                except Abort:
                    pass
            assert got == want  # returned generations, call by call
        with backend.read() as conn:
            mixed_rows, single_rows = (
                _rows(conn, mixed.binding_name),
                _rows(conn, single.binding_name),
            )
        assert [(r[0], *r[2:]) for r in mixed_rows] == [(r[0], *r[2:]) for r in single_rows]

    check()


# -- statements, sequences, rollback, empty and invalid input --------------------------------------


def test_new_rows_take_one_counter_update_and_one_executemany(backend: SqlBackend) -> None:
    """1,200 new Scopes (more than one IN-list chunk) plus a few existing ones: the sequences
    are reserved by one counter update, consecutive in input order, inserted by one statement."""
    fam = _family("stmts")
    with backend.engine.begin() as conn:
        fam.request_many(conn, ["old-0", "old-1"])
    fresh = [f"new-{i}" for i in range(1200)]
    seen: list[tuple[str, bool]] = []

    def record(conn: Any, cursor: Any, statement: str, params: Any, ctx: Any, many: bool) -> None:
        seen.append((" ".join(statement.split()[:3]).upper(), many))

    with backend.engine.begin() as conn:
        event.listen(conn, "before_cursor_execute", record)
        generations = fam.request_many(conn, ["old-1", *fresh, "old-0", fresh[0]])
        event.remove(conn, "before_cursor_execute", record)
    assert generations == {"old-1": 2, **dict.fromkeys(fresh, 1), "old-0": 2}
    counter_updates = [s for s in seen if s[0].startswith("UPDATE PC_ARTIFACT_PROCESSING_COUNTERS")]
    inserts = [s for s in seen if s[0].startswith("INSERT INTO PC_ARTIFACT_PROCESSING_INTENTS")]
    assert counter_updates == [(counter_updates[0][0], False)]
    assert len(inserts) == 1 and inserts[0][1], seen  # one executemany
    assert len(seen) <= 15, seen  # a few statements per 500 Scopes, never one per Scope
    with backend.read() as conn:
        rows = _rows(conn, fam.binding_name)
    assert [r[0] for r in rows] == ["old-0", "old-1", *fresh]
    sequences = [r[1] for r in rows[2:]]
    assert sequences == list(range(sequences[0], sequences[0] + len(fresh)))


def test_pending_sequences_are_never_reused_after_delete_and_recreation(
    backend: SqlBackend,
) -> None:
    fam = _family("reuse")
    scopes = [f"r{i}" for i in range(20)]
    with backend.engine.begin() as conn:
        first = fam.request_many(conn, scopes)
    with backend.read() as conn:
        old = {r[0]: r[1] for r in _rows(conn, fam.binding_name)}
    with backend.engine.begin() as conn:  # handle and delete half of them
        for scope in scopes[::2]:
            assert intents.acknowledge(conn, fam.binding_name, scope, first[scope], old[scope])
            assert intents.delete_scope(conn, fam.binding_name, scope)
    with backend.engine.begin() as conn:
        again = fam.request_many(conn, scopes)
    assert again == {s: 1 if i % 2 == 0 else 2 for i, s in enumerate(scopes)}
    with backend.read() as conn:
        new = {r[0]: r[1] for r in _rows(conn, fam.binding_name)}
    recreated = [new[s] for s in scopes[::2]]
    assert min(recreated) > max(old.values())  # fresh incarnations, after every earlier one
    assert all(new[s] == old[s] for s in scopes[1::2])  # survivors keep theirs
    assert len(set(new.values())) == len(scopes)
    with backend.engine.begin() as conn, pytest.raises(IntentError):  # the old incarnation
        intents.acknowledge(conn, fam.binding_name, scopes[0], 1, old[scopes[0]])


def test_a_rolled_back_bulk_call_leaves_nothing(backend: SqlBackend) -> None:
    metadata.create_all(backend.engine)
    fam = _family("rollback")
    with backend.engine.begin() as conn:
        fam.request_many(conn, ["kept-0", "kept-1"])
    with backend.read() as conn:
        before, counter = _rows(conn, fam.binding_name), _counter(conn)
    with pytest.raises(Abort), backend.engine.begin() as conn:
        conn.execute(insert(inbox).values(scope_id="lost"))
        fam.request_many(conn, ["kept-0", "lost-0", "lost-1"])
        fam.mark_dirty_many(conn, ["kept-1", "lost-2"])
        raise Abort
    with backend.read() as conn:
        assert _rows(conn, fam.binding_name) == before
        assert _counter(conn) == counter
        assert conn.execute(select(inbox.c.scope_id)).all() == []
    with backend.engine.begin() as conn:  # the next registration still follows every other
        fam.request_many(conn, ["later"])
    with backend.read() as conn:
        rows = _rows(conn, fam.binding_name)
    assert rows[-1][0] == "later" and rows[-1][1] > max(r[1] for r in before)


def test_empty_input_writes_nothing(backend: SqlBackend) -> None:
    fam = _family("empty")
    with backend.read() as conn:
        counter = _counter(conn)
    with backend.engine.begin() as conn:
        assert fam.request_many(conn, []) == {}
        assert fam.mark_dirty_many(conn, iter(())) == {}
    with backend.read() as conn:
        assert _rows(conn, fam.binding_name) == []
        assert _counter(conn) == counter


@pytest.mark.parametrize("bad", BAD_IDS, ids=repr)
def test_an_invalid_scope_id_rejects_the_whole_call_like_the_single_path(
    backend: SqlBackend, bad: Any
) -> None:
    fam = _family("invalid")
    with backend.engine.begin() as conn:
        with pytest.raises(IntentError) as single:
            fam.request(conn, bad)
        with pytest.raises(IntentError) as bulk:
            fam.request_many(conn, ["fine-0", bad, "fine-1"])
        with pytest.raises(IntentError):
            fam.mark_dirty_many(conn, ["fine-0", bad])
        # the caller may catch the error and commit: nothing of the call was written
    assert str(bulk.value) == str(single.value)
    with backend.read() as conn:
        assert _rows(conn, fam.binding_name) == []


def test_a_single_string_or_a_non_collection_is_refused(backend: SqlBackend) -> None:
    """A bare string would otherwise be split into one-character Scopes."""
    fam = _family("string")
    with backend.engine.begin() as conn:
        with pytest.raises(IntentError, match=r"pass \[scope_id\]"):
            fam.request_many(conn, "abc")
        with pytest.raises(IntentError, match="collection"):
            fam.mark_dirty_many(conn, 42)  # type: ignore[arg-type]
    with backend.read() as conn:
        assert _rows(conn, fam.binding_name) == []


def test_an_autocommit_connection_is_refused_like_the_single_path(backend: SqlBackend) -> None:
    fam = _family("autocommit")
    with backend.engine.connect() as raw:
        conn = raw.execution_options(isolation_level="AUTOCOMMIT")
        with pytest.raises(ConfigError, match="AUTOCOMMIT"):
            fam.request_many(conn, ["a"])
    with backend.read() as conn:
        assert _rows(conn, fam.binding_name) == []


def test_async_twins_commit_with_the_callers_transaction_or_not_at_all(
    backend: SqlBackend,
) -> None:
    metadata.create_all(backend.engine)
    fam = _family("async")

    async def scenario() -> list[dict[str, int]]:
        engine = create_async_engine(async_url(backend.url))
        try:
            results = []
            async with engine.begin() as conn:
                await conn.execute(insert(inbox).values(scope_id="kept"))
                results.append(await fam.request_many_async(conn, ["kept", "also", "kept"]))
                results.append(await fam.mark_dirty_many_async(conn, ["also"]))
                results.append(await fam.request_many_async(conn, ["kept"]))
            with pytest.raises(Abort):
                async with engine.begin() as conn:
                    await conn.execute(insert(inbox).values(scope_id="lost"))
                    await fam.request_many_async(conn, ["lost", "kept"])
                    await fam.mark_dirty_many_async(conn, ["lost"])
                    raise Abort
            return results
        finally:
            await engine.dispose()

    assert asyncio.run(scenario()) == [{"kept": 1, "also": 1}, {"also": 1}, {"kept": 2}]
    with backend.read() as conn:
        assert _state(conn, fam.binding_name) == [
            ("kept", 0, 0, 2, 0, 0),
            ("also", 1, 0, 1, 0, 0),
        ]
        assert conn.execute(select(inbox.c.scope_id)).scalars().all() == ["kept"]


# -- a concurrent publisher between the bulk path's statements (MySQL: no write lock) -------------

LOCK_COUNTER = "SELECT PC_ARTIFACT_PROCESSING_COUNTERS.VALUE"
UPDATE_ROWS = "UPDATE PC_ARTIFACT_PROCESSING_INTENTS"
READ_ROWS = "SELECT PC_ARTIFACT_PROCESSING_INTENTS.SCOPE_ID"
RESERVE = "UPDATE PC_ARTIFACT_PROCESSING_COUNTERS"


@pytest.mark.mysql_only
@pytest.mark.parametrize(
    ("steps", "fallback"),
    [
        # x is new: another publisher creates it before our counter lock; we advance it
        ([(LOCK_COUNTER, "create")], False),
        # x exists (quiescent): deleted before our UPDATE, then created again by another
        # publisher after it (we see a row we did not advance) ...
        ([(UPDATE_ROWS, "delete"), (READ_ROWS, "create")], True),
        # ... or before our INSERT (a duplicate key): both resolved by the single-row path
        ([(UPDATE_ROWS, "delete"), (RESERVE, "create")], True),
    ],
    ids=["created-before-counter-lock", "recreated-after-update", "recreated-before-insert"],
)
def test_a_concurrent_publisher_between_statements_loses_no_advance(
    backend: SqlBackend, steps: list[tuple[str, str]], fallback: bool
) -> None:
    fam = _family("race")
    inputs = ["y", "x", "z"]
    if fallback:  # every Scope exists, so no counter lock is taken first
        inputs = ["w", "x"]
        with backend.engine.begin() as conn:
            fam.request_many(conn, inputs)
            (sequence,) = conn.execute(
                select(c.pending_sequence).where(
                    c.binding_name == fam.binding_name, c.scope_id == "x"
                )
            ).one()
            intents.acknowledge(conn, fam.binding_name, "x", 1, sequence)
    todo = list(steps)
    seen: list[str] = []

    def interleave(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        seen.append(statement.split(None, 2)[0].upper())
        if todo and statement.upper().startswith(todo[0][0]):
            _, action = todo.pop(0)
            with backend.engine.begin() as other:  # another publisher, committed in between
                if action == "delete":
                    assert intents.delete_scope(other, fam.binding_name, "x")
                else:
                    assert fam.request(other, "x") == 1

    with backend.engine.begin() as conn:
        event.listen(conn, "before_cursor_execute", interleave)
        generations = fam.request_many(conn, inputs)
        event.remove(conn, "before_cursor_execute", interleave)
    assert todo == []  # every interleaving happened
    assert ("ROLLBACK" in seen) == fallback  # to the savepoint, then the single-row path
    expected = {"y": 1, "x": 2, "z": 1} if not fallback else {"w": 2, "x": 2}
    assert generations == expected
    with backend.read() as conn:
        rows = _rows(conn, fam.binding_name)
    assert {r[0]: r[4] for r in rows} == expected
    assert rows[0][0] == "x" if not fallback else rows[-1][0] == "x"  # x's own incarnation
    assert len({r[1] for r in rows}) == len(rows)


def test_concurrent_bulk_publishers_lose_no_advance(backend: SqlBackend) -> None:
    """Threads publish overlapping Scope sets (random order, duplicates, new and existing rows)
    at once: every committed call advanced each of its Scopes exactly once."""
    fam = _family("threads")
    scopes = [f"t{i:03d}" for i in range(120)]
    committed: Counter[str] = Counter()
    deadlocks: list[str] = []
    lock = threading.Lock()

    def publisher(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(8):
            batch = rng.sample(scopes, 40) + rng.sample(scopes, 5)
            for _attempt in range(5):
                try:
                    with backend.engine.begin() as conn:
                        fam.request_many(conn, batch)
                    break
                except OperationalError as exc:  # a deadlock victim retries, as a caller would
                    with lock:
                        deadlocks.append(str(exc.orig)[:80])
            else:
                raise AssertionError(f"five deadlocks in a row: {deadlocks[-5:]}")
            with lock:
                committed.update(set(batch))

    threads = [threading.Thread(target=publisher, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    with backend.read() as conn:
        rows = _rows(conn, fam.binding_name)
    assert {r[0]: r[4] for r in rows} == dict(committed)
    assert len({r[1] for r in rows}) == len(rows)
    assert deadlocks == []


# -- wake-ups (SQLite) -----------------------------------------------------------------------------


@pytest.fixture
def channel(backend: SqlBackend) -> Iterator[ControlChannel]:
    ch = ControlChannel(backend.url)
    try:
        yield ch
    finally:
        ch.close()


def _datagrams(ch: ControlChannel) -> list[str]:
    out = []
    while True:
        try:
            out.append(ch.sock.recv(512).decode())
        except BlockingIOError:
            return out


@pytest.mark.backends("sqlite")
def test_a_bulk_commit_wakes_the_host_once_and_a_rollback_or_empty_call_never(
    backend: SqlBackend, channel: ControlChannel
) -> None:
    fam = _family("wake")
    with backend.engine.begin() as conn:
        fam.request_many(conn, ["a", "b"])
        fam.mark_dirty_many(conn, ["b", "c"])
        fam.request_many(conn, [f"n{i}" for i in range(600)])
        assert _datagrams(channel) == []  # not before the commit
    assert _datagrams(channel) == [fam.name]

    with pytest.raises(Abort), backend.engine.begin() as conn:
        fam.request_many(conn, ["d"])
        raise Abort
    with backend.engine.begin() as conn:
        fam.request_many(conn, [])
        fam.mark_dirty_many(conn, [])
    assert _datagrams(channel) == []

    async def publish_async() -> None:
        engine = create_async_engine(async_url(backend.url))
        try:
            async with engine.begin() as conn:
                await fam.request_many_async(conn, ["e", "f"])
        finally:
            await engine.dispose()

    asyncio.run(publish_async())
    assert _datagrams(channel) == [fam.name]


@pytest.mark.backends("sqlite")
def test_a_real_host_handles_scopes_published_in_bulk(
    backend_name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``apsup run`` idle on the application's database (the wake-up tests' application, family
    ``wake-manual``: requests only, no schedule); 200 Scopes requested in one transaction by the
    user's own plain engine wake it at once, and every one of them runs."""
    from tests.wake.support import LIMIT, Host, make_app

    app = make_app(tmp_path)
    host = Host(app).start().wait_ready()
    try:
        host.wait_quiet()
        publisher = family("wake-manual", registry=Registry())(_noop)  # the app's binding
        scopes = [f"bulk-{i}" for i in range(200)]
        engine = create_engine(app.url)
        try:
            before = time.time()
            with engine.begin() as conn:
                assert set(publisher.request_many(conn, scopes).values()) == {1}
            committed = time.time()
        finally:
            engine.dispose()
        deadline = time.monotonic() + LIMIT
        while not (seen := host.activity(after=before)):
            assert time.monotonic() < deadline, "the host never reacted to the bulk commit"
            time.sleep(0.01)
        reaction = seen[0][0] - committed
        while set(scopes) - set(runs := app.runs("wake-manual")):
            assert time.monotonic() < deadline, f"{len(runs)} of {len(scopes)} Scopes ran"
            time.sleep(0.05)
        drained = max(runs.values()) - committed
        with capsys.disabled():
            print(
                f"\n[bulk wake-up] host reacted {reaction * 1000:.1f} ms after the commit; "
                f"200 Scopes ran within {drained:.2f} s"
            )
        assert reaction < 1.0  # the wake-up guarantee (the file watch alone takes up to ~1 s)
    finally:
        assert host.stop() == 0
