"""Leases on MySQL/OceanBase: takeover, renewal failure, lock waits (RFC §8, acceptance 10).

- takeover only of a free/expired Lease, always with a new generation, including reelection of
  the same holder (ABA); a superseded term can neither renew nor commit;
- renewal refused (term invalidated by someone else): the host stops dispatch at once and
  terminates its running Worker, which commits nothing; the host then competes again;
- renewal late (database unreachable): leadership is dropped and Workers are terminated *before*
  the Lease expires in database time, i.e. before any standby could take over;
- lock waits and deadlocks are retried with a bound and never count as leadership loss: the
  Lease row held by another session for a few seconds (with a 1 s lock-wait timeout, so real
  1205 errors occur) delays renewals and scan control writes, the term survives, the scan
  completes; an injected 1213 is retried inside ``run_fenced``;
- a fenced transaction that stays open (a frozen Worker) cannot block a takeover past the
  ``apsup_fence_timeout`` bound, and nothing of it commits.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import event, insert, select, text
from sqlalchemy.exc import DBAPIError, OperationalError

from apsup.errors import FencedTransactionTimeout, StaleTermError
from apsup.store import SqlBackend, open_backend, scans
from apsup.store.leases import Term
from apsup.supervisor.host import Host, LeasePolicy
from apsup.supervisor.launcher import HostBundle, build_host
from apsup.supervisor.supervisor import Hooks
from tests.replicas import families
from tests.replicas.cluster import Cluster
from tests.replicas.support import FAST_BACKOFF, request

pytestmark = [pytest.mark.mysql_only, pytest.mark.timeout(120)]


class Recorder(Hooks):
    def __init__(self) -> None:
        self.exits: list[tuple[str, str | None, float]] = []
        self.dispatches = 0

    def on_dispatch(self, family: str) -> None:
        self.dispatches += 1

    def on_exit(self, family: str, cause: str | None, duration: float) -> None:
        self.exits.append((family, cause, time.monotonic()))


@contextlib.contextmanager
def host_for(
    url: str, lease: LeasePolicy, registry: Any = None, hooks: Hooks | None = None
) -> Iterator[HostBundle]:
    bundle = build_host(
        url,
        list(registry or families.registry),
        lease=lease,
        hooks=hooks,
        shutdown_grace=5.0,
        backoff=FAST_BACKOFF,
    )
    try:
        bundle.host.start()
        yield bundle
    finally:
        bundle.host.shutdown()
        bundle.close()


def cycle_until(host: Host, predicate: Any, timeout: float, what: str) -> float:
    t0 = time.monotonic()
    while not predicate():
        assert time.monotonic() - t0 < timeout, f"timed out waiting for {what}"
        host.cycle(max_wait=0.05)
    return time.monotonic() - t0


def test_takeover_only_when_free_and_always_a_new_generation(backend: SqlBackend) -> None:
    a, b = "holder-a", "holder-b"
    t1 = backend.claim_term("global", a, 30)
    assert t1 == Term("global", a, 1)
    assert backend.claim_term("global", b, 30) is None  # live Lease: no takeover
    assert backend.renew_term(t1, 30)
    backend.release_term(t1)
    t2 = backend.claim_term("global", a, 0.3)  # the same holder again: a new term (ABA)
    assert t2 == Term("global", a, 2)
    assert not backend.renew_term(t1, 30)
    with pytest.raises(StaleTermError), backend.fenced(t1):
        pass
    time.sleep(0.5)  # t2 expires
    with pytest.raises(StaleTermError, match="expired"), backend.fenced(t2):
        pass
    t3 = backend.claim_term("global", b, 30)
    assert t3 == Term("global", b, 3)
    assert not backend.renew_term(t2, 30)


def test_refused_renewal_stops_dispatch_and_terminates_workers(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    Cluster.prepare(db_url)
    monkeypatch.setenv("REPLICA_TEST_WORK", "30,30")  # the Worker computes for 30 s
    rec = Recorder()
    with host_for(db_url, LeasePolicy(3.0, 0.5, 0.3), hooks=rec) as bundle:
        host, sup = bundle.host, bundle.host.supervisors[0]
        assert sup.term is not None
        old = sup.term
        request(db_url, "replica-work", "long")
        cycle_until(host, lambda: bool(sup.running), 20, "a running Worker")
        time.sleep(0.5)  # the Worker is inside its computation now
        other = open_backend(db_url)
        try:
            other.invalidate_terms(["global"])  # someone else ends the term
            t0 = time.monotonic()
            cycle_until(host, lambda: sup.term != old, 10, "leadership loss")
            lost_after = time.monotonic() - t0
            # The loss terminated the Worker in the same step: its exit is already confirmed.
            assert rec.exits and rec.exits[-1][0] == "replica-work"
            assert not bundle.pool.running()
            stopped_after = rec.exits[-1][2] - t0
            with other.read() as conn:
                rows = families.read_journal(conn)
            assert [r for r in rows if r.kind == "commit"] == []  # nothing committed
            # The host competes again and wins the free Lease with a new generation.
            cycle_until(host, lambda: sup.term is not None, 10, "a new term")
            assert sup.term is not None and sup.term.generation == old.generation + 2
        finally:
            other.dispose()
    print(f"\nrefused renewal: lost after {lost_after:.2f}s, Worker exit {stopped_after:.2f}s")
    assert lost_after < 0.5 + 5  # one renewal interval (+ generous slack)


def test_late_renewal_drops_leadership_before_the_lease_expires(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    Cluster.prepare(db_url)
    monkeypatch.setenv("REPLICA_TEST_WORK", "30,30")
    rec = Recorder()
    # Late = no renewal for 0.8 x lease (4.8 s): 1.2 s of margin before the Lease could expire.
    lease = LeasePolicy(6.0, 0.5, 0.3)
    with host_for(db_url, lease, hooks=rec) as bundle:
        host, sup = bundle.host, bundle.host.supervisors[0]
        request(db_url, "replica-work", "long")
        cycle_until(host, lambda: bool(sup.running), 20, "a running Worker")

        def unreachable(term: Term, seconds: float) -> bool:
            raise OperationalError("renew", {}, Exception("database unreachable"))

        monkeypatch.setattr(bundle.backend, "renew_term", unreachable)
        t0 = time.monotonic()
        cycle_until(host, lambda: sup.term is None, 10, "renewal late")
        lost_after = time.monotonic() - t0
        observer = open_backend(db_url)
        try:
            with observer.read() as conn:
                row = conn.execute(
                    text(
                        "SELECT expires_at > NOW(6) FROM pc_artifact_processing_leases "
                        "WHERE supervisor_key = 'global'"
                    )
                ).scalar_one()
        finally:
            observer.dispose()
        assert row == 1, "leadership must be dropped before the Lease can be taken over"
        assert not bundle.pool.running() and rec.exits
    print(f"\nlate renewal: leadership dropped {lost_after:.2f}s after the last renewal attempt")
    assert lost_after <= lease.lease_seconds


@contextlib.contextmanager
def lease_row_held(url: str, seconds: float) -> Iterator[threading.Event]:
    """Another session locks the Lease row (FOR UPDATE) for ``seconds``."""
    locked = threading.Event()
    backend = open_backend(url)

    def hold() -> None:
        with backend.engine.connect() as conn, conn.begin():
            conn.execute(
                text(
                    "SELECT holder_id FROM pc_artifact_processing_leases "
                    "WHERE supervisor_key = 'global' FOR UPDATE"
                )
            )
            locked.set()
            time.sleep(seconds)

    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    try:
        assert locked.wait(10)
        yield locked
    finally:
        thread.join(seconds + 10)
        backend.dispose()


def test_lock_waits_are_retried_and_never_lose_leadership(db_url: str) -> None:
    Cluster.prepare(db_url)
    with host_for(db_url, LeasePolicy(8.0, 1.0, 0.3), registry=families.auto_registry) as bundle:
        host, sup = bundle.host, bundle.host.supervisors[0]
        assert sup.term is not None
        term = sup.term
        transient: list[int] = []
        real = bundle.backend._is_transient

        def counting(exc: DBAPIError) -> bool:
            ok = real(exc)
            if ok:
                transient.append(getattr(exc.orig, "args", [0])[0])
            return ok

        bundle.backend._is_transient = counting  # type: ignore[method-assign]

        @event.listens_for(bundle.backend.engine, "checkout")
        def short_lock_wait(dbapi_conn: Any, rec: Any, proxy: Any) -> None:
            with dbapi_conn.cursor() as cur:  # lock waits time out after 1 s (real 1205s)
                cur.execute("SET ob_query_timeout = 1000000")

        backend = open_backend(db_url)
        try:
            with backend.transaction() as conn:
                for i in range(6):
                    families.auto.mark_dirty(conn, f"d{i}")
            before = _scan_generation(backend)
            with lease_row_held(db_url, 2.5):
                # Scan control writes and renewals meet the held row lock now.
                cycle_until(host, lambda: bool(transient), 10, "a lock wait timeout")
            cycle_until(
                host,
                lambda: _scan_generation(backend) > before and _all_clean(backend),
                30,
                "the scan to complete and the dirty scopes to be processed",
            )
        finally:
            backend.dispose()
        assert sup.term == term, "a lock wait must never count as leadership loss"
        assert set(transient) <= {1205, 1213, 6002, 4012}
    print(f"\nlock waits: {len(transient)} transient errors retried, term kept")


def _scan_generation(backend: SqlBackend) -> int:
    with backend.read() as conn:
        st = scans.get_state(conn, families.auto.binding_name)
    return 0 if st is None else st.scan_generation


def _all_clean(backend: SqlBackend) -> bool:
    from apsup.store import intents

    with backend.read() as conn:
        return intents.count_dirty(conn, families.auto.binding_name) == 0


def test_injected_deadlock_is_retried_inside_run_fenced(backend: SqlBackend, db_url: str) -> None:
    Cluster.prepare(db_url)
    term = backend.claim_term("global", uuid.uuid4().hex, 30)
    assert term is not None
    calls = []

    def body(conn: Any) -> str:
        calls.append(1)
        if len(calls) == 1:
            raise OperationalError("SELECT 1", {}, _Coded(1213, "Deadlock found"))
        conn.execute(insert(families.progress).values(scope_id="dl", version=1, last_g=1))
        return "done"

    assert backend.run_fenced(term, body) == "done"
    assert len(calls) == 2
    assert backend.renew_term(term, 30)  # the term is intact


class _Coded(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(code, message)


def test_a_frozen_fenced_transaction_cannot_block_a_takeover(db_url: str) -> None:
    Cluster.prepare(db_url)
    url = f"{db_url}?apsup_fence_timeout=2"
    frozen, taker = open_backend(url), open_backend(url)
    try:
        term = frozen.claim_term("global", "frozen-holder", 1.0)
        assert term is not None
        inside, outcome = threading.Event(), []

        def frozen_worker() -> None:
            try:
                with frozen.fenced(term) as conn:
                    conn.execute(
                        insert(families.progress).values(scope_id="frozen", version=1, last_g=1)
                    )
                    inside.set()
                    time.sleep(6)  # "paused" with the Lease row locked
                outcome.append("committed")
            except (DBAPIError, StaleTermError, FencedTransactionTimeout) as exc:
                outcome.append(type(exc).__name__)

        thread = threading.Thread(target=frozen_worker, daemon=True)
        thread.start()
        assert inside.wait(10)
        time.sleep(1.2)  # the Lease expires while the transaction is open
        t0 = time.monotonic()
        new = taker.claim_term("global", "standby", 30)
        waited = time.monotonic() - t0
        thread.join(15)
        assert new is not None and new.generation == term.generation + 1
        assert outcome and outcome[0] != "committed"
        with taker.read() as conn:
            assert conn.execute(select(families.progress)).all() == []  # nothing committed
    finally:
        frozen.dispose()
        taker.dispose()
    print(f"\nfrozen fenced transaction: takeover waited {waited:.2f}s (bound 2 s)")
    assert waited < 9  # below the 10 s lock-wait timeout: the bound released it
