"""Unit tests of the sans-IO scheduling core, one per RFC rule (§2, §4, §5, §7, §8).

Each test drives ``Scheduler`` by hand the way the IO shell does: ``decide`` returns one step, the
test plays the database's answer back through the matching ``on_*`` event.
"""

from __future__ import annotations

import random
from datetime import datetime, timedelta
from typing import Any

import pytest

from apsup.errors import ConfigError
from apsup.policy import Cron, Disabled, Interval, Policy
from apsup.scheduling import (
    Admit,
    Backoff,
    BindingState,
    Decision,
    Dispatch,
    EndScan,
    FamilySpec,
    FetchRequests,
    FetchScanPage,
    KeyState,
    Outcome,
    RequestRow,
    ScanRow,
    Scheduler,
    StartScan,
)

T0 = datetime(2026, 1, 1, 12, 0, 0)
EMPTY = BindingState(None, 0, False, None)


def spec(
    name: str = "a",
    policy: Policy | None = None,
    max_workers: int = 2,
    ready_limit: int | None = None,
    page_size: int = 100,
) -> FamilySpec:
    return FamilySpec(name, policy or Disabled(), max_workers, ready_limit, page_size)


def make(*specs: FamilySpec, seed: int = 0, **kw: Any) -> Scheduler:
    s = Scheduler(list(specs), rng=random.Random(seed), **kw)
    for sp in specs:
        s.restore(sp.name, EMPTY)
    return s


def finish_request_pass(
    s: Scheduler, family: str, rows: list[RequestRow], now: datetime = T0
) -> None:
    """Answer the family's pending request pass with one final page."""
    d = s.decide(now)
    assert isinstance(d, FetchRequests) and d.family == family, d
    s.on_request_page(family, rows, exhausted=True)


def rows(*scopes: str, start: int = 1) -> list[RequestRow]:
    return [RequestRow(scope, start + i) for i, scope in enumerate(scopes)]


def dispatch(s: Scheduler, now: datetime = T0, started: bool = True) -> Dispatch:
    d = s.decide(now)
    assert isinstance(d, Dispatch), d
    s.on_dispatched(d.family, d.scope_id, started, token=d.token)
    return d


def drain(s: Scheduler, now: datetime = T0) -> list[Decision]:
    """Decide until None, answering Dispatch with started=True (other steps must not occur)."""
    out: list[Decision] = []
    while (d := s.decide(now)) is not None:
        assert isinstance(d, Dispatch), d
        s.on_dispatched(d.family, d.scope_id, True, token=d.token)
        out.append(d)
    return out


# --- §2 key states, budgets, rotation ------------------------------------------------------------


def test_key_states_exclusive_and_running_counts_against_budget_from_dispatch() -> None:
    s = make(spec(max_workers=1))
    finish_request_pass(s, "a", rows("x", "y"))
    assert s.keys("a") == {"x": KeyState.READY, "y": KeyState.READY}
    d = s.decide(T0)
    assert isinstance(d, Dispatch) and d.scope_id == "x" and d.reason == "request"
    # counted as running before on_dispatched: no second dispatch meanwhile
    assert s.snapshot()["a"].running == 1 and s.key_state("a", "x") is KeyState.RUNNING
    s.on_dispatched("a", "x", True)
    assert s.decide(T0) is None  # budget 1 used
    s.on_worker_exit("a", "x", Outcome.SUCCESS, False, T0)
    assert s.key_state("a", "x") is None
    assert dispatch(s).scope_id == "y"
    s.verify()


def test_never_two_running_workers_for_one_key() -> None:
    s = make(spec(max_workers=3))
    finish_request_pass(s, "a", rows("x"))
    dispatch(s)
    s.on_notify("a")  # a new request for the running key
    finish_request_pass(s, "a", rows("x"))
    assert s.key_state("a", "x") is KeyState.RUNNING and s.decide(T0) is None
    s.on_worker_exit("a", "x", Outcome.SUCCESS, more_requested=True, now=T0)
    assert s.key_state("a", "x") is KeyState.READY
    assert dispatch(s).reason == "successor"


def test_a_confirmed_exit_frees_its_slot_while_its_key_waits_for_the_outcome() -> None:
    """``on_worker_exited``: the Worker is gone, so its capacity goes to the next key at once;
    its own key stays occupied (never a second Worker for it) until ``on_worker_exit``."""
    s = make(spec(max_workers=1))
    finish_request_pass(s, "a", rows("x", "y"))
    x = dispatch(s)
    assert s.decide(T0) is None  # budget 1 used
    s.on_worker_exited("a", "x", token=x.token + 1)  # another dispatch's exit: ignored
    assert s.key_state("a", "x") is KeyState.RUNNING and s.running_count("a") == 1
    s.on_worker_exited("a", "x", token=x.token)
    assert s.key_state("a", "x") is KeyState.EXITED and s.running_count("a") == 0
    s.on_worker_exited("a", "x", token=x.token)  # reported twice: counted once
    assert s.running_count("a") == 0
    s.verify()
    assert dispatch(s).scope_id == "y"  # the freed slot, before x's outcome is known
    s.on_notify("a")  # a new request for x meanwhile: x is busy, not queued again
    finish_request_pass(s, "a", rows("x"))
    assert s.key_state("a", "x") is KeyState.EXITED and s.decide(T0) is None
    s.on_worker_exit("a", "x", Outcome.SUCCESS, more_requested=True, now=T0, token=x.token)
    assert s.running_count("a") == 1  # y's slot only: x's was released once
    assert s.key_state("a", "x") is KeyState.READY  # its successor, queued for room
    assert s.decide(T0) is None  # y holds the budget
    s.verify()
    s.on_worker_exit("a", "y", Outcome.SUCCESS, False, T0)
    assert dispatch(s).scope_id == "x"
    s.verify()


