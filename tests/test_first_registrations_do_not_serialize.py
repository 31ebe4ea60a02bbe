"""First registrations do not wait for each other (MySQL mode: real row locks, real transactions).

A Scope's first ``request()``/``mark_dirty()`` assigns it a never-reused pending sequence. An
application transaction that registers a Scope and stays open must not make every other first
registration wait for it: the counter is advanced in a short transaction of its own. Sequences
stay unique; one reserved by a transaction that rolls back is never used. (On SQLite every write
transaction locks the whole database, so writers queue there whatever they touch.)
"""

from __future__ import annotations

import threading

import pytest

from apsup.store import intents, migrate, open_backend
from tests import liveness_families as lf

pytestmark = [pytest.mark.timeout(60), pytest.mark.backends("mysql")]


def test_an_open_registration_does_not_hold_up_another(db_url: str) -> None:
    migrate(db_url)
    first, second = open_backend(db_url), open_backend(db_url)
    fam = lf.live_work
    done = threading.Event()
    errors: list[BaseException] = []

    def register_other() -> None:
        try:
            with second.transaction() as conn:
                fam.request(conn, "second")
            done.set()
        except BaseException as exc:
            errors.append(exc)

    try:
        with first.transaction() as conn:
            fam.request(conn, "first")  # registered; the transaction stays open
            worker = threading.Thread(target=register_other)
            worker.start()
            committed_meanwhile = done.wait(5.0)
        worker.join(15)
        assert not errors, errors
        assert committed_meanwhile, "a first registration waited for an open one"
        with first.transaction() as conn:
            fam.request(conn, "third")
        with first.transaction() as conn:
            fam.request(conn, "rolled-back")
            conn.rollback()
        with first.transaction() as conn:
            fam.request(conn, "fourth")
        with first.read() as conn:
            seqs = {
                s: intents.get(conn, fam.binding_name, s).pending_sequence  # type: ignore[union-attr]
                for s in ("first", "second", "third", "fourth")
            }
            assert intents.get(conn, fam.binding_name, "rolled-back") is None
        assert len(set(seqs.values())) == 4, seqs
        assert seqs["third"] < seqs["fourth"] and max(seqs["first"], seqs["second"]) < seqs["third"]
    finally:
        first.dispose()
        second.dispose()
