"""The scan's upper bound is the binding's highest pending_sequence, read by index probes.

``scans.scan_upper_bound`` replaces a ``MAX`` range scan of the binding inside the write lock
with two backwards probes of ``ix_intents_dirty`` (one per dirty flag value);
``benchmarks/scan_upper_bound.py`` shows it flat from 10^4 to 10^6 Scopes. Here: it is exact.
"""

from __future__ import annotations

import random
from datetime import datetime

from sqlalchemy import func, select

from apsup.store import intents, scans
from apsup.store.base import SqlBackend
from apsup.store.schema import intents as intents_table


def _true_max(backend: SqlBackend, binding: str) -> int | None:
    with backend.read() as conn:
        value = conn.execute(
            select(func.max(intents_table.c.pending_sequence)).where(
                intents_table.c.binding_name == binding
            )
        ).scalar_one()
    return None if value is None else int(value)


def test_upper_bound_equals_the_highest_sequence_of_the_binding(backend: SqlBackend) -> None:
    rng = random.Random(7)
    with backend.read() as conn:
        assert scans.scan_upper_bound(conn, "b") is None
    for step in range(40):
        with backend.transaction() as conn:
            binding = rng.choice(["b", "c"])
            scope = f"s{rng.randrange(12)}"
            if rng.random() < 0.5:
                intents.mark_dirty(conn, binding, scope)
            else:
                intents.request(conn, binding, scope)
        if step % 5 == 0:  # some rows clean again, so both flag values hold the maximum
            with backend.transaction() as conn:
                for row in conn.execute(
                    select(intents_table.c.scope_id, intents_table.c.dirty_generation).where(
                        intents_table.c.binding_name == "b"
                    )
                ).all():
                    intents.mark_clean(conn, "b", row[0], int(row[1]), None)
        for name in ("b", "c"):
            with backend.read() as conn:
                assert scans.scan_upper_bound(conn, name) == _true_max(backend, name)
    term = backend.claim_term("global", "h", 30)
    assert term is not None
    state = backend.run_fenced(term, lambda conn: scans.start_scan(conn, "b", datetime(2026, 1, 1)))
    assert state.scan_upper_pending_sequence == _true_max(backend, "b")
