"""RFC acceptance 3: a persistently failing Scope backs off without blocking its siblings; for an
ordered processor B2 never overtakes the failing B1, while A3, arriving after A completed its
earlier input, stays eligible in a later cycle.

The ``ordered`` processor consumes one input per invocation, in position order, in the same
fenced transaction that acknowledges; an input ``poison`` makes every attempt fail (rolled back).
"""

from __future__ import annotations

import itertools

import pytest

from apsup.scheduling import KeyState
from tests.acceptance.families import add_inputs, configure, input_rows
from tests.acceptance.harness import events, scope_events, write

pytestmark = pytest.mark.timeout(180)


def test_failing_scope_backs_off_while_sibling_completes_three_invocations(hosts, store):
    fam = configure("acc-a", interval=0.5, max_workers=2)
    write(store, lambda c: add_inputs(c, fam, "ordered.A", ["A1", "A2"]))
    write(store, lambda c: add_inputs(c, fam, "ordered.B", ["poison", "B2"]))
    host = hosts.live_host([fam])

    def consumed(scope):
        with store.read() as conn:
            return [r for r in input_rows(conn, fam.name, scope) if r["consumed_generation"]]

    host.run_until(lambda: len(consumed("ordered.A")) == 2, "A consumes A1 and A2")
    # A3 arrives after A has completed its earlier work: a later automatic check admits it.
    write(store, lambda c: add_inputs(c, fam, "ordered.A", ["A3"]))
    host.run_until(lambda: len(consumed("ordered.A")) == 3, "A consumes A3 in a later cycle")
    host.run_until(
        lambda: host.snapshot()[fam.name].max_consecutive_failures >= 3,
        "B fails three times in a row, retried after backoff",
    )

    a_rows = consumed("ordered.A")
    assert [r["payload"] for r in a_rows] == ["A1", "A2", "A3"]
    generations = [r["consumed_generation"] for r in a_rows]
    assert generations == sorted(generations) and len(set(generations)) == 3  # 3 invocations
    assert [e["outcome"] for e in scope_events(store, fam, "ordered.A")] == ["A1", "A2", "A3"]

    # B1 keeps failing; B2 is never consumed ahead of it.
    assert consumed("ordered.B") == []
    b_events = scope_events(store, fam, "ordered.B")
    assert {e["outcome"] for e in b_events} <= {"poison", None}  # None: an attempt in progress
    assert len({e["generation"] for e in b_events}) == 1  # retries of the same unacknowledged G
    assert host.supervisor.core.key_state(fam.name, "ordered.B") in (
        KeyState.RETRY_WAIT,
        KeyState.READY,
        KeyState.RUNNING,
    )
    assert sum(e["outcome"] == "poison" for e in b_events) >= 3
    # Backoff: attempts of B never come back to back (waits of about 0.3 s, 0.6 s,
    # 1.2 s... in this test's scheduler; the RFC's 30 s base in production).
    starts = [e["started_us"] for e in b_events]
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    assert all(gap >= 200_000 for gap in gaps), gaps
    assert all(e["ended_us"] for e in events(store, fam) if e["scope_id"] == "ordered.A")
