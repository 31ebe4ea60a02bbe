"""RFC §9: SIGTERM stops discovery and dispatch, stops running Workers within the bound, leaves
unacknowledged requests pending (requested > handled stays durable) and invalidates the term;
a restart finishes them.
"""

from __future__ import annotations

import signal

import pytest

from apsup.store.leases import GLOBAL_KEY, INVALIDATED
from tests.acceptance.families import configure, now_us
from tests.acceptance.harness import all_intents, events, pid_alive, request, set_flag, wait_for

pytestmark = [pytest.mark.timeout(180), pytest.mark.backends("sqlite")]

SPEC = {"acc-manual": {"disabled": True, "max_workers": 3, "timeout": 60}}
SCOPES = [f"hold.{i}" for i in range(5)]


def test_sigterm_stops_workers_keeps_requests_and_restart_finishes_them(hosts, store):
    fam = configure("acc-manual", **SPEC["acc-manual"])
    first = hosts.process(SPEC, shutdown_grace=2.0)
    first.wait_ready()
    for scope in SCOPES:
        request(store, fam, scope)  # each Worker waits for a flag that is not set yet
    wait_for(lambda: len(events(store, fam)) == 3, "three Workers (the budget) are running")
    pids = [e["pid"] for e in events(store, fam)]
    assert all(pid_alive(p) for p in pids)

    signalled = now_us()
    first.signal(signal.SIGTERM)
    assert first.wait() == 0, first.errors()[-2000:]
    assert not any(pid_alive(p) for p in pids), "a Worker outlived the host's shutdown"
    evs = events(store, fam)
    assert len(evs) == 3 and all(e["started_us"] < signalled for e in evs), "dispatch after TERM"
    assert all(e["ended_us"] is None for e in evs)
    rows = all_intents(store, fam)
    assert all(r.requested_generation == 1 and r.handled_generation == 0 for r in rows.values())
    (lease,) = [r for r in store.lease_rows() if r.supervisor_key == GLOBAL_KEY]
    assert lease.holder_id == INVALIDATED  # no leftover Worker of that term can commit

    set_flag(store, f"hold:{fam.name}")
    second = hosts.process(SPEC)
    second.wait_ready()
    wait_for(
        lambda: all(r.handled_generation == 1 for r in all_intents(store, fam).values()),
        "the restarted host finishes every pending request",
    )
    assert {e["scope_id"] for e in events(store, fam) if e["outcome"] == "ok"} == set(SCOPES)
    second.signal(signal.SIGTERM)
    assert second.wait() == 0
