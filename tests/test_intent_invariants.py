"""RFC §3/§4 intent invariants, checked by a hypothesis state machine on the real store.

Operations: mark_dirty, request (domain side, plain transactions), start_scan / admit / end_scan
(control writes, fenced by a term), acknowledge and mark_clean (Worker side, fenced, with the
claimed pending_sequence: current incarnation or an old one), delete_scope and recreation. After
every step the database must equal a small model, and:

- 0 <= clean <= dirty and 0 <= handled <= requested;
- generations never decrease within an incarnation (binding, scope, pending_sequence);
- pending_sequence is unique and strictly increasing over all creations, never reused after
  delete + recreate, and an acknowledgment carrying an old incarnation's sequence is rejected;
- admission is idempotent per scan generation (a second admit in the same scan changes nothing);
- index-backed discovery (dirty_page / request_page) returns exactly the model's pending keys.
"""

from __future__ import annotations

import threading
import uuid
from collections import Counter
from dataclasses import dataclass, replace
from datetime import datetime

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from sqlalchemy import select

from apsup.errors import IntentError
from apsup.store import intents, scans
from apsup.store.base import SqlBackend
from apsup.store.leases import Term
from apsup.store.schema import intents as intents_table

pytestmark = [pytest.mark.timeout(120), pytest.mark.backends("sqlite", "mysql", "postgresql")]

SCOPES = [f"scope-{i}" for i in range(3)]
BIG = 10**12

# Few examples on MySQL: every step is a few network round trips.
EXAMPLES = {"sqlite": (50, 30), "mysql": (40, 30), "postgresql": (40, 30)}


@dataclass(frozen=True)
class Row:
    pending_sequence: int
    dirty: int = 0
    clean: int = 0
    requested: int = 0
    handled: int = 0
    last_auto: int = 0