def test_an_exited_key_whose_outcome_is_a_failure_backs_off() -> None:
    s = make(spec(max_workers=2))
    finish_request_pass(s, "a", rows("x"))
    x = dispatch(s)
    s.on_worker_exited("a", "x", token=x.token)
    s.on_worker_exit("a", "x", Outcome.FAILURE, False, T0, token=x.token)
    info = s.key_info("a", "x")
    assert info is not None and info.state is KeyState.RETRY_WAIT
    assert info.consecutive_failures == 1 and s.running_count("a") == 0
    s.verify()


def test_type_first_rotation_round_robin_and_full_family_does_not_block_others() -> None:
    s = make(spec("a", max_workers=1), spec("b", max_workers=2), spec("c", max_workers=2))
    for fam in ("a", "b", "c"):
        d = s.decide(T0)
        assert isinstance(d, FetchRequests) and d.family == fam
        s.on_request_page(fam, rows("k1", "k2"), exhausted=True)
    served = [d.family for d in drain(s)]
    assert served == ["a", "b", "c", "b", "c"]  # round-robin; "a" skipped once its budget is used


def test_dispatch_preferred_and_full_ready_queue_stops_discovery_and_checkpoint() -> None:
    s = Scheduler([spec(policy=Interval(60), max_workers=1, ready_limit=2)], rng=random.Random(0))
    s.restore("a", BindingState(T0, 1, False, None))
    d = s.decide(T0)
    assert isinstance(d, FetchRequests)
    s.on_request_page("a", rows("x", "y", "z"), exhausted=False)
    assert s.snapshot()["a"].ready == 2  # x, y: the pass pauses before z
    assert dispatch(s).scope_id == "x"  # dispatch is preferred over discovery
    d = s.decide(T0)
    assert d == FetchRequests("a", 2, 3)  # after y: one free place + the 2 keys held
    s.on_request_page("a", rows("z", start=3), exhausted=True)
    assert s.snapshot()["a"].ready == 2 and s.snapshot()["a"].running == 1
    # due, but no capacity: no StartScan, and the checkpoint does not advance (still due)
    later = T0 + timedelta(hours=1)
    assert s.decide(later) is None
    assert s.snapshot()["a"].checkpoint == T0
    assert s.next_wakeup(later) is None  # only an exit can make room
    s.on_worker_exit("a", "x", Outcome.SUCCESS, False, later)
    assert dispatch(s, later).scope_id == "y"
    # Ready room again, but the only Worker is busy and z waits for it: still no check.
    assert s.decide(later) is None and s.next_wakeup(later) is None
    s.on_worker_exit("a", "y", Outcome.SUCCESS, False, later)
    assert dispatch(s, later).scope_id == "z"
    s.on_worker_exit("a", "z", Outcome.SUCCESS, False, later)
    assert s.decide(later) == StartScan("a", later)  # the first free Worker starts it


def test_one_step_in_flight_per_family_does_not_block_other_families() -> None:
    s = make(spec("a", policy=Interval(60)), spec("b"))
    finish_request_pass(s, "a", [])
    d = s.decide(T0)
    assert isinstance(d, FetchRequests) and d.family == "b"  # rotation
    s.on_request_page("b", rows("x"), exhausted=True)
    start = s.decide(T0)
    assert isinstance(start, StartScan) and start.family == "a"
    # while a's StartScan is in flight, only b can act
    d = s.decide(T0)
    assert isinstance(d, Dispatch) and d.family == "b"
    s.on_dispatched("b", "x", True)
    assert s.decide(T0) is None
    s.on_scan_started("a", 1, 5, T0)
    assert isinstance(s.decide(T0), FetchScanPage)


def test_events_for_steps_not_in_flight_are_ignored() -> None:
    s = make(spec(policy=Interval(60)))
    finish_request_pass(s, "a", [])
    s.on_scan_page("a", 1, [ScanRow("x", 1, 0)], True)
    s.on_admitted("a", "x", True)
    s.on_worker_exit("a", "nobody", Outcome.SUCCESS, True, T0)
    assert s.ignored_events == 3 and s.keys("a") == {}


# --- §2 fair ready queue -------------------------------------------------------------------------


