"""RFC acceptance 4: a processor that handles only part of its input succeeds, keeps
``dirty > clean`` and runs again at the next automatic interval until no work remains.

The ``half`` processor consumes half of the unconsumed inputs (rounded up) per invocation and
marks clean only when it consumed everything it saw: 8 inputs take 4 invocations (4, 2, 1, 1).
"""

from __future__ import annotations

import pytest

from tests.acceptance.families import add_inputs, configure, input_rows
from tests.acceptance.harness import intent, scan_state, scope_events, write

pytestmark = pytest.mark.timeout(180)


def test_partial_progress_leaves_dirty_work_for_the_next_interval(hosts, store):
    fam = configure("acc-b", interval=0.5, max_workers=2)
    write(store, lambda c: add_inputs(c, fam, "half.s", [f"in{i}" for i in range(8)]))
    host = hosts.live_host([fam])

    host.run_until(lambda: scope_events(store, fam, "half.s"), "the first invocation")
    host.run_until(
        lambda: scope_events(store, fam, "half.s")[0]["ended_us"], "the first invocation ends"
    )
    row = intent(store, fam, "half.s")
    assert row.handled_generation >= 1, "the partial invocation succeeded (acknowledged)"
    assert row.dirty_generation > row.clean_generation, "remaining work stays dirty"

    def all_consumed():
        with store.read() as conn:
            return all(r["consumed_generation"] for r in input_rows(conn, fam.name, "half.s"))

    host.run_until(all_consumed, "every input consumed by later automatic invocations")
    host.run_until(
        lambda: (
            intent(store, fam, "half.s").clean_generation
            == intent(store, fam, "half.s").dirty_generation
        ),
        "the last invocation marks the Scope clean",
    )
    evs = scope_events(store, fam, "half.s")
    assert [e["outcome"] for e in evs] == ["took 4/8", "took 2/4", "took 1/2", "took 1/1"]
    # Each invocation was an automatic admission of a later scan (no explicit request was made).
    scans_seen = [e["last_scan"] for e in evs]
    assert scans_seen == sorted(scans_seen) and len(set(scans_seen)) == 4
    assert [e["generation"] for e in evs] == [1, 2, 3, 4]
    row = intent(store, fam, "half.s")
    assert (row.requested_generation, row.handled_generation) == (4, 4)

    # Clean now: later checks keep running on schedule but admit nothing more.
    last = scan_state(store, fam).scan_generation
    host.run_until(
        lambda: scan_state(store, fam).scan_generation >= last + 2, "two more checks run"
    )
    assert len(scope_events(store, fam, "half.s")) == 4
    assert intent(store, fam, "half.s").requested_generation == 4
