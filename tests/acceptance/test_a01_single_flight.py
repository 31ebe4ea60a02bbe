"""RFC acceptance 1: no concurrent execution for the same binding key; independent Scopes and
types run concurrently within their own budgets.

A producer keeps marking Scopes dirty and sending explicit requests while Workers run (each
invocation takes a little while), so every key is repeatedly re-requested while it is queued or
running. The processors record each invocation's [start, end] with its pid; the test asserts on
those intervals.
"""

from __future__ import annotations

import itertools
import random
import threading
import time
from collections import defaultdict

import pytest

from tests.acceptance.families import configure
from tests.acceptance.harness import all_intents, events, mark_dirty, max_overlap, request

pytestmark = [pytest.mark.timeout(180), pytest.mark.backends("sqlite", "mysql", "postgresql")]

BUDGET_A, BUDGET_B = 3, 2
SCOPES_A = [f"ok.a{i}" for i in range(6)]
SCOPES_B = [f"ok.b{i}" for i in range(4)]


def test_single_flight_per_key_and_concurrency_within_budgets(hosts, store):
    fam_a = configure("acc-a", interval=0.5, max_workers=BUDGET_A)
    fam_b = configure("acc-b", interval=0.5, max_workers=BUDGET_B)
    host = hosts.live_host([fam_a, fam_b], worker_settings={"ACC_SLEEP": "0.3"})
    for scope in SCOPES_A:
        mark_dirty(store, fam_a, scope)
    for scope in SCOPES_B:
        mark_dirty(store, fam_b, scope)

    stop = threading.Event()
    produced = {"n": 0}

    def produce() -> None:
        rng = random.Random(1)
        end = time.monotonic() + 4.0
        while time.monotonic() < end and not stop.is_set():
            fam, scopes = rng.choice([(fam_a, SCOPES_A), (fam_b, SCOPES_B)])
            scope = rng.choice(scopes)
            if rng.random() < 0.5:
                request(store, fam, scope)
            else:
                mark_dirty(store, fam, scope)
            produced["n"] += 1
            time.sleep(0.03)

    producer = threading.Thread(target=produce, daemon=True)
    producer.start()
    try:

        def quiescent() -> bool:
            if producer.is_alive():
                return False
            rows = [*all_intents(store, fam_a).values(), *all_intents(store, fam_b).values()]
            return all(not r.pending_request and not r.dirty for r in rows) and all(
                e["ended_us"] is not None for e in events(store)
            )

        host.run_until(quiescent, "every request handled and every Scope clean")
    finally:
        stop.set()
        producer.join(10)
    assert produced["n"] > 10
    for fam in (fam_a, fam_b):  # every Scope ran, most of them more than once
        done = [e for e in events(store, fam) if e["outcome"] == "ok"]
        assert len(done) > len({e["scope_id"] for e in done}) == len(all_intents(store, fam))

    rows = events(store)
    assert rows, "no invocation ran"
    assert {r["outcome"] for r in rows} == {"ok"}, rows
    assert len({r["term"] for r in rows}) == 1  # one host, one term

    by_key: dict[tuple[str, str], list[tuple[int, int, int]]] = defaultdict(list)
    for r in rows:
        by_key[(r["family"], r["scope_id"])].append((r["started_us"], r["ended_us"], r["pid"]))
    for key, spans in by_key.items():
        spans.sort()
        for (_, e1, pid1), (s2, _, pid2) in itertools.pairwise(spans):
            assert s2 >= e1, f"{key}: Worker {pid2} started before Worker {pid1} finished"
        assert max_overlap([(s, e) for s, e, _ in spans]) == 1

    for fam, budget in ((fam_a, BUDGET_A), (fam_b, BUDGET_B)):
        spans = [(r["started_us"], r["ended_us"]) for r in rows if r["family"] == fam.name]
        peak = max_overlap(spans)
        assert peak <= budget, f"{fam.name}: {peak} Workers at once > budget {budget}"
        assert peak > 1, f"{fam.name}: different Scopes never ran concurrently"

    # The two types ran at the same time (each within its own budget).
    a_spans = [(r["started_us"], r["ended_us"]) for r in rows if r["family"] == fam_a.name]
    b_spans = [(r["started_us"], r["ended_us"]) for r in rows if r["family"] == fam_b.name]
    assert any(sa < eb and sb < ea for sa, ea in a_spans for sb, eb in b_spans)
