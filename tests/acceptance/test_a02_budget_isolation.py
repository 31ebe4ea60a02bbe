"""RFC acceptance 2: long tasks fill one type's capacity while other types still discover and
dispatch work; keys in backoff on earlier pages cannot starve later pages.
"""

from __future__ import annotations

import pytest

from tests.acceptance.families import configure
from tests.acceptance.harness import completed, events, mark_dirty, request, set_flag, write

pytestmark = pytest.mark.timeout(180)

FAILING, LATE, PAGE = 60, 8, 25


def _open(store, fam):
    return [e for e in events(store, fam) if e["ended_us"] is None]


def test_long_tasks_of_one_type_do_not_block_another_type(hosts, store):
    slow = configure("acc-a", interval=0.5, max_workers=2)
    fast = configure("acc-b", interval=0.5, max_workers=2)
    host = hosts.live_host([slow, fast])
    for i in range(4):
        mark_dirty(store, slow, f"hold.{i}")  # each Worker waits until the test releases it
    host.run_until(lambda: len(_open(store, slow)) == 2, "acc-a fills its 2 Workers")

    # acc-a is at capacity; acc-b discovers dirty Scopes (automatic) and explicit requests.
    for i in range(4):
        mark_dirty(store, fast, f"ok.d{i}")
    for i in range(4):
        request(store, fast, f"ok.r{i}")
    host.run_until(lambda: completed(store, fast) >= 8, "acc-b completes 8 invocations")

    slow_events = events(store, slow)
    assert len(slow_events) == 2, "acc-a started more Workers than its budget"
    assert all(e["ended_us"] is None for e in slow_events), "acc-a's long tasks were not running"
    snap = host.snapshot()[slow.name]
    assert snap.running == 2 and snap.ready == 2  # the other two wait for acc-a's own capacity

    set_flag(store, f"hold:{slow.name}")
    host.run_until(lambda: completed(store, slow) == 4, "acc-a finishes after release")


@pytest.mark.backends("sqlite")
def test_keys_in_backoff_do_not_starve_later_pages(hosts, store):
    """60 failing Scopes fill the first three discovery pages; 8 healthy ones follow."""
    fam = configure("acc-c", interval=0.5, max_workers=3)

    def register(conn):
        for i in range(FAILING):
            fam.mark_dirty(conn, f"fail.{i:03d}")
        for i in range(LATE):
            fam.mark_dirty(conn, f"ok.late{i}")

    write(store, register)
    # A long backoff keeps failed keys waiting while the scan moves on to later pages.
    host = hosts.live_host([fam], backoff=(30.0, 60.0), page_size=PAGE)
    host.run_until(lambda: completed(store, fam) == LATE, "the Scopes on the later page complete")
    late = [e for e in events(store, fam) if e["scope_id"].startswith("ok.")]
    # They were admitted by the very first scan, behind every failing key.
    assert {e["last_scan"] for e in late} == {1}
    failed = {e["scope_id"] for e in events(store, fam) if e["outcome"] == "fail"}
    assert len(failed) == FAILING, "every failing key ran once before the later page completed"
    snap = host.snapshot()[fam.name]
    assert snap.retry_wait == FAILING and snap.ready == 0
    assert snap.max_consecutive_failures == 1