def test_fair_fifo_every_source_goes_to_the_tail() -> None:
    s = make(spec(max_workers=1, ready_limit=8))
    finish_request_pass(s, "a", rows("r1"))
    dispatch(s)  # r1 running
    s.on_notify("a")
    finish_request_pass(s, "a", rows("r2", "r3", start=2))
    s.on_worker_exit("a", "r1", Outcome.SUCCESS, more_requested=True, now=T0)  # successor
    order = []
    while True:
        d = s.decide(T0)
        if d is None:
            break
        assert isinstance(d, Dispatch)
        s.on_dispatched("a", d.scope_id, True)
        order.append((d.scope_id, d.reason))
        s.on_worker_exit("a", d.scope_id, Outcome.SUCCESS, False, T0)
    assert order == [("r2", "request"), ("r3", "request"), ("r1", "successor")]


def test_retry_wait_never_occupies_ready_and_due_retry_waits_for_room() -> None:
    s = make(spec(max_workers=1, ready_limit=1), backoff=Backoff(jitter=0))
    finish_request_pass(s, "a", rows("f"))
    dispatch(s)
    s.on_worker_exit("a", "f", Outcome.FAILURE, False, T0)
    snap = s.snapshot(T0)
    assert (snap["a"].retry_wait, snap["a"].ready) == (1, 0)
    assert snap["a"].next_retry_at == T0 + timedelta(seconds=30)
    assert s.next_wakeup(T0) == T0 + timedelta(seconds=30)
    s.on_notify("a")
    finish_request_pass(s, "a", rows("g", "h", start=2))  # room for one: g; pass pauses at h
    dispatch(s)  # g runs
    d = s.decide(T0)
    assert isinstance(d, FetchRequests)
    s.on_request_page("a", rows("h", start=3), exhausted=True)  # h fills the ready queue
    later = T0 + timedelta(seconds=31)
    assert s.decide(later) is None  # f is due but ready is full: it stays in retry-wait
    assert s.key_state("a", "f") is KeyState.RETRY_WAIT
    assert s.next_wakeup(later) is None  # waiting for room is woken by events, not polling
    s.on_worker_exit("a", "g", Outcome.SUCCESS, False, later)
    assert dispatch(s, later).scope_id == "h"
    assert s.decide(later) is None  # promoted into the freed room, but the budget is used
    assert s.key_state("a", "f") is KeyState.READY


def test_due_retries_and_discovery_take_turns_for_ready_room() -> None:
    s = Scheduler(
        [spec(policy=Interval(3600), max_workers=1, ready_limit=1, page_size=10)],
        rng=random.Random(0),
    )
    s.restore("a", BindingState(T0, 0, False, None))  # next scan due at T0 + 1h
    failed: set[str] = set()
    while len(failed) < 2:  # f1 and f2 are requested; each fails once
        d = s.decide(T0)
        if isinstance(d, FetchRequests):
            s.on_request_page("a", rows("f1", "f2"), exhausted=True)
        else:
            assert isinstance(d, Dispatch), d
            s.on_dispatched("a", d.scope_id, True)
            s.on_worker_exit("a", d.scope_id, Outcome.FAILURE, False, T0)
            failed.add(d.scope_id)
    later = T0 + timedelta(hours=1)
    # both retries are due and a scan is due; the ready queue has room for one key at a time
    reasons = []
    for _ in range(4):
        d = s.decide(later)
        while isinstance(d, StartScan | FetchScanPage | Admit):
            if isinstance(d, StartScan):
                s.on_scan_started("a", 1, 10, later)
            elif isinstance(d, FetchScanPage):
                s.on_scan_page("a", 1, [ScanRow("n1", 3, 0), ScanRow("n2", 4, 0)], True)
            else:
                s.on_admitted("a", d.scope_id, True)
            d = s.decide(later)
        assert isinstance(d, Dispatch)
        s.on_dispatched("a", d.scope_id, True)
        s.on_worker_exit("a", d.scope_id, Outcome.SUCCESS, False, later)
        reasons.append(d.reason)
    assert reasons == ["retry", "scan", "retry", "scan"]


# --- §4 schedule, checkpoint, coalescing ---------------------------------------------------------


def run_scan(
    s: Scheduler, family: str, now: datetime, gen: int, pages: list[list[ScanRow]]
) -> None:
    """Answer StartScan/FetchScanPage/Admit/EndScan for one whole scan (admit everything)."""
    d = s.decide(now)
    assert isinstance(d, StartScan), d
    s.on_scan_started(family, gen, 100, d.checkpoint)
    remaining = list(pages)
    while True:
        d = s.decide(now)
        if isinstance(d, FetchScanPage):
            page = remaining.pop(0) if remaining else []
            s.on_scan_page(family, gen, page, exhausted=not remaining)
        elif isinstance(d, Admit):
            s.on_admitted(family, d.scope_id, True)
        elif isinstance(d, EndScan):
            s.on_scan_ended(family, gen)
            return
        else:
            raise AssertionError(d)


def test_interval_first_check_immediate_then_measured_between_check_starts() -> None:
    s = make(spec(policy=Interval(300)))
    finish_request_pass(s, "a", [])
    assert s.next_wakeup(T0) == T0
    run_scan(s, "a", T0, 1, [])
    assert s.snapshot()["a"].checkpoint == T0
    assert s.decide(T0 + timedelta(seconds=299)) is None
    assert s.next_wakeup(T0) == T0 + timedelta(seconds=300)
    assert isinstance(s.decide(T0 + timedelta(seconds=300)), StartScan)


