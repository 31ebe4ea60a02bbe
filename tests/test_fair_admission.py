"""Fair admission: no stream of explicit requests or due retries starves automatic scans.

The stated bound (docs/guarantees.md): once a family's automatic check is due and cannot start
for want of a free Worker, request discovery, due retries and successors stop filling its ready
queue; the queue drains through ordinary dispatches, and the check starts at the first Worker
exit after that, so within ``ready_limit + max_workers`` of the family's dispatches. Within a
scan, request pages and scan pages take turns, so every dirty Scope that is not busy is admitted
by the first scan that reaches it.

The load shape that used to starve scans for ever: budget 2, the default ready bound (32), a
steady stream of explicit requests (one new request per completion, over 3,000 Scopes), a 60 s
interval, and ten Scopes that only have dirty state. Driven here against a seeded in-memory
model of the store (the pure core only; the host runs the same decisions).
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass
from datetime import datetime, timedelta

import pytest

from apsup.policy import Interval
from apsup.scheduling import (
    Admit,
    BindingState,
    Dispatch,
    EndScan,
    FamilySpec,
    FetchRequests,
    FetchScanPage,
    Outcome,
    RequestRow,
    ScanRow,
    Scheduler,
    StartScan,
)

T0 = datetime(2026, 1, 1, 12, 0, 0)


@dataclass
class Row:
    seq: int
    dirty: int = 0
    clean: int = 0
    requested: int = 0
    handled: int = 0
    last_auto: int = 0


class World:
    """The store and the Workers of one family, and the request stream."""

    def __init__(self, seed: int, scopes: int, dirty_only: int, budget: int, interval: float):
        self.rng = random.Random(seed)
        self.spec = FamilySpec("f", Interval(interval), budget)
        self.core = Scheduler([self.spec], rng=random.Random(seed))
        self.interval = timedelta(seconds=interval)
        self.rows: dict[str, Row] = {}
        self.now = T0
        self.scan_generation = 0
        self.checkpoint: datetime | None = None
        self.exits: list[tuple[datetime, int, str, int, int]] = []  # (at, n, scope, G, token)
        self.n = 0
        self.starts = 0
        self.dispatches_since_due = 0
        self.worst_wait = 0
        self.request_scopes = [f"req-{i}" for i in range(scopes)]
        self.next_request = 0
        self.dirty_only = [f"dirty-{i}" for i in range(dirty_only)]
        for scope in self.dirty_only:
            self._row(scope).dirty += 1
        for _ in range(3 * budget):
            self.request()
        self.core.restore("f", BindingState(None, 0, False, None))

    def _row(self, scope: str) -> Row:
        if scope not in self.rows:
            self.rows[scope] = Row(seq=len(self.rows) + 1)
        return self.rows[scope]

    def request(self) -> None:
        scope = self.request_scopes[self.next_request % len(self.request_scopes)]
        self.next_request += 1
        self._row(scope).requested += 1
        self.core.on_notify("f")

    def scan_due(self) -> bool:
        return self.checkpoint is None or self.now >= self.checkpoint + self.interval

    def execute(self, d: object) -> None:
        c = self.core
        if isinstance(d, FetchRequests):
            page = sorted(
                (r.seq, s)
                for s, r in self.rows.items()
                if r.requested > r.handled and r.seq > d.after_sequence
            )[: d.limit]
            c.on_request_page("f", [RequestRow(s, q) for q, s in page], len(page) < d.limit)
        elif isinstance(d, StartScan):
            self.scan_generation += 1
            self.checkpoint = d.checkpoint
            self.starts += 1
            self.worst_wait = max(self.worst_wait, self.dispatches_since_due)
            self.dispatches_since_due = 0
            upper = max((r.seq for r in self.rows.values()), default=None)
            c.on_scan_started("f", self.scan_generation, upper, d.checkpoint)
        elif isinstance(d, FetchScanPage):
            page = sorted(
                (r.seq, s, r.last_auto)
                for s, r in self.rows.items()
                if r.dirty > r.clean and d.after_sequence < r.seq <= d.upper_sequence
            )[: d.limit]
            c.on_scan_page(
                "f", d.scan_generation, [ScanRow(s, q, a) for q, s, a in page], len(page) < d.limit
            )
        elif isinstance(d, Admit):
            r = self.rows[d.scope_id]
            if r.last_auto < d.scan_generation:
                r.last_auto = d.scan_generation
                if r.requested <= r.handled:
                    r.requested += 1
            c.on_admitted("f", d.scope_id, True)
        elif isinstance(d, EndScan):
            c.on_scan_ended("f", d.scan_generation)
        elif isinstance(d, Dispatch):
            r = self.rows[d.scope_id]
            if self.scan_due() and self.core.snapshot()["f"].scan_active is False:
                self.dispatches_since_due += 1
            if r.handled >= r.requested:
                c.on_dispatched("f", d.scope_id, False, token=d.token)
                return
            c.on_dispatched("f", d.scope_id, True, token=d.token)
            self.n += 1
            took = timedelta(seconds=self.rng.uniform(0.5, 1.5))
            heapq.heappush(self.exits, (self.now + took, self.n, d.scope_id, r.requested, d.token))

    def run(self, minutes: float) -> None:
        end = T0 + timedelta(minutes=minutes)
        while self.now < end:
            while (d := self.core.decide(self.now)) is not None:
                self.execute(d)
                self.core.verify()
            wake = self.core.next_wakeup(self.now)
            exit_at = self.exits[0][0] if self.exits else None
            moments = [m for m in (wake, exit_at) if m is not None]
            assert moments, "the family stalled: no Worker runs and nothing is due"
            self.now = max(self.now, min(moments))
            while self.exits and self.exits[0][0] <= self.now:
                _, _, scope, g, token = heapq.heappop(self.exits)
                r = self.rows[scope]
                r.handled = max(r.handled, g)
                r.clean = r.dirty  # the processor finds no work left
                more = r.requested > r.handled
                self.core.on_worker_exit("f", scope, Outcome.SUCCESS, more, self.now, token=token)
                self.request()  # the steady stream: a new request per completion


@pytest.mark.parametrize("seed", range(5))
def test_a_steady_request_stream_does_not_starve_automatic_scans(seed: int) -> None:
    w = World(seed, scopes=3000, dirty_only=10, budget=2, interval=60.0)
    w.run(minutes=30)
    assert w.starts >= 25, f"only {w.starts} automatic checks in 30 minutes of a 60 s interval"
    for scope in w.dirty_only:
        r = w.rows[scope]
        assert r.clean == r.dirty and r.handled >= 1, f"{scope} was never admitted"
    bound = w.spec.queue_limit + w.spec.max_workers
    assert w.worst_wait <= bound, f"a due check waited {w.worst_wait} dispatches (> {bound})"


@pytest.mark.parametrize("seed", range(3))
def test_without_requests_the_checks_run_on_time(seed: int) -> None:
    w = World(seed, scopes=1, dirty_only=10, budget=2, interval=60.0)
    w.request_scopes = []  # no stream
    w.request = lambda: None  # type: ignore[method-assign]
    w.run(minutes=30)
    assert w.starts >= 29
    assert all(w.rows[s].handled >= 1 for s in w.dirty_only)
