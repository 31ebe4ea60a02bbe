"""The sans-IO scheduling core: per-family partitions, fair ready queues, backoff, scan cursors.

The core holds only in-memory scheduling state (RFC §2, §7) and turns events into decisions. It
never reads the clock, sleeps, touches the database or starts processes: the IO shell passes
``now`` (naive UTC) in, executes one decision at a time and reports each result back before it
asks for the next one. Durable facts (intents, binding state) stay in the store; after a crash or
a term change the core is rebuilt from them with ``restore`` (RFC §8 "Roles and recovery").

Vocabulary used below:

* A *key* is a Scope of one family. In memory it is in at most one of ``ready``, ``running``,
  ``exited`` (its Worker is gone, its outcome not yet known) or ``retry_wait`` (RFC §2); a key in
  none of them is *free*.
* *Capacity* of a family for discovery: its ready queue has room (``len(ready) < ready_limit``).
  A family whose ready queue is full never discovers (no scan page, no admission, no request
  page, no StartScan); while it also has free Workers it dispatches instead, so "ready full" and
  "Workers free" cannot persist together.
* One *step* is one decision in flight. A family has at most one step in flight; other families
  are unaffected by it.

What the shell must do (the simulation in tests/simulation plays the same role):

* Execute decisions one at a time and report each through its ``on_*`` event, or through
  ``on_family_error`` if the query/transaction failed, before calling ``decide`` again. An error
  whose commit may have gone through is fine: every control write is safe to repeat.
* Report ``on_dispatched(started=True)`` only if a Worker was launched; otherwise
  ``started=False`` (G already handled) or ``on_family_error`` (nothing launched).
* Report ``on_worker_exit`` only once the exit is confirmed, with ``more_requested`` read from the
  store after the exit, and pass the Dispatch ``token``: after a term change an old Worker's
  exit must never release a key the new term is running. A shell that learns the outcome later
  than the exit (it acknowledges or reads the store first) may report ``on_worker_exited`` as
  soon as the exit is confirmed: the Worker's capacity is then free for the next dispatch while
  the key itself stays occupied until ``on_worker_exit``.
* Call ``on_lease_lost`` (or build a new Scheduler) before ``restore`` on a new term.
* When ``decide`` returns None, sleep until ``next_wakeup`` or the next event (notification,
  Worker exit); on MySQL a bounded poll calls ``on_notify`` for requests from other processes.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import random
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TypeVar

from apsup.errors import ConfigError
from apsup.policy import CLOCK_JUMP_TOLERANCE, Disabled, Policy
from apsup.scheduling.backoff import Backoff
from apsup.scheduling.decisions import (
    Admit,
    Decision,
    Dispatch,
    DispatchReason,
    EndScan,
    FetchRequests,
    FetchScanPage,
    StartScan,
)

_D = TypeVar("_D", StartScan, FetchScanPage, Admit, EndScan, FetchRequests, Dispatch)

# --- public records ------------------------------------------------------------------------------


@dataclass(frozen=True)
class FamilySpec:
    """Scheduling configuration of one Artifact Family (its single binding).

    ``ready_limit`` bounds the family's ready queue (default ``max(32, 4 * max_workers)``);
    ``page_size`` bounds every discovery query.
    """

    name: str
    policy: Policy
    max_workers: int
    ready_limit: int | None = None
    page_size: int = 100

    @property
    def queue_limit(self) -> int:
        """The effective ready-queue bound. A request page refills half of it, so the bound
        sets how many dispatches one page read serves: with ``max(8, 2 * max_workers)`` a
        2-Worker family under a backlog read a page every 4 dispatches (1.51 host statements
        per no-op task on SQLite, 0.54 on MySQL); with this one every 16 (0.42 / 0.35), and
        both drained 2-5% faster."""
        if self.ready_limit is not None:
            return self.ready_limit
        return max(32, 4 * self.max_workers)


@dataclass(frozen=True)
class ScanRow:
    """One ``dirty > clean`` intent row of a scan page."""

    scope_id: str
    pending_sequence: int
    last_auto_scan_generation: int


@dataclass(frozen=True)
class RequestRow:
    """One ``requested > handled`` intent row of a request-discovery page."""

    scope_id: str
    pending_sequence: int


@dataclass(frozen=True)
class BindingState:
    """The durable check state of a binding (RFC §4), as loaded after a term is established."""

    checkpoint: datetime | None
    scan_generation: int
    scan_in_progress: bool
    scan_upper_pending_sequence: int | None


class Outcome(enum.Enum):
    """How a Worker's exit was confirmed. An exit without durable acknowledgment is FAILURE."""

    SUCCESS = "success"
    FAILURE = "failure"
    TIMEOUT = "timeout"
    CONFLICT = "conflict"
    STALE_TERM = "stale_term"


