"""Deterministic simulation of the real ``Scheduler`` under a simulated clock, store and Workers.

One seed fixes everything: the families and their policies/budgets, the producers (mark_dirty /
request, with delivered or lost notifications), the Workers' behaviour (succeed fully or partly,
fail, hang past the timeout, exit 0 without acknowledging, commit progress then crash, ack then
crash, CONFLICT), per-family query errors (some after their commit went through), host crashes
with restart and (MySQL-like seeds) lease loss with bounded polling. A fault phase of ``steps``
steps is followed by a quiet phase in which faults and producers stop and every Worker succeeds;
the quiet phase must converge.

The shell here mirrors the real one: it executes one decision at a time, reports the result
before asking for the next, reports a Worker's exit only after it is confirmed and only for the
current term, and computes ``more_requested`` from the store at exit.

Invariants are checked after every step; a violation raises ``SimulationFailure`` carrying the
seed and the tail of the trace.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

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
    Scheduler,
    StartScan,
)
from apsup.supervisor.supervisor import BACKOFF_TERM_MARGIN

from .model import CursorConflict, ModelStore, StaleTerm

START = datetime(2026, 3, 29, 0, 30)  # a DST change day in Europe for the cron families
REPLAY = "APSUP_SIM_SEED={seed} .venv/bin/pytest tests/simulation -k replay"
MAX_DECISIONS_PER_DRAIN = 5_000
QUIET_STEPS = 4_000
QUIET_HORIZON = timedelta(hours=12)


class SimulationFailure(AssertionError):
    def __init__(self, seed: int, message: str, trace: list[str]) -> None:
        tail = "\n  ".join(trace[-60:])
        super().__init__(
            f"seed {seed}: {message}\n  replay: {REPLAY.format(seed=seed)}\n  last steps:\n  {tail}"
        )
        self.seed = seed
        self.reason = message


@dataclass
class Config:
    """What one seed draws; ``describe`` goes into the trace."""

    specs: list[FamilySpec]
    timeouts: dict[str, float]
    backend: str  # "sqlite" (notifications lost only with a crash) or "mysql" (lease, polling)
    scopes: int
    produce_mean: float
    crash_mean: float | None
    lease_mean: float | None
    error_rate: float
    lost_notify: float
    poll: float | None
    latency: float  # upper bound of one decision's execution time (seconds)

    @classmethod
    def draw(cls, rng: random.Random) -> Config:
        specs: list[FamilySpec] = []
        timeouts: dict[str, float] = {}
        for i in range(rng.randint(1, 3)):
            policies: list[Policy] = [
                Interval(rng.choice([60, 120, 300, 600])),
                Interval(rng.choice([45, 90])),
                Cron("*/5 * * * *", rng.choice(["UTC", "Europe/Berlin", "Asia/Shanghai"])),
                Disabled(),
            ]
            policy = rng.choice(policies)
            name = f"f{i}"
            specs.append(
                FamilySpec(
                    name,
                    policy,
                    max_workers=rng.randint(1, 3),
                    ready_limit=rng.randint(1, 4),
                    page_size=rng.randint(1, 4),
                )
            )
            timeouts[name] = rng.choice([60.0, 120.0, 300.0])
        backend = rng.choice(["sqlite", "mysql"])
        return cls(
            specs=specs,
            timeouts=timeouts,
            backend=backend,
            scopes=rng.randint(2, 10),
            produce_mean=rng.choice([3.0, 10.0, 30.0]),
            crash_mean=rng.choice([None, 900.0, 3600.0]),
            lease_mean=rng.choice([None, 900.0, 3600.0]) if backend == "mysql" else None,
            error_rate=rng.choice([0.0, 0.02, 0.08]),
            lost_notify=rng.choice([0.0, 0.1, 0.3]),
            poll=30.0 if backend == "mysql" else None,
            latency=rng.choice([0.0, 0.2, 2.0]),
        )

    def describe(self) -> str:
        fams = ", ".join(
            f"{s.name}:{s.policy.describe()} w={s.max_workers} q={s.queue_limit} p={s.page_size}"
            for s in self.specs
        )
        return (
            f"{self.backend} [{fams}] scopes={self.scopes} produce~{self.produce_mean}s "
            f"crash~{self.crash_mean} lease~{self.lease_mean} err={self.error_rate} "
            f"lost={self.lost_notify} latency={self.latency}"
        )


@dataclass
class Worker:
    """A simulated Worker process: a plan of fenced commits, then an exit."""

    wid: int
    family: str
    scope: str
    term: int
    host: int  # host incarnation that launched it
    token: int
    claimed: int
    kind: str
    live: bool = True  # counted by the current term's shell (False once orphaned or exited)
    dead: bool = False  # the process is gone (killed or exited)


@dataclass
class KeyHistory:
    """What the sim remembers about a key to check backoff (reset when memory is lost)."""

    failures: int = 0
    last_exit: datetime | None = None
    last_outcome: Outcome | None = None


@dataclass(order=True)
class _Event:
    at: datetime
    seq: int
    kind: str = field(compare=False)
    data: Any = field(compare=False, default=None)


class Simulation:
    def __init__(
        self,
        seed: int,
        steps: int = 150,
        *,
        scheduler_factory: Callable[..., Scheduler] = Scheduler,
        trace_all: bool = False,
        verify_core: bool = True,
    ) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        self.cfg = Config.draw(self.rng)
        self.steps = steps
        self.factory = scheduler_factory
        self.trace_all = trace_all
        self.verify_core = verify_core  # off for mutants: the external checks must suffice
        self.specs = {s.name: s for s in self.cfg.specs}
        self.store = ModelStore(list(self.specs))
        self.now = START
        self.events: list[_Event] = []
        self._seq = itertools.count()
        self._wids = itertools.count(1)
        self.scheduler: Scheduler | None = None
        self.host = 0
        self.workers: dict[int, Worker] = {}
        self.live: dict[tuple[str, str], Worker] = {}
        self.history: dict[tuple[str, str], KeyHistory] = {}
        self.quiet = False
        self.pending_start: int | None = None  # the restart/reacquire that will establish a term
        self.trace: list[tuple[datetime, tuple[object, ...]]] = []
        self.log("config:", self.cfg.describe())
        # (term, family, scope, generation) admissions committed and not reported as failed
        self.admits: set[tuple[int, str, str, int]] = set()
        self.admits_unreported: set[tuple[int, str, str, int]] = set()
        self.counters: dict[str, int] = {}
        # families with a request whose notification never reached the current core
        self.unnotified: set[str] = set()
        self.prefilled: set[tuple[str, str, int]] = set()  # admissions of the earlier process
        # Exits confirmed (capacity freed) whose outcome the shell reports later, as the host
        # does after acknowledging them; own RNG, so each seed's other draws stay as they were.
        self.classify_rng = random.Random(seed ^ 0x5EED)
        self.classifying: set[int] = set()  # Worker ids

    # --- plumbing --------------------------------------------------------------------------------

    def log(self, *parts: object) -> None:
        """Record a trace line; formatted only when shown (a failure or ``trace_all``)."""
        self.trace.append((self.now, parts))
        if self.trace_all:
            print(self.format_line(self.trace[-1]))

    @staticmethod
    def format_line(entry: tuple[datetime, tuple[object, ...]]) -> str:
        moment, parts = entry
        return f"{(moment - START).total_seconds():9.1f}s " + " ".join(map(str, parts))

    def fail(self, message: str) -> SimulationFailure:
        return SimulationFailure(self.seed, message, [self.format_line(e) for e in self.trace])

    def at(self, delay: float, kind: str, data: Any = None) -> None:
        heapq.heappush(
            self.events, _Event(self.now + timedelta(seconds=delay), next(self._seq), kind, data)
        )

    def count(self, name: str) -> None:
        self.counters[name] = self.counters.get(name, 0) + 1

    # --- run -------------------------------------------------------------------------------------

    def run(self) -> Simulation:
        try:
            return self._run()
        except SimulationFailure:
            raise
        except Exception as exc:  # a model assertion or a crash of the core: report the seed
            raise self.fail(f"{type(exc).__name__}: {exc}") from exc

    def _run(self) -> Simulation:
        self.prefill()
        self.start_host()
        self.at(self.rng.expovariate(1 / self.cfg.produce_mean), "produce")
        if self.cfg.crash_mean:
            self.at(self.rng.expovariate(1 / self.cfg.crash_mean), "crash")
        if self.cfg.lease_mean:
            self.at(self.rng.expovariate(1 / self.cfg.lease_mean), "lease_lost")
        if self.cfg.poll:
            self.at(self.cfg.poll, "poll")
        for _ in range(self.steps):
            self.tick()
        self.quiet = True
        self.log("--- quiet: faults and producers stop, Workers succeed ---")
        quiet_start = self.now
        for _ in range(QUIET_STEPS):
            self.drain()  # judge convergence where the shell would go to sleep
            if self.converged():
                break
            if self.now - quiet_start > QUIET_HORIZON:
                break
            self.tick()
        if not self.converged():
            raise self.fail(f"did not converge in the quiet phase: {self.pending_summary()}")
        self.final_checks()
        return self

    def tick(self) -> None:
        self.drain()
        wake = self.scheduler.next_wakeup(self.now) if self.scheduler else None
        if wake is not None and wake <= self.now:
            raise self.fail(f"next_wakeup {wake} <= now after decide() returned None (spin)")
        candidates = [t for t in (wake, self.events[0].at if self.events else None) if t]
        if not candidates:
            return
        self.now = max(self.now, min(candidates))
        if self.events and self.events[0].at <= self.now:
            self.handle(heapq.heappop(self.events))
        self.check()

    def drain(self) -> None:
        """Ask for decisions until None, executing each before asking again (like the shell)."""
        sched = self.scheduler
        for _ in range(MAX_DECISIONS_PER_DRAIN):
            if sched is None or sched is not self.scheduler:
                return
            decision = sched.decide(self.now)
            if decision is None:
                return
            self.execute(sched, decision)
            self.check()
            if self.cfg.latency:
                # the query took a while: notifications and exits that arrived meanwhile are
                # delivered before the next decision, so they interleave with multi-step passes
                self.now += timedelta(seconds=self.rng.uniform(0, self.cfg.latency))
                while self.events and self.events[0].at <= self.now:
                    self.handle(heapq.heappop(self.events))
                    self.check()
        raise self.fail(f"more than {MAX_DECISIONS_PER_DRAIN} decisions without going idle")

    # --- host lifecycle --------------------------------------------------------------------------

    def start_host(self) -> None:
        """A legitimate startup (or lease takeover): new term, new or emptied core, restore."""
        self.store.term += 1
        if self.scheduler is None:
            self.host += 1
            self.scheduler = self.factory(
                self.cfg.specs,
                rng=random.Random(self.seed * 7919 + self.host),
                backoff=Backoff(),
                conflict_delay=5.0,
                error_delay=30.0,
            )
        self.history.clear()  # backoff lives in memory only (RFC §7)
        self.unnotified.clear()  # restore runs a full request pass
        for name in self.specs:
            b = self.store.bindings[name]
            state = BindingState(b.checkpoint, b.scan_generation, b.scan_in_progress, b.upper)
            self.scheduler.restore(name, state)
        self.term_started = self.now
        self.log(f"term {self.store.term} established (host {self.host})")

    def prefill(self) -> None:
        """Durable state left by an earlier process: backlog, accepted requests and, for some
        families, a scan that crashed mid-way after admitting a few Scopes (even under a policy
        that is now Disabled: that scan must end without admitting more)."""
        store = self.store
        for name in self.specs:
            for _ in range(self.rng.randint(0, self.cfg.scopes)):
                scope = f"s{self.rng.randrange(self.cfg.scopes)}"
                if self.rng.random() < 0.3:
                    store.request(name, scope, with_input=self.rng.random() < 0.5)
                else:
                    store.mark_dirty(name, scope)
            rows = store.intents[name]
            if not rows or self.rng.random() < 0.5:
                continue
            b = store.bindings[name]
            b.scan_generation = self.rng.randint(1, 5)
            b.checkpoint = START - timedelta(seconds=self.rng.uniform(0, 900))
            b.scan_in_progress = True
            b.upper = max(r.pending_sequence for r in rows.values())
            for scope, row in rows.items():
                if row.dirty > row.clean and self.rng.random() < 0.5:
                    store.admit(store.term, name, scope, b.scan_generation)
            self.log(f"prefill: {name} crashed mid-scan {b}")
        self.prefilled = set(store.auto_admitted)

    def orphan_workers(self, kill_probability: float) -> None:
        """Workers of the old term: killed, or surviving as orphans whose commits must fail."""
        for worker in list(self.live.values()):
            worker.live = False
            if self.rng.random() < kill_probability:
                worker.dead = True
        self.live.clear()

    # --- events ----------------------------------------------------------------------------------

    def handle(self, event: _Event) -> None:
        kind = event.kind
        if kind == "produce":
            self.produce()
        elif kind == "commit":
            self.worker_commit(event.data)
        elif kind == "exit":
            self.worker_exit(event.data)
        elif kind == "classify":
            self.classify(event.data)
        elif kind == "crash":
            if self.cfg.crash_mean:
                self.at(self.rng.expovariate(1 / self.cfg.crash_mean), "crash")
            self.crash()
        elif kind in ("restart", "reacquire"):
            if event.data == self.pending_start:  # a crash may have superseded a reacquire
                self.pending_start = None
                self.start_host()
        elif kind == "lease_lost":
            if self.cfg.lease_mean:
                self.at(self.rng.expovariate(1 / self.cfg.lease_mean), "lease_lost")
            self.lease_lost()
        elif kind == "poll":
            for name in self.specs:
                self.notify(name)
            self.at(self.cfg.poll or 30.0, "poll")
        else:  # pragma: no cover
            raise AssertionError(kind)

    def produce(self) -> None:
        if self.quiet:
            return
        self.at(self.rng.expovariate(1 / self.cfg.produce_mean), "produce")
        family = self.rng.choice(list(self.specs))
        scope = f"s{self.rng.randrange(self.cfg.scopes)}"
        roll = self.rng.random()
        if roll < 0.55:
            self.store.mark_dirty(family, scope)
            self.log(f"produce dirty {family}/{scope}")
            if self.rng.random() < 0.3:
                self.notify(family)
            return
        with_input = roll < 0.75
        g = self.store.request(family, scope, with_input)
        lost = self.rng.random() < self.cfg.lost_notify
        self.log(f"produce request {family}/{scope} G={g} input={with_input} lost={lost}")
        if not lost:
            self.notify(family)
            return
        self.unnotified.add(family)
        if self.cfg.backend == "sqlite" and self.scheduler is not None:
            # in-process SQLite: a notification is only lost when the host dies after the commit
            self.crash()

    def notify(self, family: str) -> None:
        if self.scheduler is not None:
            self.unnotified.discard(family)  # this notification's pass covers earlier commits
            self.scheduler.on_notify(family)

    def crash(self) -> None:
        if self.quiet or self.scheduler is None:
            return
        self.log("HOST CRASH: in-memory state lost")
        self.scheduler = None
        # SQLite: the term is only bumped by the next startup, so surviving Workers may still
        # commit legitimately until then; afterwards their commits must be rejected.
        self.orphan_workers(kill_probability=0.5)
        self.pending_start = next(self._seq)
        self.at(self.rng.uniform(1, 60), "restart", self.pending_start)

    def lease_lost(self) -> None:
        if self.quiet or self.scheduler is None:
            return
        if self.pending_start is not None:
            return  # already lost; the reacquire is pending
        self.store.term += 1  # another candidate took over: old-term writes are now rejected
        self.log(f"LEASE LOST (term now {self.store.term})")
        self.scheduler.on_lease_lost()
        self.history.clear()
        self.orphan_workers(kill_probability=0.7)
        self.pending_start = next(self._seq)
        self.at(self.rng.uniform(1, 60), "reacquire", self.pending_start)

    # --- executing decisions --------------------------------------------------------------------

    def inject_error(self, sched: Scheduler, decision: Decision, stage: str) -> bool:
        if self.quiet or self.rng.random() >= self.cfg.error_rate:
            return False
        self.log("ERROR", stage, "for", decision)
        self.count("family_errors")
        sched.on_family_error(decision.family, stage, self.now)
        return True

    def execute(self, sched: Scheduler, d: Decision) -> None:
        store = self.store
        term = store.term
        self.log("decide", d)
        spec = self.specs[d.family]
        if isinstance(d, StartScan):
            snap = sched.snapshot()[d.family]
            if isinstance(spec.policy, Disabled):
                raise self.fail(f"StartScan under a Disabled policy: {d}")
            if snap.ready >= snap.ready_limit:
                raise self.fail(f"StartScan without ready capacity: {snap}")
            if d.checkpoint != spec.policy.checkpoint_for(self.now):
                raise self.fail(f"StartScan checkpoint {d.checkpoint} is not the policy's")
            committed = self.rng.random() < 0.5
            if committed and not self.quiet and self.rng.random() < self.cfg.error_rate:
                store.start_scan(term, d.family, d.checkpoint)  # outcome unknown to the shell
            if self.inject_error(sched, d, "start_scan"):
                return
            gen, upper = store.start_scan(term, d.family, d.checkpoint)
            self.count("scans")
            sched.on_scan_started(d.family, gen, upper, d.checkpoint)
        elif isinstance(d, FetchScanPage):
            b = store.bindings[d.family]
            if d.scan_generation != b.scan_generation or not b.scan_in_progress:
                raise self.fail(f"page of a scan that is not the durable one: {d} vs {b}")
            if self.inject_error(sched, d, "scan_page"):
                return
            rows, exhausted = store.scan_page(d.family, d.after_sequence, d.upper_sequence, d.limit)
            self.log("  ->", rows, "exhausted =", exhausted)
            sched.on_scan_page(d.family, d.scan_generation, rows, exhausted)
        elif isinstance(d, Admit):
            self.execute_admit(sched, d, term)
        elif isinstance(d, EndScan):
            if not self.quiet and self.rng.random() < self.cfg.error_rate / 2:
                store.end_scan(term, d.family, d.scan_generation)  # committed, then error
            if self.inject_error(sched, d, "end_scan"):
                return
            store.end_scan(term, d.family, d.scan_generation)
            sched.on_scan_ended(d.family, d.scan_generation)
        elif isinstance(d, FetchRequests):
            if self.inject_error(sched, d, "request_page"):
                return
            at = self.now if d.skip_backoff else None
            requests, more = store.request_page(
                d.family, d.after_sequence, d.limit, at, self.term_started + BACKOFF_TERM_MARGIN
            )
            self.log("  ->", requests, "exhausted =", more)
            sched.on_request_page(d.family, requests, more)
        elif isinstance(d, Dispatch):
            self.execute_dispatch(sched, d, term)
        else:  # pragma: no cover
            raise AssertionError(d)

    def execute_admit(self, sched: Scheduler, d: Admit, term: int) -> None:
        marker = (term, d.family, d.scope_id, d.scan_generation)
        row = self.store.intents[d.family][d.scope_id]
        if row.last_auto >= d.scan_generation and marker not in self.admits_unreported:
            # This scan already admitted the Scope durably and we told the core so.
            raise self.fail(f"Scope admitted twice by scan generation {d.scan_generation}: {d}")
        if not self.quiet and self.rng.random() < self.cfg.error_rate / 2:
            self.store.admit(term, d.family, d.scope_id, d.scan_generation)
            self.admits_unreported.add(marker)  # committed, but the shell reports an error
            self.log("  (admission committed before the error)")
        if self.inject_error(sched, d, "admit"):
            return
        admitted = self.store.admit(term, d.family, d.scope_id, d.scan_generation)
        self.admits_unreported.discard(marker)
        self.log(f"  -> admitted={admitted}")
        sched.on_admitted(d.family, d.scope_id, admitted)

    def execute_dispatch(self, sched: Scheduler, d: Dispatch, term: int) -> None:
        key = (d.family, d.scope_id)
        if self.inject_error(sched, d, "dispatch"):
            return
        hist = self.history.get(key)
        if hist is not None and hist.last_exit is not None:
            self.check_backoff(d, hist)
        claimed = self.store.claim(d.family, d.scope_id)
        if claimed is None:
            self.log("  -> already handled: not started")
            self.history.pop(key, None)
            sched.on_dispatched(d.family, d.scope_id, False, token=d.token)
            return
        if key in self.live:
            raise self.fail(f"second Worker for {key} while {self.live[key]} runs")
        running = sum(1 for f, _ in self.live if f == d.family)
        if running >= self.specs[d.family].max_workers:
            raise self.fail(f"{d.family}: budget exceeded ({running} running)")
        self.launch(d, claimed, term)
        sched.on_dispatched(d.family, d.scope_id, True, token=d.token)

    def check_backoff(self, d: Dispatch, hist: KeyHistory) -> None:
        assert hist.last_exit is not None
        waited = (self.now - hist.last_exit).total_seconds()
        if hist.last_outcome is Outcome.CONFLICT:
            minimum = 5.0
        elif hist.last_outcome in (Outcome.FAILURE, Outcome.TIMEOUT):
            minimum = 0.9 * min(1800.0, 30.0 * 2 ** (hist.failures - 1))
        else:
            return
        if waited + 1e-6 < minimum:
            raise self.fail(
                f"{d} after {waited:.1f}s: backoff after {hist.failures} failure(s) "
                f"({hist.last_outcome}) requires >= {minimum:.1f}s"
            )

    # --- Workers ---------------------------------------------------------------------------------

    WORKER_KINDS = (
        ("success_all", 30),
        ("success_partial", 20),
        ("multi_commit", 8),
        ("fail", 10),
        ("hang", 5),
        ("exit0_noack", 5),
        ("progress_then_crash", 8),
        ("ack_then_crash", 6),
        ("conflict", 6),
    )

    def launch(self, d: Dispatch, claimed: int, term: int) -> None:
        row = self.store.intents[d.family][d.scope_id]
        if self.quiet:
            kind = "success_all"
        else:
            names, weights = zip(*self.WORKER_KINDS, strict=True)
            kind = self.rng.choices(names, weights)[0]
        w = Worker(next(self._wids), d.family, d.scope_id, term, self.host, d.token, claimed, kind)
        self.workers[w.wid] = w
        self.live[(d.family, d.scope_id)] = w
        snap = {"cursor": row.cursor, "journal": row.journal, "dirty": row.dirty}
        available = row.journal - row.cursor
        timeout = self.cfg.timeouts[d.family]
        work = self.rng.uniform(0.5, timeout * 0.8)
        self.log("  -> launched", w, snap)
        self.count(f"worker_{kind}")
        partial = self.rng.randint(0, available)

        def commit(delay: float, consume: int, expected: int, ack: bool) -> None:
            self.at(delay, "commit", (w, dict(snap, consume=consume, expected=expected, ack=ack)))

        c0 = row.cursor
        if kind == "success_all":
            commit(work, available, c0, True)
            self.at(work + 0.1, "exit", (w, Outcome.SUCCESS))
        elif kind == "success_partial":
            commit(work, partial, c0, True)
            self.at(work + 0.1, "exit", (w, Outcome.SUCCESS))
        elif kind == "multi_commit":
            commit(work / 2, partial, c0, False)
            rest = self.rng.randint(0, available - partial)
            commit(work, rest, c0 + partial, True)
            self.at(work + 0.1, "exit", (w, Outcome.SUCCESS))
        elif kind in ("fail", "exit0_noack"):
            if kind == "exit0_noack" and available:
                commit(work / 2, partial, c0, False)
            self.at(work, "exit", (w, Outcome.FAILURE))
        elif kind == "hang":
            self.at(timeout + 5.0, "exit", (w, Outcome.TIMEOUT))  # terminated, exit confirmed
        elif kind == "progress_then_crash":
            commit(work / 2, partial, c0, False)
            self.at(work, "exit", (w, Outcome.FAILURE))
        elif kind == "ack_then_crash":
            commit(work / 2, available, c0, True)
            self.at(work, "exit", (w, Outcome.FAILURE))
        elif kind == "conflict":
            self.at(work, "exit", (w, Outcome.CONFLICT))

    def worker_commit(self, data: tuple[Worker, dict[str, int]]) -> None:
        w, plan = data
        if w.dead:
            return
        try:
            self.store.commit(
                w.term,
                w.family,
                w.scope,
                expected_cursor=plan["expected"],
                consume=plan["consume"],
                snapshot_journal=plan["journal"],
                snapshot_dirty=plan["dirty"],
                ack=w.claimed if plan["ack"] else None,
            )
        except StaleTerm:
            self.log(f"w{w.wid} commit rejected: stale term {w.term}")
            self.count("stale_commits_rejected")
            if w.live:
                raise self.fail(f"a current-term Worker got StaleTerm: {w}") from None
            w.dead = True  # StaleTermError ends the orphan
            return
        except CursorConflict as exc:
            raise self.fail(f"business cursor moved under w{w.wid}: {exc}") from None
        if not w.live and w.term != self.store.term:
            raise self.fail(f"orphan w{w.wid} committed under a stale term")
        self.log(f"w{w.wid} committed", plan)
        row = self.store.intents[w.family][w.scope]
        if row.consumed != list(range(1, len(row.consumed) + 1)):
            raise self.fail(f"inputs of {w.family}/{w.scope} consumed out of order")

    def worker_exit(self, data: tuple[Worker, Outcome]) -> None:
        w, outcome = data
        if w.dead:
            return
        w.dead = True
        if not w.live:
            return  # an orphan of an old term: the current shell never reports it
        w.live = False
        key = (w.family, w.scope)
        del self.live[key]
        assert self.scheduler is not None
        if self.classify_rng.random() < 0.5:
            # The exit is confirmed now, its outcome known later: the slot is free meanwhile.
            self.log(f"w{w.wid} exited; outcome later")
            self.scheduler.on_worker_exited(w.family, w.scope, token=w.token)
            self.classifying.add(w.wid)
            later = (w, outcome, self.scheduler, self.store.term)
            self.at(self.classify_rng.uniform(0.0, 2.0), "classify", later)
            return
        self.report_exit(w, outcome)

    def classify(self, data: tuple[Worker, Outcome, Scheduler, int]) -> None:
        w, outcome, sched, term = data
        self.classifying.discard(w.wid)
        if sched is not self.scheduler or term != self.store.term:
            self.log(f"w{w.wid} outcome dropped: its term is gone")
            return  # as the host: an earlier term's exit; the new term recovers from the store
        self.report_exit(w, outcome)

    def report_exit(self, w: Worker, outcome: Outcome) -> None:
        key = (w.family, w.scope)
        row = self.store.intents[w.family][w.scope]
        more = row.requested > row.handled
        self.log(f"w{w.wid} exit {outcome.name} more_requested={more}")
        hist = self.history.setdefault(key, KeyHistory())
        if outcome is Outcome.SUCCESS:
            hist.failures = 0
        elif outcome in (Outcome.FAILURE, Outcome.TIMEOUT):
            hist.failures += 1
        hist.last_exit, hist.last_outcome = self.now, outcome
        assert self.scheduler is not None
        self.scheduler.on_worker_exit(w.family, w.scope, outcome, more, self.now, token=w.token)
        # As the shell: the failure state records the next attempt; a success clears it.
        if outcome is Outcome.SUCCESS:
            self.store.backoff_until.pop(key, None)
        elif outcome in (Outcome.FAILURE, Outcome.TIMEOUT):
            info = self.scheduler.key_info(w.family, w.scope)
            if info is not None and info.retry_at is not None:
                self.store.backoff_until[key] = (info.retry_at, self.now)

    # --- invariants ------------------------------------------------------------------------------

    def check(self) -> None:
        sched = self.scheduler
        if sched is not None:
            try:
                if self.verify_core:
                    sched.verify()
            except AssertionError as exc:
                raise self.fail(f"core invariant: {exc}") from None
            live: dict[str, int] = dict.fromkeys(self.specs, 0)
            for family, scope in self.live:
                live[family] += 1
                if sched.key_state(family, scope) is not KeyState.RUNNING:
                    raise self.fail(
                        f"live Worker for {family}/{scope} but the core has it "
                        f"{sched.key_state(family, scope)}"
                    )
            for name, spec in self.specs.items():
                # with the loop above: the core's running keys are exactly the live Workers
                if sched.running_count(name) != live[name]:
                    raise self.fail(
                        f"{name}: core counts {sched.running_count(name)} running, "
                        f"{live[name]} Workers are live"
                    )
                if live[name] > spec.max_workers:
                    raise self.fail(f"{name}: {live[name]} Workers > budget {spec.max_workers}")
        if sched is not None:
            self.check_nothing_stranded(sched)

    def check_nothing_stranded(self, sched: Scheduler) -> None:
        """An accepted request must never wait for an unrelated stimulus (RFC §8 wake-ups).

        If the core has no request pass pending and no step in flight for a family, then every
        ``requested > handled`` row of it must be held in memory (ready, running or retry-wait),
        unless its notification was lost (a poll or restart recovers it) or its admission was
        committed but reported as an error (the core retries that Admit).
        """
        for name, scopes in self.store.open_requests.items():
            if not scopes or name in self.unnotified or sched.request_discovery_pending(name):
                continue
            free = [
                scope
                for scope in scopes
                if sched.key_state(name, scope) is None
                and not any(m[1:3] == (name, scope) for m in self.admits_unreported)
            ]
            if not free:
                continue
            snap = sched.snapshot()[name]
            if snap.active and snap.step_in_flight is None:
                raise self.fail(f"{name}: accepted requests {free} stranded: {snap}")

    def converged(self) -> bool:
        """Durable work done and nothing left in the core's memory (a pending retry of an
        already-handled G still has to run and find it handled)."""
        if self.scheduler is None or self.live or self.pending_start is not None:
            return False
        if self.classifying:
            return False
        for snap in self.scheduler.snapshot().values():
            if snap.running or snap.ready or snap.retry_wait or snap.request_pass_active:
                return False
            if snap.scan_active or (snap.postponed_until and snap.postponed_until > self.now):
                return False
        for name, rows in self.store.intents.items():
            scheduled = not isinstance(self.specs[name].policy, Disabled)
            for r in rows.values():
                if r.requested > r.handled or (scheduled and r.dirty > r.clean):
                    return False
        return True

    def pending_summary(self) -> str:
        parts = []
        for name, rows in self.store.intents.items():
            for scope, r in rows.items():
                if r.requested > r.handled or r.dirty > r.clean:
                    parts.append(
                        f"{name}/{scope} req={r.requested} handled={r.handled} "
                        f"dirty={r.dirty} clean={r.clean}"
                    )
        snap = self.scheduler.snapshot(self.now) if self.scheduler else None
        return f"{parts}; scheduler={snap}"

    def final_checks(self) -> None:
        sched = self.scheduler
        assert sched is not None
        for name, snap in sched.snapshot(self.now).items():
            if snap.running or snap.ready or snap.retry_wait:
                raise self.fail(f"{name}: work left in memory after convergence: {snap}")
        if all(isinstance(s.policy, Disabled) for s in self.cfg.specs):
            self.drain()
            wake = sched.next_wakeup(self.now)
            if wake is not None:
                raise self.fail(f"idle with only disabled families, yet next_wakeup={wake}")
        for name, _scope, _gen in self.store.auto_admitted - self.prefilled:
            if isinstance(self.specs[name].policy, Disabled):
                raise self.fail(f"{name}: automatic admission under a Disabled policy")


def run_seed(seed: int, steps: int = 150, **kwargs: Any) -> Simulation:
    return Simulation(seed, steps, **kwargs).run()