class IntentMachine(RuleBasedStateMachine):
    backend: SqlBackend  # set on the per-test subclass
    outcomes: Counter[str]  # what the examples exercised (checked for coverage)

    def __init__(self) -> None:
        super().__init__()
        self.binding = f"b-{uuid.uuid4().hex[:12]}"
        self.rows: dict[str, Row] = {}
        self.every_sequence: list[int] = []
        self.old_sequences: dict[str, list[int]] = {}
        self.claims: list[tuple[str, int, int]] = []  # (scope, pending_sequence, G)
        self.scan_generation = 0
        self.scan_in_progress = False
        self.seen: dict[tuple[str, int], Row] = {}
        self.term: Term | None = None

    @initialize()
    def claim(self) -> None:
        term = self.backend.claim_term(f"artifact:{self.binding}", uuid.uuid4().hex, 600)
        assert term is not None
        self.term = term

    # -- helpers -----------------------------------------------------------------------------
    def _fenced(self):  # type: ignore[no-untyped-def]
        assert self.term is not None
        return self.backend.fenced(self.term)

    def _created(self, scope: str, conn_row: intents.Intent) -> None:
        seq = conn_row.pending_sequence
        assert seq not in self.every_sequence, f"pending_sequence {seq} reused"
        if self.every_sequence:
            assert seq > max(self.every_sequence), "pending_sequence not increasing"
        self.every_sequence.append(seq)

    def _advance(self, scope: str, fn, field: str) -> None:  # type: ignore[no-untyped-def]
        with self.backend.transaction() as conn:
            value = fn(conn, self.binding, scope)
            got = intents.get(conn, self.binding, scope)
        assert got is not None
        row = self.rows.get(scope)
        if row is None:
            self._created(scope, got)
            row = Row(got.pending_sequence)
            if scope in self.old_sequences:
                self.outcomes["recreated"] += 1
        row = replace(row, **{field: getattr(row, field) + 1})
        self.rows[scope] = row
        assert value == getattr(row, field)
        if field == "requested":
            self.claims.append((scope, row.pending_sequence, value))

    # -- domain side ---------------------------------------------------------------------------
    @rule(scope=st.sampled_from(SCOPES))
    def mark_dirty(self, scope: str) -> None:
        self._advance(scope, intents.mark_dirty, "dirty")

    @rule(scope=st.sampled_from(SCOPES))
    def request(self, scope: str) -> None:
        self._advance(scope, intents.request, "requested")

    # -- supervisor control (fenced) ------------------------------------------------------------
    @rule()
    def start_scan(self) -> None:
        with self._fenced() as conn:
            state = scans.start_scan(conn, self.binding, datetime(2026, 1, 1))
        self.scan_generation += 1
        self.scan_in_progress = True
        assert state.scan_generation == self.scan_generation
        assert state.scan_in_progress
        expected_upper = max((r.pending_sequence for r in self.rows.values()), default=None)
        assert state.scan_upper_pending_sequence == expected_upper

    @precondition(lambda self: self.scan_generation > 0)
    @rule(scope=st.sampled_from(SCOPES), older=st.booleans())
    def admit(self, scope: str, older: bool) -> None:
        generation = self.scan_generation - 1 if older else self.scan_generation
        with self._fenced() as conn:
            admitted = scans.admit(conn, self.binding, scope, generation)
        row = self.rows.get(scope)
        if row is None:
            assert admitted is False
            return
        if row.last_auto >= generation or row.dirty <= row.clean:
            assert admitted == (row.requested > row.handled)
        else:
            new_requested = row.requested + 1 if row.requested <= row.handled else row.requested
            if new_requested != row.requested:
                self.claims.append((scope, row.pending_sequence, new_requested))
            assert admitted is True
            reused = new_requested == row.requested
            self.outcomes["admit reused request" if reused else "admitted"] += 1
            row = replace(row, last_auto=generation, requested=new_requested)
            self.rows[scope] = row
        # Idempotent per scan generation: admitting again changes nothing.
        with self._fenced() as conn:
            again = scans.admit(conn, self.binding, scope, generation)
            now = intents.get(conn, self.binding, scope)
        assert again == (row.requested > row.handled)
        assert now is not None
        assert (now.requested_generation, now.last_auto_scan_generation) == (
            row.requested,
            row.last_auto,
        )

    @precondition(lambda self: self.scan_generation > 0)
    @rule(stale=st.booleans())
    def end_scan(self, stale: bool) -> None:
        generation = self.scan_generation - 1 if stale else self.scan_generation
        with self._fenced() as conn:
            ended = scans.end_scan(conn, self.binding, generation)
            state = scans.get_state(conn, self.binding)
        assert ended is (not stale)
        if not stale:
            self.scan_in_progress = False
        assert state is not None and state.scan_in_progress is self.scan_in_progress

    # -- worker side (fenced) -------------------------------------------------------------------
    @precondition(lambda self: bool(self.claims) or bool(self.rows))
    @rule(data=st.data())
    def acknowledge(self, data: st.DataObject) -> None:
        kind = data.draw(st.sampled_from(["claimed", "above", "old_incarnation"]))
        if kind == "claimed" and self.claims:
            scope, seq, generation = data.draw(st.sampled_from(self.claims))
        elif kind == "old_incarnation" and self.old_sequences:
            scope = data.draw(st.sampled_from(sorted(self.old_sequences)))
            seq = data.draw(st.sampled_from(self.old_sequences[scope]))
            generation = data.draw(st.integers(1, 4))
        elif self.rows:
            scope = data.draw(st.sampled_from(sorted(self.rows)))
            row = self.rows[scope]
            seq, generation = row.pending_sequence, row.requested + data.draw(st.integers(1, 2))
        else:
            return
        row = self.rows.get(scope)
        if row is None or row.pending_sequence != seq:
            expected: object = IntentError  # deleted, or a recreated row's old incarnation
        elif generation > row.requested:
            expected = IntentError
        elif generation <= row.handled:
            expected = False
        else:
            expected = True
        try:
            with self._fenced() as conn:
                moved: object = intents.acknowledge(conn, self.binding, scope, generation, seq)
        except IntentError:
            moved = IntentError
        assert moved == expected, (kind, scope, seq, generation, row)
        stale_row = row is not None and row.pending_sequence != seq
        self.outcomes[f"ack {'old incarnation ' if stale_row else ''}{moved}"] += 1
        if moved is True:
            assert row is not None
            self.rows[scope] = replace(row, handled=generation)

    @precondition(lambda self: bool(self.rows) or bool(self.old_sequences))
    @rule(data=st.data())
    def mark_clean(self, data: st.DataObject) -> None:
        scopes = sorted(set(self.rows) | set(self.old_sequences))
        scope = data.draw(st.sampled_from(scopes))
        row = self.rows.get(scope)
        old = self.old_sequences.get(scope, [])
        if row is not None and (not old or data.draw(st.booleans())):
            seq = row.pending_sequence
            upto = max(0, row.dirty + data.draw(st.integers(-2, 2)))
        else:
            seq = data.draw(st.sampled_from(old))
            upto = data.draw(st.integers(0, 3))
        if row is None or row.pending_sequence != seq or upto > row.dirty:
            expected: object = IntentError
        elif upto <= row.clean:
            expected = False  # never lowers
        else:
            expected = True
        try:
            with self._fenced() as conn:
                moved: object = intents.mark_clean(conn, self.binding, scope, upto, seq)
        except IntentError:
            moved = IntentError
        assert moved == expected, (scope, seq, upto, row)
        self.outcomes[f"clean {moved}"] += 1
        if moved is True:
            assert row is not None
            self.rows[scope] = replace(row, clean=upto)

    @precondition(lambda self: bool(self.rows))
    @rule(data=st.data(), then_delete=st.booleans())
    def settle(self, data: st.DataObject, then_delete: bool) -> None:
        """A Worker that handles everything: acknowledge the latest request and mark clean up to
        the dirty generation it read (often making the scope quiescent, so it can be deleted)."""
        scope = data.draw(st.sampled_from(sorted(self.rows)))
        row = self.rows[scope]
        with self._fenced() as conn:
            if row.requested > row.handled:
                assert intents.acknowledge(
                    conn, self.binding, scope, row.requested, row.pending_sequence
                )
            if row.dirty > row.clean:
                assert intents.mark_clean(
                    conn, self.binding, scope, row.dirty, row.pending_sequence
                )
        self.rows[scope] = replace(row, handled=row.requested, clean=row.dirty)
        if then_delete:
            self.delete_scope(scope)

    # -- deletion and recreation ----------------------------------------------------------------
    @rule(scope=st.sampled_from(SCOPES))
    def delete_scope(self, scope: str) -> None:
        with self._fenced() as conn:
            deleted = intents.delete_scope(conn, self.binding, scope)
        row = self.rows.get(scope)
        quiescent = row is not None and row.requested == row.handled and row.dirty == row.clean
        assert deleted is quiescent
        self.outcomes[f"delete {deleted}"] += 1
        if deleted:
            assert row is not None
            del self.rows[scope]
            self.old_sequences.setdefault(scope, []).append(row.pending_sequence)

    # -- invariants -----------------------------------------------------------------------------
    @invariant()
    def database_equals_model(self) -> None:
        c = intents_table.c
        with self.backend.read() as conn:
            rows = conn.execute(
                select(
                    c.scope_id,
                    c.pending_sequence,
                    c.dirty_generation,
                    c.clean_generation,
                    c.requested_generation,
                    c.handled_generation,
                    c.last_auto_scan_generation,
                ).where(c.binding_name == self.binding)
            ).all()
            dirty_keys = intents.dirty_page(conn, self.binding, 0, BIG, 100)
            request_keys = intents.request_page(conn, self.binding, 0, 100)
        actual = {r[0]: Row(*(int(v) for v in r[1:])) for r in rows}
        assert actual == self.rows
        sequences = [r.pending_sequence for r in actual.values()]
        assert len(set(sequences)) == len(sequences)
        for scope, r in actual.items():
            assert 0 <= r.clean <= r.dirty
            assert 0 <= r.handled <= r.requested
            before = self.seen.get((scope, r.pending_sequence))
            if before is not None:
                assert r.dirty >= before.dirty and r.clean >= before.clean
                assert r.requested >= before.requested and r.handled >= before.handled
                assert r.last_auto >= before.last_auto
            self.seen[(scope, r.pending_sequence)] = r
        by_sequence = sorted(actual.items(), key=lambda kv: kv[1].pending_sequence)
        assert [
            (s, r.pending_sequence, r.last_auto) for s, r in by_sequence if r.dirty > r.clean
        ] == (dirty_keys)
        assert [
            (s, r.pending_sequence) for s, r in by_sequence if r.requested > r.handled
        ] == request_keys