def test_due_again_during_a_scan_coalesces_into_one_check() -> None:
    s = make(spec(policy=Interval(60), page_size=1))
    finish_request_pass(s, "a", [])
    d = s.decide(T0)
    assert isinstance(d, StartScan)
    s.on_scan_started("a", 1, 10, T0)
    t = T0 + timedelta(minutes=10)  # ten intervals pass during the scan
    d = s.decide(t)
    assert isinstance(d, FetchScanPage)
    s.on_scan_page("a", 1, [], exhausted=True)
    assert s.decide(t) == EndScan("a", 1)
    s.on_scan_ended("a", 1)
    d = s.decide(t)
    assert d == StartScan("a", t)  # one catch-up check, not ten
    s.on_scan_started("a", 2, 10, t)
    assert isinstance(s.decide(t), FetchScanPage)


def test_cron_missed_fires_coalesce_into_latest_fire() -> None:
    s = make(spec(policy=Cron("*/5 * * * *", "UTC")))
    finish_request_pass(s, "a", [])
    run_scan(s, "a", T0, 1, [])
    later = T0 + timedelta(minutes=23)
    d = s.decide(later)
    assert d == StartScan("a", T0 + timedelta(minutes=20))


def test_disabled_never_scans_but_ends_restored_scan_without_admitting() -> None:
    s = Scheduler([spec(policy=Disabled())], rng=random.Random(0))
    s.restore("a", BindingState(T0, 4, True, 99))
    d = s.decide(T0)
    assert d == EndScan("a", 4)  # ended before any page or admission
    s.on_scan_ended("a", 4)
    finish_request_pass(s, "a", rows("x"))  # accepted requests still recover
    assert dispatch(s).reason == "request"
    assert s.decide(T0 + timedelta(days=30)) is None
    assert s.next_wakeup(T0 + timedelta(days=30)) is None


# --- §4 scan pagination --------------------------------------------------------------------------


def test_scan_pages_in_order_skips_busy_and_marked_rows_and_ends_when_exhausted() -> None:
    s = make(spec(policy=Interval(60), max_workers=2, page_size=3))
    finish_request_pass(s, "a", rows("busy"))
    dispatch(s)  # busy is running; the second Worker is free, so the check may start
    d = s.decide(T0)
    assert isinstance(d, StartScan)
    s.on_scan_started("a", 7, 9, T0)
    assert s.decide(T0) == FetchScanPage("a", 7, 0, 9, 3)
    s.on_scan_page(
        "a", 7, [ScanRow("busy", 1, 0), ScanRow("done", 2, 7), ScanRow("new", 3, 6)], False
    )
    assert s.decide(T0) == Admit("a", "new", 7)  # busy and already-marked rows skipped
    s.on_admitted("a", "new", True)
    assert s.key_state("a", "new") is KeyState.READY
    assert dispatch(s).scope_id == "new"
    assert s.decide(T0) == FetchScanPage("a", 7, 3, 9, 3)  # after the last row handled
    s.on_scan_page("a", 7, [ScanRow("old", 5, 0)], True)
    assert s.decide(T0) == Admit("a", "old", 7)
    s.on_admitted("a", "old", False)  # the store says: already admitted, nothing pending
    assert s.key_state("a", "old") is None
    assert s.decide(T0) == EndScan("a", 7)  # scan completion does not await any Worker
    s.on_scan_ended("a", 7)
    assert s.snapshot()["a"].scan_active is False


def test_at_most_one_page_in_memory_even_if_the_shell_returns_more() -> None:
    s = make(spec(policy=Interval(60), page_size=2))
    finish_request_pass(s, "a", [])
    assert isinstance(s.decide(T0), StartScan)
    s.on_scan_started("a", 1, 9, T0)
    assert isinstance(s.decide(T0), FetchScanPage)
    s.on_scan_page("a", 1, [ScanRow(f"k{i}", i, 0) for i in range(1, 6)], exhausted=True)
    s.verify()  # holds only two rows
    for scope in ("k1", "k2"):
        assert s.decide(T0) == Admit("a", scope, 1)
        s.on_admitted("a", scope, False)
    assert s.decide(T0) == FetchScanPage("a", 1, 2, 9, 2)  # the rest is fetched again


def test_empty_binding_scan_ends_immediately() -> None:
    s = make(spec(policy=Interval(60)))
    finish_request_pass(s, "a", [])
    assert isinstance(s.decide(T0), StartScan)
    s.on_scan_started("a", 1, None, T0)
    assert s.decide(T0) == EndScan("a", 1)


