"""One logical Supervisor: the IO shell that executes the sans-IO core's decisions.

A Supervisor owns one Lease key (``global`` or ``artifact:<family>``) and the families under it.
It turns each decision into one short database step or one Worker launch and feeds the result
back to the core. Database errors of one family degrade only that family; a stale term is a
control event that stops everything of this Supervisor (RFC §1, §7, §8).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import random
import signal
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection

from apsup.context import ExecutionContext
from apsup.errors import IntentError, ProgressConflict, StaleTermError
from apsup.observability.logging import error_fields, exception_message
from apsup.registry import Family, Reconciler
from apsup.scheduling import (
    Admit,
    Backoff,
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
from apsup.store import SqlBackend, intents, scans
from apsup.store.base import AckResult, ExitAck, Reads
from apsup.store.leases import Term
from apsup.store.operator_state import FamilyControl
from apsup.store.storage import DESCRIBE, storage_error_kind
from apsup.supervisor.exits import ExitFacts, asks_acknowledgment, classify
from apsup.supervisor.operator_controls import OperatorControls
from apsup.supervisor.request_ages import RequestAges
from apsup.workers.exit_codes import STORAGE_EXIT_CODES, STORAGE_EXITS, ExitCode
from apsup.workers.invoke import TARGET
from apsup.workers.pool import WorkerExit, WorkerPool

log = logging.getLogger("apsup.supervisor")


#: A family step that failed (a dropped connection, a lock timeout) is retried after this
#: delay, doubling while it keeps failing, up to the maximum.
ERROR_DELAY = 0.5
ERROR_DELAY_MAX = 5.0
#: A failure recorded less than this after a term's core was built may be an earlier term's
#: (another host's clock): request pages read such a Scope even while its backoff runs.
BACKOFF_TERM_MARGIN = timedelta(seconds=2)
#: A failed term establishment is retried after this delay, doubling up to the cap.
ESTABLISH_RETRY_INITIAL = 0.2
ESTABLISH_RETRY_MAX = 5.0
ESTABLISH_BACKOFF = Backoff(base=ESTABLISH_RETRY_INITIAL, cap=ESTABLISH_RETRY_MAX, jitter=0.0)
#: Reconciliation runs pages for at most this long per loop iteration, then gives the loop back
#: (Lease renewal, Worker exits, other families) and resumes from its last token.
RECONCILE_SLICE_SECONDS = 0.2
#: A reconciliation still running says so in the log every this many pages (it never stops
#: on its own: a page count is no reason to leave dirty state unrebuilt).
RECONCILE_LOG_PAGES = 1000
#: A Worker exit that could not be classified (database error) is retried after this delay,
#: doubling up to the cap; its key stays occupied meanwhile.
CLASSIFY_RETRY_INITIAL = 0.1
CLASSIFY_RETRY_MAX = 5.0
#: How long a row read ahead for a dispatch may be used (same term only). A READY key's
#: ``handled`` cannot move meanwhile (only this term's Workers acknowledge, and none runs for
#: it). A request announced by a wake-up drops the family's rows at once (``notify``); the
#: bound keeps the rest (a request only the poll found, an operator's action) from ageing.
READ_AHEAD_SECONDS = 1.0
#: How long confirmed exits may wait for the exits of other running Workers before they are
#: acknowledged and classified: exits a few milliseconds apart share one fenced transaction
#: (one commit; on MySQL one round trip and one Lease row lock) instead of one each. Their
#: slots are free meanwhile; only their keys stay occupied that much longer.
ACK_HOLD_SECONDS = 0.005
#: Rows read ahead with an acknowledgment: for this many turns of each running Worker's slot,
#: the dispatches expected before the next acknowledgment (one hold plus its round trip).
READ_AHEAD_TURNS = 3


def _reconcile_page(reconcile: Reconciler, fam: Family, token: object, conn: Connection) -> object:
    return reconcile(conn, fam, token)


def _load_states(families: list[Family], conn: Connection) -> dict[str, scans.ScanState]:
    return {f.name: scans.ensure_state(conn, f.binding_name) for f in families}


@dataclass
class _Reconciliation:
    """One family's reconciliation in progress, resumable from ``token``."""

    #: The check state to restore once done; ``None`` when the family is already restored
    #: (a retry after a failed reconciliation, run beside normal dispatch).
    state: BindingState | None
    token: object = None
    pages: int = 0
    started: float = field(default_factory=time.monotonic)


#: A host acknowledgment's result for one exit: (the exit code the Worker would have had, the
#: requested generation reported by the acknowledging statement or None), or the error that
#: left it undecided.
_Acknowledged = tuple[int, int | None] | Exception


@dataclass
class _Unclassified:
    """A confirmed Worker exit whose classification failed on a database error."""

    exit: WorkerExit
    attempts: int
    due: float  # monotonic


@dataclass
class Invocation:
    """What the Supervisor remembers about a running Worker (in memory only)."""

    family: Family
    scope_id: str
    generation: int
    worker_id: str
    reason: str
    started: float
    token: int  # the core's dispatch id: an exit reported under it cannot free another dispatch
    term_generation: int  # the term that dispatched it
    pending_sequence: int  # the intent row's incarnation G was claimed in (for acknowledging)


class Hooks:
    """Observability hooks; the default does nothing (metrics plug in here)."""

    def on_dispatch(self, family: str) -> None: ...
    def on_exit(self, family: str, cause: str | None, duration: float) -> None: ...
    def on_scan_started(self, family: str) -> None: ...
    def on_scan_completed(self, family: str) -> None: ...
    def observe_discovery(self, family: str, seconds: float) -> None: ...
    def on_storage_error(self, family: str, kind: str) -> None: ...
    def invocation_started(self, worker_id: str, fields: dict[str, Any]) -> dict[str, str]:
        """Trace context for the Worker (tracing: ``apsup.observability.tracing``)."""
        return {}

    def launch_streams(self, worker_id: str, fields: dict[str, Any]) -> tuple[int, ...]:
        """Fds to pass with this Worker's launch: its log streams (records, stdout, stderr)
        when the host relays them (``WorkerLogRelay.open_streams``); the Supervisor closes
        its copies once the launch is sent. None by default."""
        return ()

    def invocation_ended(self, worker_id: str, cause: str | None) -> None: ...
    def exit_details(self, worker_id: str, exitcode: int) -> dict[str, Any]:
        """What the Worker reported about its failure (exception_type, frames); {} if none."""
        return {}