def test_intent_state_machine(backend: SqlBackend) -> None:
    examples, steps = EXAMPLES[backend.name]

    class Machine(IntentMachine):
        pass

    Machine.backend = backend
    Machine.outcomes = Counter()
    run_state_machine_as_test(
        Machine,
        settings=settings(
            max_examples=examples,
            stateful_step_count=steps,
            deadline=None,
            database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )
    # What the random examples exercised (the specific paths are pinned by the tests below).
    print(f"{backend.name}: {dict(Machine.outcomes)}")


def test_concurrent_first_registration_makes_one_row(backend: SqlBackend) -> None:
    """Racing first mark_dirty/request calls on a new scope create exactly one row; every
    increment lands; the row keeps the first assigned pending_sequence."""
    writers = 6
    barrier = threading.Barrier(writers)
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            barrier.wait(10)
            fn = intents.mark_dirty if i % 2 == 0 else intents.request
            backend.run(lambda conn: fn(conn, "race", "new-scope"))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    with backend.read() as conn:
        row = intents.get(conn, "race", "new-scope")
        count = conn.execute(
            select(intents_table.c.scope_id).where(intents_table.c.binding_name == "race")
        ).all()
    assert len(count) == 1
    assert row is not None
    assert row.dirty_generation == writers // 2
    assert row.requested_generation == writers - writers // 2


def _fenced_term(backend: SqlBackend, key: str) -> Term:
    term = backend.claim_term(key, uuid.uuid4().hex, 600)
    assert term is not None
    return term


def test_recreated_scope_never_reuses_its_sequence(backend: SqlBackend) -> None:
    term = _fenced_term(backend, "artifact:recreate")
    with backend.transaction() as conn:
        assert intents.request(conn, "recreate", "s") == 1
        assert intents.mark_dirty(conn, "recreate", "other") == 1
        first = intents.get(conn, "recreate", "s")
    assert first is not None
    with backend.fenced(term) as conn:
        assert intents.acknowledge(conn, "recreate", "s", 1, first.pending_sequence) is True
        assert intents.delete_scope(conn, "recreate", "s") is True
        assert intents.delete_scope(conn, "recreate", "other") is False  # still dirty
    with backend.transaction() as conn:
        assert intents.request(conn, "recreate", "s") == 1  # generations restart per incarnation
        second = intents.get(conn, "recreate", "s")
    assert second is not None
    assert second.pending_sequence > first.pending_sequence
    # A Worker of the deleted incarnation (same scope, same G) cannot acknowledge its successor.
    with (
        pytest.raises(IntentError, match="no longer has the claimed intent row"),
        backend.fenced(term) as conn,
    ):
        intents.acknowledge(conn, "recreate", "s", 1, first.pending_sequence)
    with (
        pytest.raises(IntentError, match="no longer has the claimed intent row"),
        backend.fenced(term) as conn,
    ):
        intents.mark_clean(conn, "recreate", "s", 0, first.pending_sequence)
    with backend.read() as conn:
        row = intents.get(conn, "recreate", "s")
    assert row is not None and row.handled_generation == 0 and row.requested_generation == 1
    with backend.fenced(term) as conn:
        assert intents.acknowledge(conn, "recreate", "s", 1, second.pending_sequence) is True


def test_admission_is_idempotent_per_scan(backend: SqlBackend) -> None:
    term = _fenced_term(backend, "artifact:admit")
    with backend.transaction() as conn:
        intents.mark_dirty(conn, "admit", "a")
        intents.mark_dirty(conn, "admit", "b")
        intents.request(conn, "admit", "b")  # an unacknowledged explicit request to reuse
        intents.mark_dirty(conn, "admit", "clean")
    with backend.fenced(term) as conn:
        row = intents.get(conn, "admit", "clean")
        assert row is not None
        intents.mark_clean(conn, "admit", "clean", 1, row.pending_sequence)
        scan = scans.start_scan(conn, "admit", datetime(2026, 1, 1))
    gen = scan.scan_generation

    def state(scope: str) -> tuple[int, int]:
        with backend.read() as conn:
            r = intents.get(conn, "admit", scope)
        assert r is not None
        return r.requested_generation, r.last_auto_scan_generation

    for _ in range(3):  # a crashed scan restarting from the first page
        with backend.fenced(term) as conn:
            assert scans.admit(conn, "admit", "a", gen) is True
            assert scans.admit(conn, "admit", "b", gen) is True
            assert scans.admit(conn, "admit", "clean", gen) is False
            assert scans.admit(conn, "admit", "missing", gen) is False
        assert state("a") == (1, gen)  # admitted once
        assert state("b") == (1, gen)  # existing request reused, marker recorded
        assert state("clean") == (0, 0)
    # New dirty state during the scan does not reset this scan's marker ...
    with backend.transaction() as conn:
        intents.mark_dirty(conn, "admit", "a")
    with backend.fenced(term) as conn:
        row = intents.get(conn, "admit", "a")
        assert row is not None
        intents.acknowledge(conn, "admit", "a", 1, row.pending_sequence)
        assert scans.admit(conn, "admit", "a", gen) is False
    assert state("a") == (1, gen)
    # ... and is admitted by the next scan.
    with backend.fenced(term) as conn:
        assert scans.end_scan(conn, "admit", gen) is True
        nxt = scans.start_scan(conn, "admit", datetime(2026, 1, 2)).scan_generation
        assert scans.admit(conn, "admit", "a", nxt) is True
    assert state("a") == (2, nxt)