def test_scan_pauses_when_ready_fills_and_resumes_without_losing_or_readmitting_rows() -> None:
    s = make(spec(policy=Interval(60), max_workers=1, ready_limit=1, page_size=3))
    finish_request_pass(s, "a", [])
    assert isinstance(s.decide(T0), StartScan)
    s.on_scan_started("a", 1, 9, T0)
    assert isinstance(s.decide(T0), FetchScanPage)
    s.on_scan_page("a", 1, [ScanRow(f"k{i}", i, 0) for i in (1, 2, 3)], False)
    admitted = []
    t = T0
    for _ in range(40):
        d = s.decide(t)
        if d is None:
            running = [k for k, v in s.keys("a").items() if v is KeyState.RUNNING]
            assert running, "paused with nothing running"
            s.on_worker_exit("a", running[0], Outcome.SUCCESS, False, t)
            continue
        if isinstance(d, Admit):
            admitted.append(d.scope_id)
            assert s.snapshot()["a"].scan_active
            s.on_admitted("a", d.scope_id, True)
        elif isinstance(d, Dispatch):
            s.on_dispatched("a", d.scope_id, True)
        elif isinstance(d, FetchScanPage):
            assert d.after_sequence == 3
            s.on_scan_page("a", 1, [ScanRow("k4", 4, 0)], True)
        elif isinstance(d, EndScan):
            s.on_scan_ended("a", 1)
            break
    assert admitted == ["k1", "k2", "k3", "k4"]


def test_restore_resumes_the_same_scan_generation_from_the_first_page() -> None:
    s = Scheduler([spec(policy=Interval(60), page_size=2)], rng=random.Random(0))
    s.restore("a", BindingState(T0, 3, True, 50))
    finish_request_pass(s, "a", rows("recovered"))  # admitted before the crash, never queued
    d = s.decide(T0)
    assert isinstance(d, Dispatch)
    s.on_dispatched("a", d.scope_id, True)
    assert s.decide(T0) == FetchScanPage("a", 3, 0, 50, 2)  # same generation, from the start
    s.on_scan_page("a", 3, [ScanRow("recovered", 1, 3), ScanRow("next", 2, 2)], False)
    assert s.decide(T0) == Admit("a", "next", 3)  # the marked row is not admitted twice


# --- §5 / §8 request discovery -------------------------------------------------------------------


def test_request_discovery_is_paged_and_resumable_under_capacity() -> None:
    s = make(spec(max_workers=1, ready_limit=1, page_size=2))
    d = s.decide(T0)
    assert d == FetchRequests("a", 0, 1)  # never more rows than the ready queue has room for
    s.on_request_page("a", rows("a1", "a2"), exhausted=False)  # a row beyond the room...
    assert s.key_state("a", "a1") is KeyState.READY and s.key_state("a", "a2") is None
    dispatch(s)
    assert s.decide(T0) == FetchRequests("a", 1, 2)  # ...is not lost: resumes after a1
    s.on_request_page("a", rows("a2", "a3", start=2), exhausted=False)
    assert s.decide(T0) is None  # ready full (a2), budget used (a1)
    s.on_worker_exit("a", "a1", Outcome.SUCCESS, False, T0)
    dispatch(s)
    assert s.decide(T0) == FetchRequests("a", 2, 2)


def test_a_paused_request_pass_asks_for_the_free_places_plus_the_keys_to_skip() -> None:
    s = make(spec(max_workers=1, ready_limit=8))
    assert s.decide(T0) == FetchRequests("a", 0, 8)
    s.on_request_page("a", rows(*(f"k{i}" for i in range(1, 9))), exhausted=False)
    assert dispatch(s).scope_id == "k1"
    # one free place; k1..k8 are held in memory and could reappear: 1 + 8 rows, not a page of 100
    assert s.decide(T0) == FetchRequests("a", 8, 9)
    s.on_request_page("a", rows("k9", start=9), exhausted=False)
    assert s.decide(T0) is None  # budget used, ready full again


def test_keys_in_retry_wait_are_skipped_within_one_page_not_one_query_each() -> None:
    s = make(spec(max_workers=1, ready_limit=2), backoff=Backoff(jitter=0))
    failing = [f"f{i}" for i in range(1, 6)]
    for scope in failing:  # five keys fail and wait in backoff, their requests still pending
        s.on_notify("a")
        finish_request_pass(s, "a", rows(scope, start=int(scope[1:])))
        dispatch(s)
        s.on_worker_exit("a", scope, Outcome.FAILURE, False, T0)
    assert all(s.key_state("a", k) is KeyState.RETRY_WAIT for k in failing)
    s.on_notify("a")
    d = s.decide(T0)
    assert d == FetchRequests("a", 0, 7, skip_backoff=True)  # 2 free places + 5 keys held
    # the page holds the five waiting keys first, then two new ones: one query fills the queue
    s.on_request_page("a", rows(*failing, "n6", "n7"), exhausted=False)
    assert s.key_state("a", "n6") is KeyState.READY and s.key_state("a", "n7") is KeyState.READY


def test_notifications_during_a_pass_coalesce_into_exactly_one_extra_pass() -> None:
    s = make(spec(page_size=1))
    finish_request_pass(s, "a", [])
    assert s.decide(T0) is None
    s.on_notify("a")
    d = s.decide(T0)
    assert d == FetchRequests("a", 0, 1, skip_backoff=True)  # this term holds its failing keys
    s.on_notify("a")
    s.on_notify("a")  # two notifications while the pass is in flight
    s.on_request_page("a", [], exhausted=True)
    # one extra pass, from the beginning
    assert s.decide(T0) == FetchRequests("a", 0, 1, skip_backoff=True)
    s.on_request_page("a", [], exhausted=True)
    assert s.decide(T0) is None  # ...and only one
    assert s.next_wakeup(T0) is None