class Supervisor:
    def __init__(
        self,
        key: str,
        families: list[Family],
        backend: SqlBackend,
        pool: WorkerPool,
        *,
        database_url: str,
        worker_settings: dict[str, str] | None = None,
        hooks: Hooks | None = None,
        rng: random.Random | None = None,
        backoff: Backoff | None = None,
    ) -> None:
        self.key = key
        self.families = {f.name: f for f in families}
        self.backend = backend
        self.pool = pool
        self.database_url = database_url
        self.worker_settings = dict(worker_settings or {})
        self.hooks = hooks or Hooks()
        self.rng = rng or random.Random()
        self.backoff = backoff  # None: the RFC §7 default (about 30 s doubling to 30 min)
        self.core: Scheduler | None = None
        self.core_since = datetime.max  # see BACKOFF_TERM_MARGIN; set with each core
        self.term: Term | None = None
        #: Whether the held term may still act on this host's own clock (its renew deadline;
        #: set by the host on elected backends, ``apsup.supervisor.lease_keeper``).
        self.lease_valid: Callable[[], bool] = _always
        #: The longest a family waits after failed steps in a row (the first error costs it
        #: about one poll); the host lowers it to its renewal interval.
        self.error_delay_max = ERROR_DELAY_MAX
        self.running: dict[str, Invocation] = {}
        self.clock_offset = timedelta(0)
        self.completed: dict[str, int] = {name: 0 for name in self.families}
        self.failed: dict[str, int] = {name: 0 for name in self.families}
        self.degraded: dict[str, str] = {}
        #: Families whose reconciliation failed: degraded until a retry (at each of their
        #: checks) succeeds, however well their generic discovery works meanwhile.
        self.unreconciled: dict[str, str] = {}
        #: Reconciliations in progress, paged across loop iterations (see ``reconcile_step``).
        self.reconciling: dict[str, _Reconciliation] = {}
        #: Why the held term is not established yet (None once it is, or when no term is held).
        self.establish_error: str | None = None
        self.establish_failures = 0
        self._establish_due = 0.0
        #: Confirmed exits awaiting classification (their keys stay occupied meanwhile).
        self.unclassified: dict[str, _Unclassified] = {}
        #: Dispatch reads made ahead: (binding, Scope) -> (row, monotonic read time, term
        #: generation) (``_dispatch_row``; a row is used once, by its term, while fresh).
        self._rows: dict[tuple[str, str], tuple[intents.Intent | None, float, int]] = {}
        #: Exits confirmed (capacity freed) and waiting for ``classify_exits``; since when.
        self._exited: list[WorkerExit] = []
        self._exited_since = 0.0
        self._more_due = False  # the last step() stopped at max_steps with decisions left
        #: Families whose last database write was refused by the storage (disk full, read-only,
        #: I/O): an infrastructure condition, degraded until one of their writes succeeds.
        self.storage_unavailable: dict[str, str] = {}
        #: Operator actions and each Scope's failure state (``operator_controls``).
        self.controls = OperatorControls(self.families, backend)
        #: Workers an operator stopped (``apsup scopes stop``): their exit says so.
        self.operator_stopped: set[str] = set()
        #: The replica this Supervisor is handing its term to (dedicated scale-out,
        #: ``apsup.supervisor.placement``): it admits nothing new while its Workers finish.
        self.handing_off: str | None = None
        #: When this term first saw each unacknowledged request (``request_ages``).
        self.request_ages = RequestAges()

    # -- time ------------------------------------------------------------------------------
    def sync_clock(self, measured: tuple[datetime, float] | None = None) -> None:
        """Database time is authoritative; estimate it locally between measurements.
        ``measured``: (database time, monotonic time when it was read), e.g. by a renewal,
        instead of a query of its own."""
        if measured is not None:
            db_time, at = measured
            local = datetime.utcnow() - timedelta(seconds=time.monotonic() - at)
            self.clock_offset = db_time - local
            return
        local = datetime.utcnow()
        self.clock_offset = self.backend.now() - local

    def now(self) -> datetime:
        return datetime.utcnow() + self.clock_offset

    # -- leadership ------------------------------------------------------------------------
    @property
    def leader(self) -> bool:
        """Holds a term within its renew deadline; it dispatches only once ``established``."""
        return self.term is not None and self.lease_valid()

    @property
    def established(self) -> bool:
        """The term's core is restored: this Supervisor schedules and dispatches."""
        return self.term is not None and self.core is not None and self.lease_valid()

    def become_leader(self, term: Term) -> bool:
        """Hold ``term`` and try to establish it at once. A failed establishment is retried by
        ``establish()`` (bounded backoff) while the host keeps renewing the Lease; until then the
        Supervisor dispatches nothing and reports itself not ready."""
        self.term = term
        self.core = None
        self.handing_off = None
        self.request_ages.clear()
        self.reconciling.clear()
        self.establish_error = None
        self.establish_failures = 0
        self._establish_due = 0.0
        return self.establish()

    def establish(self) -> bool:
        """Sync the clock and load every family's check state under the term (one fenced
        transaction), then build the core. Families with a reconciler are restored when their
        reconciliation ends (``reconcile_step``), the others at once. Returns whether the term is
        established; never raises (a stale term drops the term instead)."""
        term = self.term
        if term is None:
            return False
        if self.core is not None:
            return True
        if time.monotonic() < self._establish_due:
            return False
        stage = "sync_clock"
        try:
            self.sync_clock()
            stage = "load"
            states = self.backend.run_fenced(
                term, functools.partial(_load_states, list(self.families.values()))
            )
            stage = "controls"
            with self.backend.read() as conn:
                self.controls.load(conn)
        except StaleTermError as exc:
            self.lose_leadership(f"stale term while establishing: {exc}")
            return False
        except Exception as exc:
            self.establish_failures += 1
            delay = ESTABLISH_BACKOFF.delay(self.establish_failures)
            self._establish_due = time.monotonic() + delay
            self.establish_error = (
                f"term not established ({stage}: {type(exc).__name__}: {exception_message(exc)})"
            )
            log.error(
                "term establishment failed",
                extra={
                    "supervisor_key": self.key,
                    "term": term.generation,
                    "stage": stage,
                    **error_fields(exc),
                    "retry_count": self.establish_failures,
                    "retry_delay": round(delay, 3),
                },
            )
            return False
        core = Scheduler(
            [FamilySpec(f.name, f.policy, f.max_workers) for f in self.families.values()],
            rng=self.rng,
            backoff=self.backoff,
            error_delay=min(ERROR_DELAY, self.error_delay_max),
            error_delay_max=self.error_delay_max,
        )
        for name, st in states.items():
            state = BindingState(
                st.checkpoint,
                st.scan_generation,
                st.scan_in_progress,
                st.scan_upper_pending_sequence,
            )
            if self.families[name].reconcile is None:
                core.restore(name, state)
            else:
                self.reconciling[name] = _Reconciliation(state)
        self.controls.apply(core)
        self.core = core
        # Failures recorded after this (less a margin for the clocks of earlier terms' hosts)
        # are this term's: their keys wait in this core, so request pages may leave them out.
        self.core_since = self.now() + BACKOFF_TERM_MARGIN
        self.establish_error = None
        self.establish_failures = 0
        log.info(
            "term established",
            extra={"supervisor_key": self.key, "term": term.generation, "holder": term.holder_id},
        )
        return True

    def reconcile_step(self, budget: float = RECONCILE_SLICE_SECONDS) -> bool:
        """Run reconciliation pages (RFC §11: rebuild dirty state from bounded domain facts,
        never accept requests) round-robin over the families that need it, for at most
        ``budget`` seconds, then return to the loop so renewal keeps running. Resumes from the
        last token next time. A family is restored once its reconciliation ends; a failure
        degrades only that family, restores it anyway and is retried at its next check.
        Returns whether reconciliation remains."""
        core = self.core
        if core is None or self.term is None:
            return False
        deadline = time.monotonic() + budget
        while self.reconciling:
            for name in list(self.reconciling):
                run = self.reconciling[name]
                fam = self.families[name]
                reconcile = fam.reconcile
                assert reconcile is not None
                try:
                    token = self.backend.run(
                        functools.partial(_reconcile_page, reconcile, fam, run.token)
                    )
                except Exception as exc:
                    self.unreconciled[name] = (
                        f"reconcile: {type(exc).__name__}: {exception_message(exc)}"
                    )
                    log.error(
                        "reconciliation failed",
                        extra={
                            "family": name,
                            "stage": "reconcile",
                            **error_fields(exc),
                            "pages": run.pages,
                        },
                    )
                    self._end_reconciliation(core, name, run)
                    continue
                run.pages += 1
                run.token = token
                if token is None:
                    self.unreconciled.pop(name, None)
                    log.info(
                        "reconciliation completed",
                        extra={
                            "family": name,
                            "pages": run.pages,
                            "duration": round(time.monotonic() - run.started, 3),
                        },
                    )
                    self._end_reconciliation(core, name, run)
                elif run.pages % RECONCILE_LOG_PAGES == 0:
                    log.warning(
                        "reconciliation still running",
                        extra={
                            "family": name,
                            "pages": run.pages,
                            "duration": round(time.monotonic() - run.started, 3),
                        },
                    )
            if time.monotonic() >= deadline:
                break
        return bool(self.reconciling)

    def _end_reconciliation(self, core: Scheduler, name: str, run: _Reconciliation) -> None:
        del self.reconciling[name]
        if run.state is not None:
            core.restore(name, run.state)

    def lose_leadership(self, reason: str, level: int = logging.WARNING) -> None:
        """Stop dispatch at once. The host terminates every Worker of a Supervisor without a
        term, whichever path found the term stale (their commits are fenced anyway).
        ``level``: INFO for a planned handover, which is no incident."""
        if self.term is None:
            return
        log.log(
            level,
            "leadership lost",
            extra={"supervisor_key": self.key, "term": self.term.generation, "stage": reason},
        )
        self.term = None
        self.handing_off = None
        self.request_ages.clear()
        if self.core is not None:
            self.core.on_lease_lost()
        self.core = None
        self.reconciling.clear()
        self.establish_error = None
        self.establish_failures = 0

    # -- the decision loop -----------------------------------------------------------------
    def step(self, max_steps: int = 256, until: float | None = None) -> int:
        """Execute decisions until the core has none due now; returns how many ran.

        ``until`` (monotonic): stop early once it has passed, so lease renewal is never queued
        behind a long run of discovery statements (the host calls again right after renewing).
        """
        done = 0
        self._more_due = False
        if self.handing_off is not None:
            return 0  # handing over: nothing new starts, running Workers finish
        if self.term is not None and self.core is None:
            self.establish()
        if self.reconciling:
            self.reconcile_step()
        while self.core is not None and self.term is not None:
            if done >= max_steps:
                self._more_due = True  # more may be due now: the host must not sleep
                break
            if until is not None and done and time.monotonic() >= until:
                self._more_due = True  # renew first, then carry on at once
                break
            if not self.lease_valid():
                self.lose_leadership("renew deadline passed")  # the host stops its Workers
                break
            decision = self.core.decide(self.now())
            self._log_policy_errors()
            if decision is None:
                break
            done += 1
            try:
                self._execute(decision)
                self.degraded.pop(decision.family, None)  # its step went through
                if isinstance(decision, StartScan | Admit | EndScan):
                    self._storage_ok(decision.family)  # a write went through
            except StaleTermError as exc:
                self.lose_leadership(f"stale term: {exc}")
            except Exception as exc:  # one family's provider failure degrades only that family
                family = getattr(decision, "family", "?")
                stage = type(decision).__name__
                self._storage_failed(family, exc, stage)
                self.degraded[family] = f"{stage}: {type(exc).__name__}: {exception_message(exc)}"
                log.error(
                    "family step failed",
                    extra={
                        "family": family,
                        "binding": self.families[family].binding_name
                        if family in self.families
                        else family,
                        "stage": stage,
                        **error_fields(exc),
                        "term": self.term.generation if self.term else None,
                    },
                )
                if self.core is not None:
                    self.core.on_family_error(family, stage, self.now())
        return done

    def _execute(self, d: object) -> None:
        core, term = self.core, self.term
        assert core is not None and term is not None
        if isinstance(d, StartScan):
            fam = self.families[d.family]
            if d.rewound_from is not None:
                log.warning(
                    "schedule checkpoint ahead of database time: clamped (clock went back)",
                    extra={
                        "family": d.family,
                        "binding": fam.binding_name,
                        "stage": "schedule",
                        "checkpoint": d.checkpoint.isoformat(),
                        "rewound_from": d.rewound_from.isoformat(),
                    },
                )
            st = self.backend.run_fenced(
                term,
                lambda c: scans.start_scan(c, fam.binding_name, d.checkpoint, d.rewound_from),
            )
            self.hooks.on_scan_started(d.family)
            if d.family in self.unreconciled and d.family not in self.reconciling:
                self.reconciling[d.family] = _Reconciliation(None)  # retried beside dispatch
            core.on_scan_started(
                d.family,
                st.scan_generation,
                st.scan_upper_pending_sequence,
                st.checkpoint or d.checkpoint,
            )
            # A check also looks for requests whose notification was lost.
            core.on_notify(d.family)
        elif isinstance(d, FetchScanPage):
            fam = self.families[d.family]
            t0 = time.perf_counter()
            with self.backend.read() as conn:
                rows = intents.dirty_page(
                    conn, fam.binding_name, d.after_sequence, d.upper_sequence, d.limit
                )
            self.hooks.observe_discovery(d.family, time.perf_counter() - t0)
            core.on_scan_page(
                d.family,
                d.scan_generation,
                [ScanRow(s, seq, last) for s, seq, last in rows],
                len(rows) < d.limit,
            )
        elif isinstance(d, Admit):
            fam = self.families[d.family]
            ok = self.backend.run_fenced(
                term, lambda c: scans.admit(c, fam.binding_name, d.scope_id, d.scan_generation)
            )
            core.on_admitted(d.family, d.scope_id, ok)
        elif isinstance(d, EndScan):
            fam = self.families[d.family]
            self.backend.run_fenced(
                term, lambda c: scans.end_scan(c, fam.binding_name, d.scan_generation)
            )
            self.hooks.on_scan_completed(d.family)
            core.on_scan_ended(d.family, d.scan_generation)
        elif isinstance(d, FetchRequests):
            fam = self.families[d.family]
            t0 = time.perf_counter()
            with self.backend.read() as conn:
                rows2 = intents.request_page(
                    conn,
                    fam.binding_name,
                    d.after_sequence,
                    d.limit,
                    backoff_at=self.now() if d.skip_backoff else None,
                    failed_after=self.core_since,
                )
            self.hooks.observe_discovery(d.family, time.perf_counter() - t0)
            seen_at = time.monotonic()
            for scope_id, _ in rows2:
                self.request_ages.seen(d.family, scope_id, seen_at)
            core.on_request_page(
                d.family, [RequestRow(s, seq) for s, seq in rows2], len(rows2) < d.limit
            )
        elif isinstance(d, Dispatch):
            self._dispatch(d)
        else:  # pragma: no cover - the core's decision set is closed
            raise TypeError(f"unknown decision {d!r}")

    def _dispatch(self, d: Dispatch) -> None:
        core, term = self.core, self.term
        assert core is not None and term is not None
        fam = self.families[d.family]
        row = self._dispatch_row(fam, d.scope_id, core)
        if row is None or row.handled_generation >= row.requested_generation:
            # handled >= G: acknowledge completion without running (RFC §5).
            self.request_ages.handled(d.family, d.scope_id)
            core.on_dispatched(d.family, d.scope_id, False, token=d.token)
            return
        self.request_ages.seen(d.family, d.scope_id, time.monotonic())
        if not self.lease_valid():  # the deadline passed during the read: launch nothing
            self.lose_leadership("renew deadline passed")  # the core (and this dispatch) go
            return
        worker_id = uuid.uuid4().hex[:16]
        ctx = ExecutionContext(
            binding_name=fam.binding_name,
            artifact_family=fam.name,
            scope_id=d.scope_id,
            claimed_request_generation=row.requested_generation,
            supervisor_key=term.supervisor_key,
            holder_id=term.holder_id,
            supervisor_generation=term.generation,
            worker_id=worker_id,
            pending_sequence=row.pending_sequence,
            entry_point=fam.entry_point,
            database_url=self.database_url,
            settings=self.worker_settings,
            host_acknowledges=True,  # the read above was the duplicate check
        )
        inv = Invocation(
            fam,
            d.scope_id,
            row.requested_generation,
            worker_id,
            d.reason,
            time.monotonic(),
            d.token,
            term.generation,
            row.pending_sequence,
        )
        fields = _success_fields(inv, 0.0)
        streams: tuple[int, ...] = ()
        try:
            # Everything that may raise before the launch runs before the core is told:
            # an error here leaves the Dispatch in flight, and ``step`` undoes it whole (the
            # key goes back to the head of the ready queue, no capacity is held).
            ctx.trace_context = self.hooks.invocation_started(worker_id, fields)
            streams = self.hooks.launch_streams(worker_id, fields)
            payload = ctx.to_bytes()
        except BaseException:
            _close_fds(streams)
            with contextlib.suppress(Exception):
                self.hooks.invocation_ended(worker_id, "launch")
            raise
        core.on_dispatched(d.family, d.scope_id, True, token=d.token)
        self.running[worker_id] = inv
        try:
            # Sent, not waited for: the pool reads the pid when the forkserver reports it (the
            # host's wait set has its sentinel), so the loop goes on dispatching and handling
            # exits meanwhile; a launch that fails later comes back as an exit (``on_exit``).
            self.pool.submit(worker_id, TARGET, payload, fam.timeout, streams)
        except Exception as exc:
            self._launch_failed(inv, type(exc).__name__, exception_message(exc))
            return
        finally:
            _close_fds(streams)  # the Worker has its own copies (or there is no Worker)
        try:
            self.hooks.on_dispatch(d.family)
        except Exception as exc:  # a metrics hook must not turn a launched Worker into an error
            log.error("dispatch hook failed", extra={"family": d.family, **error_fields(exc)})

    def _dispatch_row(self, fam: Family, scope_id: str, core: Scheduler) -> intents.Intent | None:
        """The dispatch read of ``scope_id``: taken from a read made ahead (with the keys an
        earlier dispatch read, or with the last acknowledgments), else read now together with
        the keys the next dispatches will take (one statement on MySQL).

        A row read a little before its launch is as good as one read right before it: no other
        Worker can acknowledge a READY key (an acknowledgment needs this term, which runs none
        for it), so ``handled`` cannot move meanwhile; ``requested`` may grow, and a request
        that arrives during the run is seen at the exit, as always. A row is used once, only
        by the term that read it, and only for ``READ_AHEAD_SECONDS``."""
        key = (fam.binding_name, scope_id)
        self._prune_rows()
        if key in self._rows:
            return self._rows.pop(key)[0]  # used once
        ahead = [k for k in core.peek_ready(fam.name) if (fam.binding_name, k) not in self._rows]
        rows = self.backend.read_intents(fam.binding_name, [scope_id, *ahead])
        self._keep_rows({(fam.binding_name, other): rows.get(other) for other in ahead})
        return rows.get(scope_id)

    def _keep_rows(self, rows: dict[tuple[str, str], intents.Intent | None]) -> None:
        if self.term is not None and rows:
            now, generation = time.monotonic(), self.term.generation
            self._rows.update((k, (row, now, generation)) for k, row in rows.items())

    def _prune_rows(self) -> None:
        """Drop the rows read ahead that no dispatch may use any more (old, or another term's)."""
        now, generation = time.monotonic(), self.term.generation if self.term else None
        stale = [
            k
            for k, (_, at, g) in self._rows.items()
            if g != generation or now - at > READ_AHEAD_SECONDS
        ]
        for k in stale:
            del self._rows[k]

    def _launch_failed(self, inv: Invocation, error: str, message: str | None = None) -> None:
        """Nothing started: report a failed invocation so the key backs off and retries."""
        message = message or f"the Worker could not be launched ({error})"
        log.error(
            "worker launch failed",
            extra={
                "family": inv.family.name,
                "scope": inv.scope_id,
                "worker_id": inv.worker_id,
                "exception_type": error,
                "error": message,
                "stage": "launch",
            },
        )
        self.running.pop(inv.worker_id, None)
        self.failed[inv.family.name] += 1
        if self.core is None or self.term is None or self.term.generation != inv.term_generation:
            return
        self.core.on_worker_exit(
            inv.family.name, inv.scope_id, Outcome.FAILURE, False, self.now(), token=inv.token
        )
        self._record_failure(inv, error, message)

    # -- worker exits ------------------------------------------------------------------------
    def owns(self, worker_id: str) -> bool:
        return worker_id in self.running

    def on_exits(self, exits: Sequence[WorkerExit]) -> None:
        """Exits confirmed together (one poll of the pool). Each Worker's capacity is free at
        once (its key stays occupied until the exit is classified), and the exits are kept for
        ``classify_exits``, which the host calls after this cycle's dispatches: the
        acknowledgments and reads that decide the outcomes then do not delay the Workers that
        take the freed slots."""
        core, term = self.core, self.term
        for ex in exits:
            inv = self.running.get(ex.worker_id)
            if inv is None:
                continue
            if not self._exited:
                self._exited_since = time.monotonic()
            if (
                ex.launch_error is None
                and core is not None
                and term is not None
                and term.generation == inv.term_generation
            ):
                core.on_worker_exited(inv.family.name, inv.scope_id, token=inv.token)
            self._exited.append(ex)

    def classify_exits(self, hold: bool = False) -> None:
        """Classify the exits ``on_exits`` kept: the acknowledgments they ask the Supervisor
        for in one fenced transaction (which also reads the rows the next dispatches will
        take), then each exit. An exit whose classification raised stays queued. ``hold``
        (the host's cycle): while other Workers run, not before ``ACK_HOLD_SECONDS`` after
        the first of them, so that the exits close to it share the transaction."""
        pending = self._exited
        if not pending:
            return
        if hold and self.classify_due() is not None:
            gone = {ex.worker_id for ex in pending}
            if any(w not in gone and w not in self.unclassified for w in self.running):
                return
        asking = [
            self.running[ex.worker_id]
            for ex in pending
            if asks_acknowledgment(ex.exitcode, ex.vouched)
            and ex.launch_error is None
            and ex.worker_id in self.running
        ]
        done = self._acknowledge_for(asking, self._reads_ahead()) if asking else {}
        while pending:
            ex = pending.pop(0)
            try:
                self.on_exit(ex, done.pop(ex.worker_id, None))
            except BaseException:
                pending.append(ex)  # not lost: classified again at the next call
                raise

    def classify_due(self) -> float | None:
        """When the held exits are classified at the latest (monotonic); None when none is
        held, or the hold is over (then the next cycle classifies them, as any other stage's
        work: a classification that keeps failing does not make the loop spin)."""
        if not self._exited:
            return None
        due = self._exited_since + ACK_HOLD_SECONDS
        return due if due > time.monotonic() else None

    def _reads_ahead(self) -> list[tuple[str, list[str]]]:
        """Per binding, the keys the dispatches after the running Workers' exits will take, for
        ``READ_AHEAD_TURNS`` turns of each slot (those not read ahead already): their rows are
        read in the acknowledgments' round trip and used by the dispatches into the slots
        those exits free until the next acknowledgment (``_dispatch_row``)."""
        core = self.core
        if core is None or self.term is None:
            return []
        self._prune_rows()
        reads = []
        for name, fam in self.families.items():
            running = core.running_count(name)
            if not running:
                continue
            binding = fam.binding_name
            ahead = [
                k
                for k in core.peek_ready(name, extra=running * READ_AHEAD_TURNS)
                if (binding, k) not in self._rows
            ]
            if ahead:
                reads.append((binding, ahead))
        return reads

    def on_exit(self, ex: WorkerExit, acknowledged: _Acknowledged | None = None) -> None:
        """A Worker's exit is confirmed: classify it from its code and the durable state
        (``acknowledged``: its acknowledgment, already made with others by ``on_exits``).

        Classification reads the intent row; if that read fails, the exit is kept and retried
        (``retry_classification``) and the key stays occupied until it can be classified, so a
        database blip neither kills the host nor frees a key whose outcome is unknown."""
        inv = self.running.get(ex.worker_id)
        if inv is None:
            return
        if ex.launch_error is not None and ex.terminated:
            # Stopped (shutdown, lease loss) before the forkserver forked it: nothing ran.
            del self.running[ex.worker_id]
            log.info("worker launch stopped before it started", extra={"worker_id": inv.worker_id})
            return
        if ex.launch_error is not None:
            self._launch_failed(inv, ex.launch_error)
            return
        fam = inv.family
        try:
            requested: int | None = None
            if asks_acknowledgment(ex.exitcode, ex.vouched):
                if acknowledged is None:
                    acknowledged = self._acknowledge_for([inv])[inv.worker_id]
                if isinstance(acknowledged, Exception):
                    raise acknowledged
                code, requested = acknowledged
                ex = replace(ex, exitcode=code, vouched=True)  # the host's own word
            if requested is not None:  # moved to G by us just now: no read needed
                handled, more = True, requested > inv.generation
            else:
                row = self.backend.read_intent(fam.binding_name, inv.scope_id)
                handled = row is not None and row.handled_generation >= inv.generation
                more = row is not None and row.requested_generation > row.handled_generation
        except Exception as exc:
            pending = self.unclassified.get(ex.worker_id)
            attempts = 1 if pending is None else pending.attempts + 1
            delay = min(CLASSIFY_RETRY_MAX, CLASSIFY_RETRY_INITIAL * 2 ** (attempts - 1))
            self.unclassified[ex.worker_id] = _Unclassified(ex, attempts, time.monotonic() + delay)
            log.warning(
                "worker exit not classified yet",
                extra={
                    "family": fam.name,
                    "scope": inv.scope_id,
                    "worker_id": inv.worker_id,
                    "stage": "classify",
                    **error_fields(exc),
                    "retry_count": attempts,
                    "retry_delay": round(delay, 3),
                },
            )
            return
        self.unclassified.pop(ex.worker_id, None)
        del self.running[ex.worker_id]
        if handled and self.term is not None and self.term.generation == inv.term_generation:
            self.request_ages.handled(fam.name, inv.scope_id, inv.started if more else None)
        stale = ex.vouched and ex.exitcode == ExitCode.STALE_TERM and not ex.timed_out
        term_valid = (
            stale
            and self.term is not None
            and self.term.generation == inv.term_generation
            and self._term_still_valid()
        )
        outcome, cause = classify(
            ExitFacts(ex.exitcode, ex.vouched, ex.timed_out, handled, term_valid)
        )
        self.hooks.on_exit(fam.name, cause, ex.duration)
        if cause == "storage":
            self._storage_failed(fam.name, STORAGE_EXITS[ex.exitcode], "invoke")
        elif outcome is Outcome.SUCCESS:
            self._storage_ok(fam.name)
        self.hooks.invocation_ended(inv.worker_id, cause)
        stopped = inv.worker_id in self.operator_stopped and outcome is not Outcome.SUCCESS
        if outcome is Outcome.SUCCESS:
            self.completed[fam.name] += 1
        elif outcome is not Outcome.CONFLICT and not stopped:
            self.failed[fam.name] += 1
        if self.core is None or self.term is None or self.term.generation != inv.term_generation:
            return  # dispatched by an earlier term: the current one recovers from durable facts
        if outcome is Outcome.FAILURE and cause == "stale_term":
            self.lose_leadership("a Worker found the term stale")
            return
        if stopped:
            self._stopped_by_operator(inv, outcome, cause, ex)
            return
        prior = 0
        if outcome is Outcome.FAILURE or outcome is Outcome.TIMEOUT:
            info = self.core.key_info(fam.name, inv.scope_id)
            if info is not None and info.consecutive_failures == 0:  # its first in this term
                prior = self.controls.prior_failures(fam.name, inv.scope_id)
        self.core.on_worker_exit(
            fam.name, inv.scope_id, outcome, more, self.now(), token=inv.token, prior_failures=prior
        )
        self.operator_stopped.discard(inv.worker_id)  # it finished before the stop reached it
        if outcome is Outcome.SUCCESS:
            if not self.controls.on_success(self.term, fam.name, inv.scope_id):
                self.core.on_notify(fam.name, full=True)  # its stale backoff must not hide it
            if log.isEnabledFor(logging.DEBUG):
                log.debug("invocation succeeded", extra=_success_fields(inv, ex.duration))
        if outcome is not Outcome.SUCCESS:
            details = self.hooks.exit_details(inv.worker_id, ex.exitcode)
            if not details.get("error") and details.get("exception_type"):
                details["error"] = (
                    f"the processor raised {details['exception_type']}; its message is withheld "
                    "(the family sets log_exception_messages=False)"
                )
            elif not details.get("error"):
                details["error"] = _exit_error(cause, ex, fam.timeout)
            info = self.core.key_info(fam.name, inv.scope_id)
            retry_at = info.retry_at if info is not None else None
            if outcome is Outcome.FAILURE or outcome is Outcome.TIMEOUT:
                self.controls.on_failure(
                    self.term,
                    fam.name,
                    inv.scope_id,
                    failures=info.consecutive_failures if info is not None else 1,
                    error_type=details.get("exception_type") or cause,
                    error=details.get("error"),
                    at=self.now(),
                    next_attempt_at=retry_at,
                )
            log.warning(
                "invocation failed",
                extra={
                    "binding": fam.binding_name,
                    "family": fam.name,
                    "scope": inv.scope_id,
                    "trigger": inv.reason,
                    "request_generation": inv.generation,
                    "worker_id": inv.worker_id,
                    "term": self.term.generation if self.term else None,
                    "stage": "invoke",
                    # the cause class; a refused database write is the host's condition
                    "error_code": "infrastructure" if cause == "storage" else cause,
                    "exit_code": ex.exitcode,
                    "exception_type": details.pop("exception_type", None),
                    **details,
                    "retry_count": info.consecutive_failures if info is not None else None,
                    "retry_delay": (
                        round((retry_at - self.now()).total_seconds(), 3) if retry_at else None
                    ),
                },
            )

    def _stopped_by_operator(
        self, inv: Invocation, outcome: Outcome, cause: str | None, ex: WorkerExit
    ) -> None:
        """An invocation the operator stopped (``apsup scopes stop``): not a failure. It counts
        no failure and sets no backoff (the Scope is parked, its requests kept), so an unpark
        runs them within a poll; the failure state keeps what it had."""
        self.operator_stopped.discard(inv.worker_id)
        assert self.core is not None
        # Freed like a finished key: the parked Scope is not dispatched, and a request pass
        # finds its pending requests when it is unparked.
        self.core.on_worker_exit(
            inv.family.name, inv.scope_id, Outcome.SUCCESS, False, self.now(), token=inv.token
        )
        log.info(
            "invocation stopped by the operator",
            extra={
                "binding": inv.family.binding_name,
                "family": inv.family.name,
                "scope": inv.scope_id,
                "worker_id": inv.worker_id,
                "term": self.term.generation if self.term else None,
                "exit_code": ex.exitcode,
                "error_code": cause,
                "outcome": outcome.name.lower(),
            },
        )

    def _record_failure(self, inv: Invocation, error_type: str, message: str) -> None:
        """A launch failure counts as the Scope's failure (its key backs off like one)."""
        if self.core is None or self.term is None:
            return
        info = self.core.key_info(inv.family.name, inv.scope_id)
        self.controls.on_failure(
            self.term,
            inv.family.name,
            inv.scope_id,
            failures=info.consecutive_failures if info is not None else 1,
            error_type=error_type,
            error=message,
            at=self.now(),
            next_attempt_at=info.retry_at if info is not None else None,
        )

    # -- operator actions ---------------------------------------------------------------------
    def refresh_controls(self, controls: dict[str, FamilyControl]) -> None:
        """Apply operator actions whose family control version moved (see
        ``operator_controls``); the host calls it with every request poll and wake-up."""
        if self.core is None or self.term is None:
            return
        self.controls.refresh(controls, self.core, self.term, self.now(), self._stop_scope)

    def _stop_scope(self, family: str, scope_id: str) -> bool:
        """End the running invocation of (family, scope): SIGTERM now, SIGKILL after the pool's
        grace; its exit is recorded as stopped by the operator. False if none runs."""
        for wid, inv in self.running.items():
            if inv.family.name == family and inv.scope_id == scope_id:
                self.operator_stopped.add(wid)
                self.pool.terminate([wid])
                return True
        return False

    def _storage_failed(self, family: str, error: BaseException | str, stage: str) -> None:
        """Record a storage-level refusal (no-op for any other error): log the transition,
        count it, degrade the family until a write succeeds."""
        kind = error if isinstance(error, str) else storage_error_kind(error)
        if kind is None or family not in self.families:
            return
        self.hooks.on_storage_error(family, kind)
        if family not in self.storage_unavailable:
            log.error(
                "storage unavailable: the database cannot write",
                extra={
                    "family": family,
                    "stage": stage,
                    "error_code": kind,
                    "reason": DESCRIBE.get(kind, kind),
                },
            )
        self.storage_unavailable[family] = f"storage: {DESCRIBE.get(kind, kind)}"

    def _storage_ok(self, family: str) -> None:
        if self.storage_unavailable.pop(family, None) is not None:
            log.warning("storage writable again", extra={"family": family})

    def unconfirmed(self) -> dict[str, int]:
        """Per family: Workers of ours whose exit the pool cannot confirm (yet)."""
        counts = dict.fromkeys(self.families, 0)
        for handle in self.pool.unconfirmed():
            inv = self.running.get(handle.worker_id)
            if inv is not None:
                counts[inv.family.name] += 1
        return counts

    def _term_still_valid(self) -> bool:
        """Ask the database whether our term still stands (a Worker reported it stale)."""
        if self.term is None:
            return False
        try:
            with self.backend.transaction() as conn:
                self.backend.check_term(conn, self.term)
        except StaleTermError:
            return False
        except Exception:
            return True  # unknown: the host's renewal decides
        return True

    def _acknowledge_for(
        self, invs: Sequence[Invocation], reads: Reads = ()
    ) -> dict[str, _Acknowledged]:
        """The Workers' processors returned without acknowledging
        (``ExitCode.RETURNED_UNACKNOWLEDGED``): acknowledge each G now, fenced by the term that
        dispatched it, exactly as the Worker's own final transaction would have (idempotent: a retry
        finds it done); the exits of one term go in one transaction. Per Worker: the exit code it
        would have had (SUCCESS; STALE_TERM when that term is no longer the valid one, and then
        nothing was written for it; PROGRESS_CONFLICT when the Scope's row was deleted or recreated;
        a storage code when the database refused the write), and the row's requested generation when
        this call moved it to G and the backend read it in the same statement (else None:
        classification reads the row); or the error that left it undecided (the exit stays
        unclassified and this is retried). ``reads``: rows to read in the current term's transaction
        for the next dispatches (kept in ``_rows``)."""
        out: dict[str, _Acknowledged] = {}
        key = self.term
        if key is None:  # no term left to acknowledge under
            return {inv.worker_id: (ExitCode.STALE_TERM, None) for inv in invs}
        by_term: dict[int, list[Invocation]] = {}
        for inv in invs:
            by_term.setdefault(inv.term_generation, []).append(inv)
        for generation, group in by_term.items():
            term = Term(key.supervisor_key, key.holder_id, generation)
            exits = [
                ExitAck(inv.family.binding_name, inv.scope_id, inv.generation, inv.pending_sequence)
                for inv in group
            ]
            results: list[AckResult | Exception]
            try:
                current = generation == key.generation
                acked, rows = self.backend.acknowledge_exits_and_read(
                    term, exits, reads if current else ()
                )
                results = list(acked)
                self._keep_rows(rows)
            except StaleTermError as exc:
                results = [exc] * len(group)
            except Exception as exc:
                kind = storage_error_kind(exc)
                results = [exc] * len(group)
                if kind is not None:
                    out.update((inv.worker_id, (STORAGE_EXIT_CODES[kind], None)) for inv in group)
                    continue
            for inv, result in zip(group, results, strict=True):
                if isinstance(result, StaleTermError):
                    out[inv.worker_id] = (ExitCode.STALE_TERM, None)
                elif isinstance(result, IntentError | ProgressConflict):
                    out[inv.worker_id] = (ExitCode.PROGRESS_CONFLICT, None)
                elif isinstance(result, Exception):
                    out[inv.worker_id] = result
                else:
                    out[inv.worker_id] = (ExitCode.SUCCESS, result)
        return out

    def retry_classification(self) -> None:
        """Classify again the exits whose classification failed, when their retry is due."""
        now = time.monotonic()
        for pending in list(self.unclassified.values()):
            if pending.due <= now:
                self.on_exit(pending.exit)

    def _log_policy_errors(self) -> None:
        core = self.core
        if core is None:
            return
        while core.policy_errors:
            family, error = core.policy_errors.popleft()
            log.error(
                "family policy cannot compute its next check",
                extra={
                    "family": family,
                    "stage": "policy",
                    "exception_type": error,
                    "term": self.term.generation if self.term else None,
                },
            )

    def next_wakeup(self) -> datetime | None:
        """When this Supervisor next needs the loop without an event (None: only on events)."""
        now = self.now()
        mono = time.monotonic()
        times: list[datetime] = []
        if self.handing_off is not None:  # only exits matter until the term is released
            if self.unclassified:
                due = min(p.due for p in self.unclassified.values())
                return now + timedelta(seconds=max(0.0, due - mono))
            return None
        if self._more_due or self.reconciling:
            times.append(now)
        if self.term is not None and self.core is None:
            times.append(now + timedelta(seconds=max(0.0, self._establish_due - mono)))
        if self.unclassified:
            due = min(p.due for p in self.unclassified.values())
            times.append(now + timedelta(seconds=max(0.0, due - mono)))
        if self.core is not None:
            core_due = self.core.next_wakeup(now)
            if core_due is not None:
                times.append(core_due)
        return min(times, default=None)

    def notify(self, family: str, *, new_requests: bool = True) -> None:
        """A request notification for ``family``. ``new_requests``: it announces requests
        committed since it was sent (a publisher's wake-up; not the poll, which reports any
        pending request): the family's rows read ahead are dropped, so a key queued when a
        request for it arrived starts with that request's G (queued requests coalesce into
        the invocation that starts) instead of an older one and a successor after it."""
        if family not in self.families:
            return
        if new_requests and self._rows:
            binding = self.families[family].binding_name
            for key in [k for k in self._rows if k[0] == binding]:
                del self._rows[key]
        if self.core is not None:
            self.core.on_notify(family)

    def notify_all(self) -> None:
        for name in self.families:
            self.notify(name)


