"""RFC acceptance 5: artifact scheduling policies are independent; full capacity does not
advance the checkpoint; scan completion does not await Worker success.
"""

from __future__ import annotations

import itertools
from datetime import timedelta

import pytest

from tests.acceptance.families import configure
from tests.acceptance.harness import (
    completed,
    events,
    intent,
    mark_dirty,
    request,
    scan_state,
    scope_events,
    set_flag,
)

pytestmark = pytest.mark.timeout(180)

SLACK = timedelta(milliseconds=50)


def test_policies_are_independent_per_type(hosts, store):
    busy = configure("acc-a", interval=0.5, max_workers=1)
    slow = configure("acc-b", interval=1.5, max_workers=1)
    manual = configure("acc-manual", disabled=True, max_workers=1)
    mark_dirty(store, busy, "hold.1")  # occupies acc-a's only Worker for the whole test
    host = hosts.live_host([busy, slow, manual])
    seen: dict[str, dict[int, object]] = {busy.name: {}, slow.name: {}}

    def sample() -> bool:
        for fam in (busy, slow):
            st = scan_state(store, fam)
            if st is not None and st.scan_generation:
                seen[fam.name].setdefault(st.scan_generation, st.checkpoint)
        return len(seen[slow.name]) >= 3

    host.run_until(sample, "three checks of the 1.5 s type")
    hold = scope_events(store, busy, "hold.1")
    assert len(hold) == 1 and hold[0]["ended_us"] is None, "acc-a stayed busy throughout"

    # The other type kept checking on its own interval although acc-a was busy; acc-a, whose only
    # Worker is held, skipped every check after the one that admitted hold.1 (no Worker
    # capacity: no scan, no checkpoint advance).
    assert len(seen[busy.name]) == 1, seen[busy.name]
    for fam, seconds in ((busy, 0.5), (slow, 1.5)):
        gens = sorted(seen[fam.name])
        for g1, g2 in itertools.pairwise(gens):
            gap = seen[fam.name][g2] - seen[fam.name][g1]
            assert gap >= timedelta(seconds=seconds) * (g2 - g1) - SLACK, (fam.name, g1, g2, gap)
    # Automatic admission disabled: its binding never starts a check.
    st = scan_state(store, manual)
    assert st is None or (st.scan_generation == 0 and st.checkpoint is None)

    set_flag(store, f"hold:{busy.name}")
    host.run_until(lambda: completed(store, busy, "hold.1") == 1, "the busy Worker finishes")


@pytest.mark.backends("sqlite")
def test_full_capacity_does_not_advance_the_checkpoint(hosts, store):
    fam = configure("acc-c", interval=0.5, max_workers=1)
    mark_dirty(store, fam, "ok.d")
    host = hosts.live_host([fam])
    host.run_until(
        lambda: completed(store, fam, "ok.d") == 1 and not scan_state(store, fam).scan_in_progress,
        "a first check admits and completes ok.d",
    )
    # Fill the type: one Worker held, the ready queue full of explicit requests.
    limit = host.snapshot()[fam.name].ready_limit
    for i in range(limit + 3):
        request(store, fam, f"hold.{i}")
    # The queue fills with the page read before or after the first dispatch: limit or limit - 1
    # keys (a page that overflowed pauses the pass until half the queue has been dispatched).
    host.run_until(
        lambda: (s := host.snapshot()[fam.name]).running == 1 and s.ready >= limit - 1,
        "one running Worker and a full ready queue",
    )
    mark_dirty(store, fam, "ok.d")  # ordinary work the next check would admit
    before = scan_state(store, fam)
    host.run_for(2.0)  # four intervals

    after = scan_state(store, fam)
    assert (after.scan_generation, after.checkpoint, after.scan_in_progress) == (
        before.scan_generation,
        before.checkpoint,
        before.scan_in_progress,
    ), "a check started (or the checkpoint moved) while the type had no capacity"
    now = host.supervisor.now()
    snap = host.supervisor.core.snapshot(now)[fam.name]
    assert snap.due_at is not None and snap.due_at <= now, "the type remains due"
    assert completed(store, fam, "ok.d") == 1

    set_flag(store, f"hold:{fam.name}")
    host.run_until(
        lambda: completed(store, fam, "ok.d") == 2, "once capacity frees, the due check runs"
    )
    resumed = scan_state(store, fam)
    assert resumed.scan_generation > before.scan_generation
    assert resumed.checkpoint > before.checkpoint
    host.run_until(lambda: completed(store, fam) == 2 + limit + 3, "every held request completes")


def test_scan_completion_does_not_await_worker_success(hosts, store):
    fam = configure("acc-b", interval=0.5, max_workers=2)
    mark_dirty(store, fam, "hold.x")
    mark_dirty(store, fam, "fail.y")
    host = hosts.live_host([fam])
    host.run_until(
        lambda: (
            scope_events(store, fam, "hold.x")
            and any(e["outcome"] == "fail" for e in scope_events(store, fam, "fail.y"))
        ),
        "hold.x runs and fail.y has failed",
    )
    first = scan_state(store, fam).scan_generation
    host.run_until(
        lambda: (
            (st := scan_state(store, fam)).scan_generation >= first + 2 and not st.scan_in_progress
        ),
        "two later checks start and complete",
    )
    # Those scans completed while hold.x was still running and fail.y still unacknowledged.
    assert [e["ended_us"] for e in scope_events(store, fam, "hold.x")] == [None]
    y = intent(store, fam, "fail.y")
    assert y.requested_generation > y.handled_generation
    assert all(
        e["outcome"] in ("fail", None) for e in events(store, fam) if "fail" in e["scope_id"]
    )

    set_flag(store, f"hold:{fam.name}")
    host.run_until(lambda: completed(store, fam, "hold.x") == 1, "hold.x finishes after release")