def test_restore_always_schedules_a_full_request_pass() -> None:
    s = Scheduler([spec()], rng=random.Random(0))
    assert s.decide(T0) is None  # nothing before a term is established
    s.restore("a", BindingState(T0, 2, False, None))
    assert s.decide(T0) == FetchRequests("a", 0, 32)  # from the start, as much as fits


def test_dispatch_not_started_frees_the_key() -> None:
    s = make(spec())
    finish_request_pass(s, "a", rows("x"))
    dispatch(s, started=False)
    assert s.key_state("a", "x") is None and s.snapshot()["a"].running == 0


# --- §7 failure and backoff ----------------------------------------------------------------------


def test_backoff_doubles_from_30s_to_a_1800s_cap_with_jitter_and_no_retry_limit() -> None:
    rng = random.Random(5)
    b = Backoff()
    expected = [30, 60, 120, 240, 480, 960, 1800, 1800, 1800]
    for n, base in enumerate(expected, start=1):
        d = b.delay(n, rng)
        assert base * 0.9 <= d <= base * 1.1
    assert 1620 <= b.delay(10_000, rng) <= 1980
    with pytest.raises(ConfigError):
        Backoff(jitter=1.5)


def test_startup_and_establish_retries_stay_capped_through_a_long_outage() -> None:
    """A database down for hours at startup fails the retry thousands of times: the delay stays
    at its cap (``0.2 * 2**1100`` would overflow a float and end the host)."""
    from apsup.supervisor.host import STARTUP_BACKOFF
    from apsup.supervisor.supervisor import ESTABLISH_BACKOFF

    for backoff in (STARTUP_BACKOFF, ESTABLISH_BACKOFF):
        assert [backoff.delay(n) for n in (1, 2, 3)] == [0.2, 0.4, 0.8]
        assert backoff.delay(5_000) == 5.0


def test_failure_and_timeout_enter_retry_wait_with_exponential_backoff() -> None:
    s = make(spec(), backoff=Backoff(jitter=0))
    finish_request_pass(s, "a", rows("x"))
    t = T0
    for n, outcome in enumerate([Outcome.FAILURE, Outcome.TIMEOUT, Outcome.FAILURE], start=1):
        d = dispatch(s, t)
        assert d.reason == ("request" if n == 1 else "retry")
        s.on_worker_exit("a", "x", outcome, False, t)
        assert s.key_state("a", "x") is KeyState.RETRY_WAIT
        assert s.snapshot()["a"].max_consecutive_failures == n
        wait = timedelta(seconds=30 * 2 ** (n - 1))
        assert s.next_wakeup(t) == t + wait
        assert s.decide(t + wait - timedelta(seconds=1)) is None
        t += wait


def test_success_resets_failures_so_the_next_failure_waits_30s_again() -> None:
    s = make(spec(), backoff=Backoff(jitter=0))
    finish_request_pass(s, "a", rows("x"))
    dispatch(s)
    s.on_worker_exit("a", "x", Outcome.FAILURE, False, T0)
    t = T0 + timedelta(seconds=30)
    dispatch(s, t)
    s.on_worker_exit("a", "x", Outcome.FAILURE, False, t)
    assert s.snapshot()["a"].next_retry_at == t + timedelta(seconds=60)
    t += timedelta(seconds=60)
    dispatch(s, t)
    s.on_worker_exit("a", "x", Outcome.SUCCESS, True, t)  # successor, count cleared
    dispatch(s, t)
    s.on_worker_exit("a", "x", Outcome.FAILURE, False, t)
    assert s.snapshot()["a"].next_retry_at == t + timedelta(seconds=30)


def test_new_requests_never_reset_backoff() -> None:
    s = make(spec(), backoff=Backoff(jitter=0))
    finish_request_pass(s, "a", rows("x"))
    dispatch(s)
    s.on_worker_exit("a", "x", Outcome.FAILURE, True, T0)
    due = s.snapshot()["a"].next_retry_at
    s.on_notify("a")
    finish_request_pass(s, "a", rows("x"))
    assert s.key_state("a", "x") is KeyState.RETRY_WAIT
    assert s.snapshot()["a"].next_retry_at == due
    assert s.decide(T0 + timedelta(seconds=29)) is None


def test_key_info_reports_retry_count_and_deadline_for_failure_logs() -> None:
    s = make(spec(), backoff=Backoff(jitter=0))
    finish_request_pass(s, "a", rows("x"))
    dispatch(s)
    s.on_worker_exit("a", "x", Outcome.TIMEOUT, False, T0)
    info = s.key_info("a", "x")
    assert info is not None
    assert (info.state, info.reason, info.consecutive_failures) == (KeyState.RETRY_WAIT, "retry", 1)
    assert info.retry_at == T0 + timedelta(seconds=30)
    assert s.key_info("a", "nobody") is None


