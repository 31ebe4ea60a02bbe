"""RFC acceptance 8: several requests while queued or running coalesce; a success
acknowledgment swallows no later request or dirty state.

- Queued: requests that arrive while a Scope waits in the ready queue merge into one invocation
  carrying the latest requested generation G.
- Running: requests during execution advance requested; the invocation acknowledges only its own
  G, then exactly one successor runs with the latest G.
- Dirty during execution: the processor marks clean only the dirty generation it read, so new
  dirty state for an already scanned Scope is admitted by a later check.
"""

from __future__ import annotations

import pytest

from apsup.scheduling import KeyState
from tests.acceptance.families import configure
from tests.acceptance.harness import (
    completed,
    intent,
    mark_dirty,
    request,
    scope_events,
    set_flag,
)

pytestmark = pytest.mark.timeout(180)


def _started(store, fam, scope):
    return len(scope_events(store, fam, scope))


def test_requests_coalesce_while_queued_and_while_running(hosts, store):
    fam = configure("acc-manual", disabled=True, max_workers=1)
    host = hosts.live_host([fam])
    core = lambda: host.supervisor.core  # noqa: E731

    # Running: gate.z blocks its Worker (the family's only one).
    assert request(store, fam, "gate.z") == 1
    host.run_until(lambda: _started(store, fam, "gate.z") == 1, "gate.z runs")
    # Queued: ok.y waits behind it in the ready queue.
    assert request(store, fam, "ok.y") == 1
    host.run_until(lambda: core().key_state(fam.name, "ok.y") is KeyState.READY, "ok.y is queued")
    assert request(store, fam, "ok.y") == 2
    assert request(store, fam, "ok.y") == 3
    for expected in (2, 3, 4):  # three requests while gate.z runs
        assert request(store, fam, "gate.z") == expected
    host.run_for(0.5)  # the host sees the notifications; nothing may start yet
    assert _started(store, fam, "ok.y") == 0 and _started(store, fam, "gate.z") == 1

    set_flag(store, "gate:gate.z")
    host.run_until(
        lambda: (
            intent(store, fam, "gate.z").handled_generation == 4
            and intent(store, fam, "ok.y").handled_generation == 3
        ),
        "both Scopes acknowledge their latest requests",
    )
    host.run_for(0.5)
    y = scope_events(store, fam, "ok.y")
    assert [e["generation"] for e in y] == [3], "queued requests ran as one invocation of G=3"
    z = scope_events(store, fam, "gate.z")
    assert [e["generation"] for e in z] == [1, 4], "exactly one successor, carrying G=4"
    assert [e["outcome"] for e in z] == ["ok", "ok"]
    assert core().key_state(fam.name, "gate.z") is None  # free: nothing more to run


def test_dirty_state_during_execution_is_not_swallowed(hosts, store):
    fam = configure("acc-a", interval=0.5, max_workers=2)
    host = hosts.live_host([fam])
    mark_dirty(store, fam, "gate.w")
    host.run_until(lambda: _started(store, fam, "gate.w") == 1, "the first check runs gate.w")
    assert mark_dirty(store, fam, "gate.w") == 2  # new input while it runs
    set_flag(store, "gate:gate.w")
    host.run_until(lambda: completed(store, fam, "gate.w") == 2, "a later check runs it again")

    first, second = scope_events(store, fam, "gate.w")
    assert first["dirty"] == 1 and second["dirty"] == 2
    assert second["last_scan"] > first["last_scan"]  # admitted by a later automatic check
    row = intent(store, fam, "gate.w")
    assert row.clean_generation == row.dirty_generation == 2
    assert row.requested_generation == row.handled_generation == 2