def _exit_error(cause: str | None, ex: WorkerExit, timeout: float) -> str:
    """Why an invocation failed when its processor raised nothing the host heard of."""
    if cause == "timeout":
        return f"timed out after {timeout:g}s (the family's WORKER_TIMEOUT_SECONDS)"
    if cause == "no_ack":
        return "exited 0 without acknowledging its request (a durable acknowledgment is missing)"
    if cause == "stale_term":
        return "its term was superseded before it could commit"
    if ex.signal is not None:
        try:
            name = signal.Signals(ex.signal).name
        except ValueError:
            name = f"signal {ex.signal}"
        return f"the Worker was killed by {name}"
    if not ex.vouched and ex.exitcode > 0:
        return (
            f"the Worker exited with code {ex.exitcode} on its own (sys.exit or os._exit in the "
            "processor?): an exit status is no acknowledgment, only a return from the processor is"
        )
    return f"the Worker exited with code {ex.exitcode} ({ex.reason})"


def _success_fields(inv: Invocation, duration: float) -> dict[str, Any]:
    return {
        "binding": inv.family.binding_name,
        "family": inv.family.name,
        "scope": inv.scope_id,
        "trigger": inv.reason,
        "request_generation": inv.generation,
        "worker_id": inv.worker_id,
        "term": inv.term_generation,
        "duration": round(duration, 3),
    }


def _always() -> bool:
    return True


def _close_fds(fds: Sequence[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