def test_conflict_uses_fixed_delay_without_counting_a_failure() -> None:
    s = make(spec(), backoff=Backoff(jitter=0), conflict_delay=5.0)
    finish_request_pass(s, "a", rows("x"))
    dispatch(s)
    s.on_worker_exit("a", "x", Outcome.CONFLICT, False, T0)
    snap = s.snapshot()["a"]
    assert snap.next_retry_at == T0 + timedelta(seconds=5)
    assert snap.max_consecutive_failures == 0
    assert dispatch(s, T0 + timedelta(seconds=5)).reason == "conflict"


def test_stale_term_exit_drops_all_in_memory_state() -> None:
    s = make(spec("a"), spec("b"))
    finish_request_pass(s, "a", rows("x", "y"))
    finish_request_pass(s, "b", rows("z"))
    d = dispatch(s)
    s.on_worker_exit(d.family, d.scope_id, Outcome.STALE_TERM, False, T0)
    assert s.decide(T0) is None
    assert all(not snap.active and snap.ready == 0 for snap in s.snapshot().values())


def test_lease_lost_drops_everything_until_restore() -> None:
    s = make(spec(policy=Interval(60)))
    finish_request_pass(s, "a", rows("x"))
    dispatch(s)
    s.on_lease_lost()
    assert s.decide(T0) is None and s.next_wakeup(T0) is None
    s.on_worker_exit("a", "x", Outcome.SUCCESS, False, T0)  # old term's exit: ignored
    s.restore("a", BindingState(T0, 1, False, None))
    assert s.decide(T0) == FetchRequests("a", 0, 32)  # the ready bound, max(32, 4 x budget)


def test_restore_refuses_while_workers_are_counted_running() -> None:
    s = make(spec())
    finish_request_pass(s, "a", rows("x"))
    dispatch(s)
    with pytest.raises(RuntimeError):
        s.restore("a", EMPTY)


# --- §1 / §8 per-family degradation --------------------------------------------------------------


def test_family_error_postpones_only_that_family_and_retries_the_step() -> None:
    s = make(spec("a", policy=Interval(60)), spec("b"), error_delay=30.0)
    finish_request_pass(s, "a", [])
    d = s.decide(T0)
    assert isinstance(d, FetchRequests) and d.family == "b"
    s.on_request_page("b", rows("x", "y"), exhausted=True)
    d = s.decide(T0)
    assert isinstance(d, StartScan) and d.family == "a"
    s.on_family_error("a", "start_scan", T0)
    assert s.snapshot()["a"].degraded
    assert [d.family for d in drain(s)] == ["b", "b"]  # b keeps dispatching
    assert s.next_wakeup(T0) == T0 + timedelta(seconds=30)
    t = T0 + timedelta(seconds=30)
    d = s.decide(t)
    assert isinstance(d, StartScan)  # the abandoned step, retried; checkpoint never advanced
    assert s.snapshot()["a"].degraded  # until a step succeeds
    s.on_scan_started("a", 1, None, t)
    assert not s.snapshot()["a"].degraded


def test_postponement_wakes_only_a_family_with_something_to_resume() -> None:
    s = make(spec("a"), error_delay=30.0)
    finish_request_pass(s, "a", [])
    s.on_family_error("a", "reconcile", T0)  # nothing in flight, nothing pending
    assert s.next_wakeup(T0) is None
    s.on_notify("a")  # now a pass waits for the postponement to end
    assert s.decide(T0) is None
    assert s.next_wakeup(T0) == T0 + timedelta(seconds=30)


def test_family_error_during_dispatch_puts_the_key_back_at_the_head() -> None:
    s = make(spec(max_workers=2))
    finish_request_pass(s, "a", rows("x", "y"))
    d = s.decide(T0)
    assert isinstance(d, Dispatch) and d.scope_id == "x"
    s.on_family_error("a", "dispatch", T0)
    assert s.snapshot()["a"].running == 0 and s.key_state("a", "x") is KeyState.READY
    assert s.decide(T0) is None
    assert dispatch(s, T0 + timedelta(seconds=30)).scope_id == "x"


# --- next_wakeup: no idle polling ----------------------------------------------------------------


def test_next_wakeup_is_none_when_nothing_is_time_based() -> None:
    s = make(spec("a"), spec("b"))
    finish_request_pass(s, "a", [])
    finish_request_pass(s, "b", [])
    assert s.decide(T0) is None and s.next_wakeup(T0) is None


def test_next_wakeup_is_the_earliest_deadline() -> None:
    s = make(spec("a", policy=Interval(600)), spec("b"), backoff=Backoff(jitter=0))
    finish_request_pass(s, "a", [])
    finish_request_pass(s, "b", [])
    run_scan(s, "a", T0, 1, [])
    s.on_notify("b")
    finish_request_pass(s, "b", rows("x"))
    dispatch(s)
    s.on_worker_exit("b", "x", Outcome.FAILURE, False, T0)
    assert s.next_wakeup(T0) == T0 + timedelta(seconds=30)
    t = T0 + timedelta(seconds=30)
    dispatch(s, t)
    assert s.next_wakeup(t) == T0 + timedelta(seconds=600)