class KeyState(enum.Enum):
    """The mutually exclusive in-memory states of a key (a free key has none)."""

    READY = "ready"
    RUNNING = "running"
    EXITED = "exited"  # the Worker is gone (capacity free), its outcome not yet reported
    RETRY_WAIT = "retry_wait"


@dataclass(frozen=True)
class KeyInfo:
    """One non-free key, for failure logs (retry count and delay, RFC §12)."""

    state: KeyState
    reason: DispatchReason
    consecutive_failures: int
    retry_at: datetime | None  # when a key in retry-wait becomes due


@dataclass(frozen=True)
class FamilySnapshot:
    """Per-family figures for metrics and status (no unbounded identifiers)."""

    family: str
    policy: str
    active: bool  # restored under the current term
    budget: int
    running: int
    ready: int
    ready_limit: int
    retry_wait: int  # keys waiting for a deadline or for ready room (includes ``deferred``)
    deferred: int  # keys whose retry/successor is due but waits for ready room
    next_retry_at: datetime | None
    checkpoint: datetime | None
    due_at: datetime | None  # next automatic check; None if disabled (or unknown without now)
    scan_active: bool
    scan_generation: int
    scan_after_sequence: int | None
    request_pass_active: bool
    notifications: int
    step_in_flight: str | None
    degraded: bool
    postponed_until: datetime | None
    last_error_stage: str | None
    errors: int
    max_consecutive_failures: int
    clock_rewinds: int = 0  # checkpoints clamped because database time went back


# --- internal state ------------------------------------------------------------------------------


@dataclass
class _Key:
    state: KeyState
    reason: DispatchReason
    failures: int = 0
    token: int = 0


@dataclass
class _Scan:
    """An unfinished automatic scan: its generation, bound, position and (at most) one page."""

    generation: int
    upper: int | None
    after_sequence: int = 0  # the last row fully handled
    rows: deque[ScanRow] = field(default_factory=deque)
    last_page: bool = False  # ``rows`` is the final page
    ending: bool = False  # every page is handled: EndScan is the next step


@dataclass
class _RequestPass:
    """A request-discovery pass over ``requested > handled`` rows (RFC §8 SQLite wake-ups)."""

    after_sequence: int = 0
    started_at: int | None = None  # notification count when the pass issued its first query
    paused: bool = False  # its last page stopped at a full ready queue
    #: Reads Scopes in a recorded backoff too. Only a pass that may meet keys this term does
    #: not hold is full (after restore, a key let go of while parked, an operator's retry of
    #: a free key); every other pass leaves them out (``FetchRequests.skip_backoff``).
    full: bool = False


class _Family:
    """One scheduling partition: its own queue, backoff index, scan cursor and budget (RFC §2)."""

    def __init__(self, spec: FamilySpec) -> None:
        self.spec = spec
        self.name = spec.name
        self.budget = spec.max_workers
        self.limit = spec.queue_limit
        self.clock_rewinds = 0  # survives lease loss: it is a counter
        #: Operator controls, mirrored from the database (the shell applies them after every
        #: restore): a paused family dispatches nothing new; a parked key is never dispatched.
        self.paused = False
        self.parked: set[str] = set()
        self.reset()

    def reset(self) -> None:
        """Forget everything held in memory (lease loss, before restore)."""
        self.restored = False
        self.keys: dict[str, _Key] = {}
        self.ready: deque[str] = deque()
        self.running = 0
        self.waiting: list[tuple[datetime, int, str]] = []  # heap of (due, tiebreak, scope)
        self.checkpoint: datetime | None = None
        self.rewound_from: datetime | None = None  # durable checkpoint a clamp still replaces
        self._due_for: datetime | None = None  # memo of next_due() for this checkpoint
        self._due: datetime | None = None
        self.scan_generation = 0
        self.scan: _Scan | None = None
        self.notifications = 0
        self.request_pass: _RequestPass | None = None
        self.want_full = False  # the next request pass is to be full
        self.step: Decision | None = None
        self.postponed_until: datetime | None = None
        self.degraded = False
        self.last_error_stage: str | None = None
        self.errors = 0
        self.error_streak = 0  # errors since the family's last successful step
        self.retry_turn = True  # due retries and discovered keys alternate filling ready room
        self.requests_turn = True  # alternation between request discovery and the scan
        #: The policy failed to compute the next check (exception type); cleared when it can.
        self.policy_error: str | None = None

    def has_room(self) -> bool:
        return len(self.ready) < self.limit

    def can_start_scan(self) -> bool:
        """A due check starts only with a Worker free for it (RFC §2, §4): busy Workers skip the
        check, so the checkpoint does not advance and no check is pretended; the Worker exit
        that frees one is the event that starts the check, at once."""
        return self.running + len(self.ready) < self.budget

    def scan_held_back(self, now: datetime) -> bool:
        """A due check waits for a free Worker. Meanwhile nothing new enters the ready queue
        (request pages, due retries, successors): the queue drains through dispatches and the
        check starts at the first exit after that, within ``limit + budget`` dispatches, so
        no request stream can starve automatic checks (RFC §2 fairness)."""
        if self.scan is not None or self.can_start_scan():
            return False
        due = self.next_due(now)
        return due is not None and due <= now

    def next_due(self, now: datetime) -> datetime | None:
        """``policy.next_due(checkpoint, now)``, memoised per checkpoint.

        Once a checkpoint exists the next due time depends on it alone (interval: checkpoint + T;
        cron: the first fire after it), and cron maths is costly while ``decide`` runs often.
        Without a checkpoint the first check is due at once (``now``).
        A policy that cannot compute (e.g. an overflowing interval, a cron that never fires)
        records ``policy_error`` and has no due check for the rest of the term (policies do not
        change while running): only this family's automatic checks stop.
        """
        if self.policy_error is not None:
            return None
        try:
            self.clamp_checkpoint(now)
            if self.checkpoint is None:
                return self.spec.policy.next_due(None, now)
            if self._due_for != self.checkpoint:
                self._due = self.spec.policy.next_due(self.checkpoint, now)
                self._due_for = self.checkpoint
            return self._due
        except Exception as exc:
            self.policy_error = type(exc).__name__
            return None

    def clamp_checkpoint(self, now: datetime) -> None:
        """Database time went back: a checkpoint more than the tolerance ahead is clamped to now.

        Otherwise the family would stall silently for the whole jump. The next StartScan carries
        ``rewound_from`` so the store accepts the earlier checkpoint; the shell logs it.
        """
        if self.checkpoint is not None and self.checkpoint > now + CLOCK_JUMP_TOLERANCE:
            if self.rewound_from is None:
                self.rewound_from = self.checkpoint
            self.checkpoint = now
            self.clock_rewinds += 1