def test_scheduler_rejects_bad_specs() -> None:
    with pytest.raises(ConfigError):
        Scheduler([spec("a"), spec("a")], rng=random.Random(0))
    with pytest.raises(ConfigError):
        Scheduler([spec("a", max_workers=0)], rng=random.Random(0))
    assert spec("a", max_workers=16).queue_limit == 64
    assert spec("a", max_workers=1).queue_limit == 32


# --- a due check waits for a free Worker (RFC §2/§4) ---------------------------------------------


def test_a_due_scan_does_not_start_while_every_worker_is_busy() -> None:
    s = make(spec("a", policy=Interval(1), max_workers=1))
    finish_request_pass(s, "a", rows("busy"))
    dispatch(s)  # 1 of 1 Workers busy from now on; the first check is due at once
    for second in range(11):
        now = T0 + timedelta(seconds=second)
        assert s.decide(now) is None, f"a step was taken at +{second}s with every Worker busy"
        # Nothing for time alone to do: sleeping until the Worker exits is not a busy loop.
        assert s.next_wakeup(now) is None
    assert s.snapshot()["a"].scan_generation == 0
    later = T0 + timedelta(seconds=11)
    s.on_worker_exit("a", "busy", Outcome.SUCCESS, False, later)
    d = s.decide(later)  # the exit frees the Worker: the skipped check starts at once
    assert isinstance(d, StartScan) and d.checkpoint == later


def test_a_transient_error_costs_its_step_about_one_poll_and_repeats_back_off_bounded() -> None:
    s = make(spec(max_workers=2), error_delay=0.5, error_delay_max=4.0)
    finish_request_pass(s, "a", rows("x", "y"))
    t = T0
    waits = []
    for _ in range(6):  # the same dispatch fails again and again
        d = s.decide(t)
        assert isinstance(d, Dispatch) and d.scope_id == "x"
        s.on_family_error("a", "Dispatch", t)
        assert s.snapshot()["a"].degraded and s.snapshot()["a"].running == 0
        wake = s.next_wakeup(t)
        assert wake is not None
        waits.append((wake - t).total_seconds())
        assert s.decide(t) is None  # postponed: nothing until the wake-up
        t = wake
    assert waits == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    d = s.decide(t)
    assert isinstance(d, Dispatch) and d.scope_id == "x"
    s.on_dispatched("a", "x", True, token=d.token)  # a step went through: the streak ends
    assert not s.snapshot()["a"].degraded
    d = s.decide(t)
    assert isinstance(d, Dispatch) and d.scope_id == "y"
    s.on_family_error("a", "Dispatch", t)
    assert s.next_wakeup(t) == t + timedelta(seconds=0.5)


def test_only_a_pass_that_may_meet_keys_it_does_not_hold_reads_scopes_in_backoff() -> None:
    """Request pages leave out Scopes in a backoff this term recorded (the core holds them,
    waiting), except the passes that may meet a key the core does not hold: after restore,
    a key let go while parked, an operator's retry of a free key, a stale failure state."""
    s = make(spec(page_size=4))
    d = s.decide(T0)
    assert d == FetchRequests("a", 0, 4, skip_backoff=False)  # after restore: everything
    s.on_request_page("a", [], exhausted=True)
    s.on_notify("a")
    assert s.decide(T0) == FetchRequests("a", 0, 4, skip_backoff=True)
    s.on_notify("a", full=True)  # during a filtered pass: the one extra pass is full
    s.on_request_page("a", [], exhausted=True)
    assert s.decide(T0) == FetchRequests("a", 0, 4, skip_backoff=False)
    s.on_request_page("a", [], exhausted=True)
    assert s.decide(T0) is None
    s.set_parked("a", ["p"])
    s.set_parked("a", [])  # let go of while parked
    assert s.decide(T0) == FetchRequests("a", 0, 4, skip_backoff=False)
    s.on_request_page("a", [], exhausted=True)
    assert not s.retry_now("a", "free", T0)  # not held: looked for by a full pass
    assert s.decide(T0) == FetchRequests("a", 0, 4, skip_backoff=False)


def test_a_parked_key_is_not_counted_as_waiting_to_retry() -> None:
    """A parked Scope waits for the operator: the snapshot neither counts it as waiting to
    retry nor shows a next attempt for it (the console and ``apsup status`` show it parked)."""
    s = make(spec(max_workers=2), backoff=Backoff(jitter=0))
    finish_request_pass(s, "a", rows("f", "g"))
    dispatch(s)
    dispatch(s)
    s.on_worker_exit("a", "f", Outcome.FAILURE, False, T0)
    s.on_worker_exit("a", "g", Outcome.FAILURE, False, T0 + timedelta(seconds=5))
    s.set_parked("a", ["f"])
    snap = s.snapshot(T0)["a"]
    assert (snap.retry_wait, snap.next_retry_at) == (1, T0 + timedelta(seconds=35))
    s.set_parked("a", ["f", "g"])
    snap = s.snapshot(T0)["a"]
    assert (snap.retry_wait, snap.next_retry_at) == (0, None)