# --- the scheduler -------------------------------------------------------------------------------


class Scheduler:
    """Pure scheduling state for one Supervisor (all families in ``global``, one in ``dedicated``).

    Drive it with ``decide(now)`` until it returns None, then sleep until ``next_wakeup(now)`` or
    the next event. Events about a step that is no longer in flight (after ``on_lease_lost`` or
    ``on_family_error``) are ignored and counted in ``ignored_events``.
    """

    def __init__(
        self,
        specs: list[FamilySpec],
        *,
        rng: random.Random,
        backoff: Backoff | None = None,
        conflict_delay: float = 5.0,
        error_delay: float = 0.5,
        error_delay_max: float | None = None,
    ) -> None:
        names = [spec.name for spec in specs]
        if len(set(names)) != len(names):
            raise ConfigError(f"duplicate family names in scheduler specs: {names}")
        for spec in specs:
            if spec.max_workers < 1:
                raise ConfigError(f"family {spec.name!r}: max_workers must be >= 1")
            if spec.queue_limit < 1:
                raise ConfigError(f"family {spec.name!r}: ready_limit must be >= 1")
            if spec.page_size < 1:
                raise ConfigError(f"family {spec.name!r}: page_size must be >= 1")
        if error_delay_max is None:
            error_delay_max = max(error_delay, 5.0)
        if conflict_delay < 0 or error_delay < 0 or error_delay_max < error_delay:
            raise ConfigError(
                "conflict_delay and error_delay must be >= 0 seconds, error_delay_max >= "
                "error_delay"
            )
        self._families = [_Family(spec) for spec in specs]
        self._by_name = {f.name: f for f in self._families}
        self._rng = rng
        self._backoff = backoff or Backoff()
        self._conflict_delay = timedelta(seconds=conflict_delay)
        self._error_delay = error_delay
        self._error_delay_max = error_delay_max
        self._last_served = -1
        self._tokens = itertools.count(1)
        self._tiebreak = itertools.count()
        self.ignored_events = 0
        #: ``(family, exception type)`` of policies that started failing, for the IO shell to
        #: log (drained by it); such a family degrades alone, the others keep being decided.
        self.policy_errors: deque[tuple[str, str]] = deque()

    # --- lifecycle -------------------------------------------------------------------------------

    @property
    def families(self) -> tuple[str, ...]:
        return tuple(f.name for f in self._families)

    def restore(self, family: str, state: BindingState) -> None:
        """Activate a family under a freshly established term from its durable check state.

        An unfinished scan resumes with the same generation from the first page (the
        last-auto-scan marker makes that idempotent); under a Disabled policy it is only ended.
        A full request-discovery pass is scheduled to recover every ``requested > handled`` row,
        including admissions that never reached the old process's queue.
        """
        f = self._family(family)
        if f.running:
            raise RuntimeError(
                f"restore({family!r}) while {f.running} Worker(s) are counted as running; "
                "call on_lease_lost() first so that no key can be dispatched twice"
            )
        f.reset()
        f.restored = True
        f.checkpoint = state.checkpoint
        f.scan_generation = state.scan_generation
        if state.scan_in_progress:
            upper = state.scan_upper_pending_sequence
            f.scan = _Scan(state.scan_generation, upper)
            f.scan.ending = upper is None or isinstance(f.spec.policy, Disabled)
        f.request_pass = _RequestPass(full=True)  # this term holds no key yet

    def on_lease_lost(self) -> None:
        """Drop every in-memory record; nothing is decided until ``restore``.

        Accepted requests stay durable, so nothing is lost: the next term recovers them.
        """
        for f in self._families:
            f.reset()

    # --- deciding --------------------------------------------------------------------------------

    def decide(self, now: datetime) -> Decision | None:
        """The next step to execute now, visiting families round-robin after the last served.

        A family without an eligible step is skipped and never blocks the next one (RFC §2).
        """
        count = len(self._families)
        for offset in range(1, count + 1):
            index = (self._last_served + offset) % count
            f = self._families[index]
            failing = f.policy_error
            try:
                decision = self._step(f, now)
            except Exception as exc:  # its policy cannot compute (cron maths): only f degrades
                f.policy_error = type(exc).__name__
                self.on_family_error(f.name, "policy", now)
                decision = None
            if f.policy_error is not None and f.policy_error != failing:
                self.policy_errors.append((f.name, f.policy_error))
            if decision is not None:
                self._last_served = index
                self._issue(f, decision)
                return decision
        return None

    def _step(self, f: _Family, now: datetime) -> Decision | None:
        if not f.restored or f.step is not None:
            return None
        if f.postponed_until is not None:
            if now < f.postponed_until:
                return None
            f.postponed_until = None  # stays degraded until a step succeeds
        while True:
            while f.ready and f.ready[0] in f.parked:
                del f.keys[f.ready.popleft()]  # parked meanwhile: free, never dispatched
            if f.ready and f.running < f.budget and not f.paused:
                return self._dispatch(f)
            if f.scan is not None and f.scan.ending:
                return EndScan(f.name, f.scan.generation)  # ends regardless of capacity
            if not f.has_room() or f.scan_held_back(now):
                return None
            discovery = self._discovery(f, now)
            retry_due = bool(f.waiting) and f.waiting[0][0] <= now
            if retry_due and (discovery is None or f.retry_turn):
                # Due retries/successors and discovered keys take turns filling ready room, so
                # neither has unlimited priority over the other (RFC §2 fairness).
                self._promote(f)
                continue
            return discovery

    def _issue(self, f: _Family, decision: Decision) -> None:
        f.step = decision
        if isinstance(decision, FetchRequests):
            f.requests_turn = False
            assert f.request_pass is not None
            if f.request_pass.started_at is None:
                f.request_pass.started_at = f.notifications
        elif isinstance(decision, FetchScanPage | StartScan):
            f.requests_turn = True

    def _dispatch(self, f: _Family) -> Dispatch:
        scope = f.ready.popleft()
        key = f.keys[scope]
        key.state = KeyState.RUNNING
        key.token = next(self._tokens)
        f.running += 1  # counts against the budget from now until the confirmed exit
        return Dispatch(f.name, scope, key.reason, key.token)

    def _discovery(self, f: _Family, now: datetime) -> Decision | None:
        """The family's next discovery step; the caller has checked capacity."""
        scan = f.scan
        if scan is not None and scan.rows:
            admission = self._next_admission(f, scan)
            if admission is not None:
                return admission  # finish the page in memory before anything else
            if scan.ending:
                return EndScan(f.name, scan.generation)
        requests: Decision | None = None
        resume = f.request_pass is not None and (
            not f.request_pass.paused or 2 * len(f.ready) <= f.limit
        )
        if resume and f.request_pass is not None:
            # A pass paused by a full ready queue resumes once half of the queue has been
            # dispatched (still at least max_workers keys ready, by the default limit), not
            # after every dispatch: one page then refills half the queue, instead of one query
            # per dispatch under a backlog. It asks for the free places, plus every key held in
            # memory (ready, running, retry-wait), which the page may contain and must skip; a
            # page can therefore still fill every free place.
            wanted = f.limit - len(f.ready) + len(f.keys)
            requests = FetchRequests(
                f.name,
                f.request_pass.after_sequence,
                min(f.spec.page_size, wanted),
                skip_backoff=not f.request_pass.full,
            )
        scan_due = (
            scan is None
            and f.can_start_scan()
            and (due := f.next_due(now)) is not None
            and due <= now
        )
        if requests is not None and (f.requests_turn or (scan is None and not scan_due)):
            return requests  # request discovery and the scan take turns
        if scan is not None:
            assert scan.upper is not None  # an empty binding's scan is ``ending`` at once
            return FetchScanPage(
                f.name, scan.generation, scan.after_sequence, scan.upper, f.spec.page_size
            )
        if scan_due:
            try:
                checkpoint = f.spec.policy.checkpoint_for(now)  # cron maths: only here
            except Exception as exc:
                f.policy_error = type(exc).__name__  # no automatic checks; requests still run
                return requests
            if f.checkpoint is not None and checkpoint <= f.checkpoint:
                assert due is not None
                checkpoint = due  # strictly forward: the due fire is after the checkpoint
            return StartScan(f.name, checkpoint, f.rewound_from)
        return requests

    def _next_admission(self, f: _Family, scan: _Scan) -> Admit | None:
        """Skip rows that need no admission; the first one that does becomes an Admit."""
        while scan.rows:
            row = scan.rows[0]
            if (
                row.scope_id in f.keys
                or row.scope_id in f.parked
                or row.last_auto_scan_generation >= scan.generation
            ):
                # Busy keys are not awaited (RFC §4.1); a marked row was admitted by this scan.
                scan.rows.popleft()
                scan.after_sequence = row.pending_sequence
                continue
            return Admit(f.name, row.scope_id, scan.generation)
        if scan.last_page:
            scan.ending = True
        return None

    def _promote(self, f: _Family) -> None:
        _, _, scope = heapq.heappop(f.waiting)
        key = f.keys[scope]
        key.state = KeyState.READY
        f.ready.append(scope)
        f.retry_turn = False

    # --- events ----------------------------------------------------------------------------------

    def on_notify(self, family: str, *, full: bool = False) -> None:
        """A request (or dirty) notification: ensure a request-discovery pass.

        Notifications are counted; a pass that finishes after the count moved runs once more,
        so notifications during a pass coalesce into exactly one extra pass. ``full``: that
        pass also reads Scopes in a recorded backoff (a key this term may not hold).
        """
        f = self._family(family)
        if not f.restored:
            return  # restore() runs a full pass anyway
        f.notifications += 1
        f.want_full = f.want_full or full
        if f.request_pass is None:
            f.request_pass = _RequestPass(full=f.want_full)
            f.want_full = False

    def set_paused(self, family: str, paused: bool) -> None:
        """Pause (no new dispatch; running Workers finish, discovery fills the ready queue) or
        resume a family."""
        self._family(family).paused = paused

    def set_parked(self, family: str, scopes: Iterable[str]) -> None:
        """The family's parked keys: never dispatched while parked (a ready one is dropped, a
        discovered one skipped; their requests stay durable). A key no longer parked is found
        again by a request pass, started here."""
        f = self._family(family)
        new = set(scopes)
        released = f.parked - new
        f.parked = new
        if released:
            self.on_notify(family, full=True)  # dropped while parked: maybe in a backoff

    def retry_now(self, family: str, scope_id: str, now: datetime) -> bool:
        """An operator's retry: a key waiting for its backoff is due now (its failure count
        stays until it succeeds). A free key is looked for by a request pass. True if a
        waiting key was moved."""
        f = self._family(family)
        key = f.keys.get(scope_id)
        if key is None:
            self.on_notify(family, full=True)  # a free key: its recorded backoff may be stale
            return False
        if key.state is not KeyState.RETRY_WAIT:
            return False
        f.waiting = [(min(due, now) if s == scope_id else due, t, s) for due, t, s in f.waiting]
        heapq.heapify(f.waiting)
        return True

    def on_scan_started(
        self, family: str, scan_generation: int, upper_sequence: int | None, checkpoint: datetime
    ) -> None:
        f = self._family(family)
        if self._settle(f, StartScan) is None:
            return
        if f.checkpoint is None or checkpoint > f.checkpoint:
            f.checkpoint = checkpoint  # never backwards (a clamp lowered it in memory first)
        f.rewound_from = None
        f.scan_generation = scan_generation
        f.scan = _Scan(scan_generation, upper_sequence, ending=upper_sequence is None)

    def on_scan_page(
        self, family: str, scan_generation: int, rows: list[ScanRow], exhausted: bool
    ) -> None:
        f = self._family(family)
        step = self._settle(f, FetchScanPage, scan_generation=scan_generation)
        scan = f.scan
        if step is None or scan is None or scan.generation != scan_generation:
            return
        assert scan.upper is not None
        page = sorted(
            (r for r in rows if r.pending_sequence > scan.after_sequence),
            key=lambda r: r.pending_sequence,
        )
        if any(r.pending_sequence > scan.upper for r in page):
            page = [r for r in page if r.pending_sequence <= scan.upper]
            exhausted = True  # nothing beyond this scan's bound belongs to it
        if len(page) > f.spec.page_size:
            page = page[: f.spec.page_size]  # keep at most one page in memory; fetch the rest
            exhausted = False
        scan.rows = deque(page)
        scan.last_page = exhausted or not page  # an empty page cannot make progress
        if not page:
            scan.ending = True

    def on_admitted(self, family: str, scope_id: str, admitted: bool) -> None:
        f = self._family(family)
        step = self._settle(f, Admit, scope_id=scope_id)
        scan = f.scan
        if step is None or scan is None:
            return
        if scan.rows and scan.rows[0].scope_id == scope_id:
            scan.after_sequence = scan.rows.popleft().pending_sequence
        if admitted:
            self._enqueue(f, scope_id, "scan")
        if not scan.rows and scan.last_page:
            scan.ending = True

    def on_scan_ended(self, family: str, scan_generation: int) -> None:
        f = self._family(family)
        step = self._settle(f, EndScan, scan_generation=scan_generation)
        if step is None or f.scan is None or f.scan.generation != scan_generation:
            return
        f.scan = None

    def on_request_page(self, family: str, rows: list[RequestRow], exhausted: bool) -> None:
        f = self._family(family)
        step = self._settle(f, FetchRequests)
        current = f.request_pass
        if step is None or current is None:
            return
        progressed = False
        current.paused = False
        for row in sorted(rows, key=lambda r: r.pending_sequence):
            if row.pending_sequence <= current.after_sequence:
                continue
            progressed = True
            if row.scope_id not in f.keys and row.scope_id not in f.parked:
                # Busy keys are skipped: a running key's new requests surface at its exit
                # (more_requested), a waiting key keeps its backoff and reads the latest G later.
                if not f.has_room():
                    current.paused = True
                    return  # paused; resume after the last row handled
                self._enqueue(f, row.scope_id, "request")
            current.after_sequence = row.pending_sequence
        if not exhausted and progressed:
            return
        if f.notifications != current.started_at:  # one more, at once
            f.request_pass = _RequestPass(started_at=f.notifications, full=f.want_full)
            f.want_full = False
        else:
            f.request_pass = None

    def peek_ready(self, family: str, extra: int = 0) -> list[str]:
        """The keys the next dispatches of ``family`` would take, in order, as many as its
        free budget allows (plus ``extra`` slots about to be freed); none while it is paused.
        Read-only: the host reads their rows together before it dispatches them."""
        f = self._family(family)
        if f.paused:
            return []
        room = f.budget - f.running + extra
        ahead: list[str] = []
        for scope in f.ready:
            if len(ahead) >= room:
                break
            if scope not in f.parked:
                ahead.append(scope)
        return ahead

    def on_dispatched(
        self, family: str, scope_id: str, started: bool, token: int | None = None
    ) -> None:
        """``started=False``: G was already handled (or nothing to do), so the key is free."""
        f = self._family(family)
        expected: dict[str, object] = {"scope_id": scope_id}
        if token is not None:
            expected["token"] = token
        if self._settle(f, Dispatch, **expected) is None:
            return
        if not started:
            del f.keys[scope_id]
            f.running -= 1

    def on_worker_exit(
        self,
        family: str,
        scope_id: str,
        outcome: Outcome,
        more_requested: bool,
        now: datetime,
        token: int | None = None,
        prior_failures: int = 0,
    ) -> None:
        """A Worker's exit was confirmed and its outcome is known: release its capacity (unless
        ``on_worker_exited`` did) and its key, and apply the failure policy.

        ``prior_failures``: the Scope's consecutive failures recorded durably before this term
        (the shell passes them at its first failure in the term): the count and the backoff
        continue from there instead of starting again at every restart or takeover (RFC §7:
        the first retry after a takeover may be immediate, then the sequence is rebuilt)."""
        f = self._family(family)
        key = f.keys.get(scope_id)
        if key is None or key.state not in (KeyState.RUNNING, KeyState.EXITED):
            self.ignored_events += 1
            return
        if token is not None and token != key.token:
            self.ignored_events += 1
            return
        if outcome is Outcome.STALE_TERM:
            self.on_lease_lost()  # the term is gone: nothing in memory is valid any more
            return
        if key.state is KeyState.RUNNING:
            self._release(f, scope_id)
        if outcome is Outcome.SUCCESS:
            key.failures = 0
            if more_requested:
                self._requeue(f, scope_id, key, "successor", now)  # at most one successor
            else:
                del f.keys[scope_id]
        elif outcome is Outcome.CONFLICT:
            self._wait(f, scope_id, key, "conflict", now + self._conflict_delay)
        else:  # FAILURE, TIMEOUT
            key.failures = max(key.failures, prior_failures) + 1
            delay = timedelta(seconds=self._backoff.delay(key.failures, self._rng))
            self._wait(f, scope_id, key, "retry", now + delay)

    def on_worker_exited(self, family: str, scope_id: str, token: int | None = None) -> None:
        """A Worker's exit was confirmed before its outcome is known: its capacity is free now
        (the next dispatch need not wait for the acknowledgment or read that decides the
        outcome), while its key stays occupied, so no second Worker can start for it, until
        ``on_worker_exit`` reports the outcome."""
        f = self._family(family)
        key = f.keys.get(scope_id)
        if key is None or key.state is not KeyState.RUNNING:
            self.ignored_events += 1
            return
        if token is not None and token != key.token:
            self.ignored_events += 1
            return
        self._release(f, scope_id)
        key.state = KeyState.EXITED

    def _release(self, f: _Family, scope_id: str) -> None:
        if isinstance(f.step, Dispatch) and f.step.scope_id == scope_id:
            f.step = None  # launched and exited before on_dispatched: it did start
        f.running -= 1

    def on_family_error(self, family: str, stage: str, now: datetime) -> None:
        """A discovery/control query of this family failed: abandon the step, postpone the family.

        The abandoned step is simply retried later from unchanged state: every control write is
        idempotent (admission by its marker, start/end scan by generation), so an error whose
        commit actually went through is harmless. Other families are unaffected (RFC §1, §8).
        """
        f = self._family(family)
        step = f.step
        f.step = None
        if isinstance(step, Dispatch):
            key = f.keys[step.scope_id]
            f.running -= 1
            if f.has_room():
                key.state = KeyState.READY
                f.ready.appendleft(step.scope_id)  # it was at the head; nothing was launched
            else:
                self._wait(f, step.scope_id, key, key.reason, now)
        # A transient error costs its step about one poll; errors in a row wait longer, up to
        # ``error_delay_max`` (the host keeps it within a renewal interval, so a leader never
        # sits on its Lease for long while a family with work dispatches nothing).
        f.error_streak += 1
        delay = min(self._error_delay_max, self._error_delay * 2 ** min(f.error_streak - 1, 16))
        f.postponed_until = now + timedelta(seconds=delay)
        f.degraded = True
        f.last_error_stage = stage
        f.errors += 1

    # --- helpers ---------------------------------------------------------------------------------

    def _family(self, name: str) -> _Family:
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"unknown family {name!r}; known: {sorted(self._by_name)}") from None

    def _settle(self, f: _Family, kind: type[_D], **expected: object) -> _D | None:
        """Match an event to the step in flight; a successful step clears ``degraded``.

        Anything else (a report about an abandoned step, or after lease loss) is ignored.
        """
        step = f.step
        if not isinstance(step, kind) or any(
            getattr(step, name) != value for name, value in expected.items()
        ):
            self.ignored_events += 1
            return None
        f.step = None
        f.degraded = False
        f.error_streak = 0
        return step

    def _enqueue(self, f: _Family, scope_id: str, reason: DispatchReason) -> None:
        if scope_id in f.keys:
            return  # busy: its current occupant will read the latest requested generation
        f.keys[scope_id] = _Key(KeyState.READY, reason)
        f.ready.append(scope_id)
        f.retry_turn = True  # a discovered key took a slot: the next one goes to a due retry

    def _requeue(
        self, f: _Family, scope_id: str, key: _Key, reason: DispatchReason, now: datetime
    ) -> None:
        key.reason = reason
        if f.has_room() and not f.scan_held_back(now):
            key.state = KeyState.READY
            f.ready.append(scope_id)
        else:
            self._wait(f, scope_id, key, reason, now)  # due at once, enters when there is room

    def _wait(
        self, f: _Family, scope_id: str, key: _Key, reason: DispatchReason, due: datetime
    ) -> None:
        key.state = KeyState.RETRY_WAIT
        key.reason = reason
        heapq.heappush(f.waiting, (due, next(self._tiebreak), scope_id))

    # --- time and observation --------------------------------------------------------------------

    def next_wakeup(self, now: datetime) -> datetime | None:
        """The earliest deadline at which a family could act without a new event, or None.

        Only deadlines that time alone can unblock count: a due schedule or due retry that waits
        for ready room is woken by the event that frees the room, never by polling.
        """
        earliest: datetime | None = None

        def consider(moment: datetime) -> None:
            nonlocal earliest
            if earliest is None or moment < earliest:
                earliest = moment

        for f in self._families:
            if not f.restored:
                continue
            if f.postponed_until is not None and f.postponed_until > now:
                if f.ready or f.waiting or f.scan or f.request_pass or f.next_due(now):
                    consider(f.postponed_until)  # the abandoned step (or other work) resumes
                continue
            if f.step is not None:
                continue  # its event wakes us
            if not f.has_room() or f.scan_held_back(now):
                continue  # time cannot create ready room or free a Worker; an exit will
            if f.waiting:
                consider(max(f.waiting[0][0], now))
            if f.scan is None and f.can_start_scan():  # else a Worker exit wakes us
                due = f.next_due(now)
                if due is not None:
                    consider(max(due, now))
        return earliest

    def key_state(self, family: str, scope_id: str) -> KeyState | None:
        """The in-memory state of one key (None = free)."""
        key = self._family(family).keys.get(scope_id)
        return None if key is None else key.state

    def key_info(self, family: str, scope_id: str) -> KeyInfo | None:
        """State, trigger reason, failure count and retry deadline of one key (None = free)."""
        f = self._family(family)
        key = f.keys.get(scope_id)
        if key is None:
            return None
        retry_at = None
        if key.state is KeyState.RETRY_WAIT:
            retry_at = next(due for due, _, scope in f.waiting if scope == scope_id)
        return KeyInfo(key.state, key.reason, key.failures, retry_at)

    def keys(self, family: str) -> dict[str, KeyState]:
        """All non-free keys of a family (bounded by running + ready + retry-wait)."""
        return {scope: key.state for scope, key in self._family(family).keys.items()}

    def request_discovery_pending(self, family: str) -> bool:
        """True while a request-discovery pass is pending or in progress for the family."""
        return self._family(family).request_pass is not None

    def running_count(self, family: str) -> int:
        """Workers counted against the family budget (Dispatch issued, exit not yet confirmed)."""
        return self._family(family).running

    def snapshot(self, now: datetime | None = None) -> dict[str, FamilySnapshot]:
        """Per-family counters for metrics and status; ``now`` lets ``due_at`` be computed."""
        result: dict[str, FamilySnapshot] = {}
        for f in self._families:
            reference = now if now is not None else f.checkpoint
            due_at = None if reference is None else f.next_due(reference)
            deferred = sum(1 for due, _, _ in f.waiting if now is not None and due <= now)
            # A parked key waits for the operator, not for a retry: not counted, no next attempt.
            waiting = [w for w in f.waiting if w[2] not in f.parked] if f.parked else f.waiting
            result[f.name] = FamilySnapshot(
                family=f.name,
                policy=f.spec.policy.describe(),
                active=f.restored,
                budget=f.budget,
                running=f.running,
                ready=len(f.ready),
                ready_limit=f.limit,
                retry_wait=len(waiting),
                deferred=deferred,
                next_retry_at=(f.waiting[0][0] if waiting is f.waiting else min(waiting)[0])
                if waiting
                else None,
                checkpoint=f.checkpoint,
                due_at=due_at,
                scan_active=f.scan is not None,
                scan_generation=f.scan_generation,
                scan_after_sequence=None if f.scan is None else f.scan.after_sequence,
                request_pass_active=f.request_pass is not None,
                notifications=f.notifications,
                step_in_flight=None if f.step is None else type(f.step).__name__,
                degraded=f.degraded or f.policy_error is not None,
                postponed_until=f.postponed_until,
                last_error_stage=(
                    f"policy: {f.policy_error}" if f.policy_error else f.last_error_stage
                ),
                errors=f.errors,
                max_consecutive_failures=max((k.failures for k in f.keys.values()), default=0),
                clock_rewinds=f.clock_rewinds,
            )
        return result

    def verify(self) -> None:
        """Check internal consistency (the simulation calls it after every step).

        Raises AssertionError naming the broken invariant.
        """
        ready_state, running_state = KeyState.READY, KeyState.RUNNING
        exited_state = KeyState.EXITED
        for f in self._families:
            ready: set[str] = set()
            waiting: set[str] = set()
            running = 0
            for scope, key in f.keys.items():
                if key.state is ready_state:
                    ready.add(scope)
                elif key.state is running_state:
                    running += 1
                elif key.state is exited_state:
                    continue  # neither queued nor counted: it waits for its outcome only
                else:
                    waiting.add(scope)
            queued = [scope for _, _, scope in f.waiting]
            if (
                ready != set(f.ready)
                or len(ready) != len(f.ready)
                or waiting != set(queued)
                or len(waiting) != len(queued)
                or running != f.running
            ):
                raise AssertionError(
                    f"{f.name}: key states disagree with ready {list(f.ready)}, retry-wait "
                    f"{queued}, running count {f.running}: {f.keys}"
                )
            if f.running > f.budget:
                raise AssertionError(f"{f.name}: {f.running} running > budget {f.budget}")
            if len(f.ready) > f.limit:
                raise AssertionError(f"{f.name}: ready {len(f.ready)} > limit {f.limit}")
            if f.scan is not None and len(f.scan.rows) > f.spec.page_size:
                raise AssertionError(f"{f.name}: more than one page in memory")
