"""One logical Supervisor: the IO shell that executes the sans-IO core's decisions.

A Supervisor owns one Lease key (``global`` or ``artifact:<family>``) and the families under it.
It turns each decision into one short database step or one Worker launch and feeds the result
back to the core. Database errors of one family degrade only that family; a stale term is a
control event that stops everything of this Supervisor (RFC §1, §7, §8).
"""

from __future__ import annotations

import functools
import logging
import random
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection

from apsup.context import ExecutionContext
from apsup.errors import StaleTermError
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
from apsup.store.leases import Term
from apsup.workers.exit_codes import ExitCode
from apsup.workers.invoke import TARGET
from apsup.workers.pool import WorkerExit, WorkerPool

log = logging.getLogger("apsup.supervisor")


def _reconcile_page(reconcile: Reconciler, fam: Family, token: object, conn: Connection) -> object:
    return reconcile(conn, fam, token)


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


class Hooks:
    """Observability hooks; the default does nothing (metrics plug in here)."""

    def on_dispatch(self, family: str) -> None: ...
    def on_exit(self, family: str, cause: str | None, duration: float) -> None: ...
    def on_scan_started(self, family: str) -> None: ...
    def on_scan_completed(self, family: str) -> None: ...
    def observe_discovery(self, family: str, seconds: float) -> None: ...
    def invocation_started(self, worker_id: str, fields: dict[str, Any]) -> dict[str, str]:
        """Trace context for the Worker (tracing: ``apsup.observability.tracing``)."""
        return {}

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
        self.term: Term | None = None
        self.running: dict[str, Invocation] = {}
        self.clock_offset = timedelta(0)
        self.completed: dict[str, int] = {name: 0 for name in self.families}
        self.failed: dict[str, int] = {name: 0 for name in self.families}
        self.degraded: dict[str, str] = {}
        #: Families whose reconciliation failed: degraded until a retry (at each of their
        #: checks) succeeds, however well their generic discovery works meanwhile.
        self.unreconciled: dict[str, str] = {}

    # -- time ------------------------------------------------------------------------------
    def sync_clock(self) -> None:
        """Database time is authoritative; estimate it locally between measurements."""
        local = datetime.utcnow()
        self.clock_offset = self.backend.now() - local

    def now(self) -> datetime:
        return datetime.utcnow() + self.clock_offset

    # -- leadership ------------------------------------------------------------------------
    @property
    def leader(self) -> bool:
        return self.term is not None

    def become_leader(self, term: Term) -> None:
        """Establish a term: load check state, restore requests and unfinished scans."""
        self.term = term
        self.sync_clock()
        self.core = Scheduler(
            [FamilySpec(f.name, f.policy, f.max_workers) for f in self.families.values()],
            rng=self.rng,
            backoff=self.backoff,
        )

        def load(conn: Connection) -> dict[str, scans.ScanState]:
            return {
                f.name: scans.ensure_state(conn, f.binding_name) for f in self.families.values()
            }

        self.reconcile()
        for name, st in self.backend.run_fenced(term, load).items():
            self.core.restore(
                name,
                BindingState(
                    st.checkpoint,
                    st.scan_generation,
                    st.scan_in_progress,
                    st.scan_upper_pending_sequence,
                ),
            )
        log.info(
            "term established",
            extra={"supervisor_key": self.key, "term": term.generation, "holder": term.holder_id},
        )

    def reconcile(self, max_pages: int = 1000, only: str | None = None) -> None:
        """Run each family's reconciler page by page (RFC §11): it rebuilds dirty state from
        bounded domain facts and never accepts requests, so disabled admission stays disabled.
        A failure degrades only that family; it is retried at the family's next check."""
        for fam in self.families.values():
            reconcile = fam.reconcile
            if reconcile is None or (only is not None and fam.name != only):
                continue
            token: object = None
            for _ in range(max_pages):
                try:
                    token = self.backend.run(
                        functools.partial(_reconcile_page, reconcile, fam, token)
                    )
                except Exception as exc:
                    self.unreconciled[fam.name] = f"reconcile: {type(exc).__name__}"
                    log.error(
                        "reconciliation failed",
                        extra={
                            "family": fam.name,
                            "stage": "reconcile",
                            "exception_type": type(exc).__name__,
                        },
                    )
                    break
                if token is None:
                    self.unreconciled.pop(fam.name, None)
                    break

    def lose_leadership(self, reason: str) -> None:
        """Stop dispatch at once; Workers are terminated by the host (their commits are fenced)."""
        if self.term is None:
            return
        log.warning(
            "leadership lost",
            extra={"supervisor_key": self.key, "term": self.term.generation, "stage": reason},
        )
        self.term = None
        if self.core is not None:
            self.core.on_lease_lost()
        self.core = None

    # -- the decision loop -----------------------------------------------------------------
    def step(self, max_steps: int = 256) -> int:
        """Execute decisions until the core has none due now; returns how many ran."""
        done = 0
        while done < max_steps and self.core is not None and self.term is not None:
            decision = self.core.decide(self.now())
            if decision is None:
                break
            done += 1
            try:
                self._execute(decision)
            except StaleTermError as exc:
                self.lose_leadership(f"stale term: {exc}")
            except Exception as exc:  # one family's provider failure degrades only that family
                family = getattr(decision, "family", "?")
                stage = type(decision).__name__
                self.degraded[family] = f"{stage}: {type(exc).__name__}"
                log.error(
                    "family step failed",
                    extra={
                        "family": family,
                        "binding": self.families[family].binding_name
                        if family in self.families
                        else family,
                        "stage": stage,
                        "exception_type": type(exc).__name__,
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
            st = self.backend.run_fenced(
                term, lambda c: scans.start_scan(c, fam.binding_name, d.checkpoint)
            )
            self.hooks.on_scan_started(d.family)
            if d.family in self.unreconciled:
                self.reconcile(only=d.family)
            core.on_scan_started(
                d.family, st.scan_generation, st.scan_upper_pending_sequence, d.checkpoint
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
            self.degraded.pop(d.family, None)
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
                rows2 = intents.request_page(conn, fam.binding_name, d.after_sequence, d.limit)
            self.hooks.observe_discovery(d.family, time.perf_counter() - t0)
            self.degraded.pop(d.family, None)
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
        with self.backend.read() as conn:
            row = intents.get(conn, fam.binding_name, d.scope_id)
        if row is None or row.handled_generation >= row.requested_generation:
            # handled >= G: acknowledge completion without running (RFC §5).
            core.on_dispatched(d.family, d.scope_id, False, token=d.token)
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
        )
        core.on_dispatched(d.family, d.scope_id, True, token=d.token)
        self.running[worker_id] = Invocation(
            fam,
            d.scope_id,
            row.requested_generation,
            worker_id,
            d.reason,
            time.monotonic(),
            d.token,
            term.generation,
        )
        self.hooks.on_dispatch(d.family)
        ctx.trace_context = self.hooks.invocation_started(
            worker_id, _success_fields(self.running[worker_id], 0.0)
        )
        try:
            self.pool.launch(worker_id, TARGET, ctx.to_bytes(), fam.timeout)
        except Exception as exc:
            # Nothing started: report a failed invocation so the key backs off and retries.
            log.error(
                "worker launch failed",
                extra={
                    "family": fam.name,
                    "scope": d.scope_id,
                    "worker_id": worker_id,
                    "exception_type": type(exc).__name__,
                    "stage": "launch",
                },
            )
            self.running.pop(worker_id, None)
            self.failed[fam.name] += 1
            core.on_worker_exit(
                d.family, d.scope_id, Outcome.FAILURE, False, self.now(), token=d.token
            )

    # -- worker exits ------------------------------------------------------------------------
    def owns(self, worker_id: str) -> bool:
        return worker_id in self.running

    def on_exit(self, ex: WorkerExit) -> None:
        """A Worker's exit is confirmed: classify it from its code and the durable state."""
        inv = self.running.pop(ex.worker_id, None)
        if inv is None:
            return
        fam = inv.family
        with self.backend.read() as conn:
            row = intents.get(conn, fam.binding_name, inv.scope_id)
        handled = row is not None and row.handled_generation >= inv.generation
        more = row is not None and row.requested_generation > row.handled_generation
        cause: str | None
        if ex.timed_out:
            outcome, cause = Outcome.TIMEOUT, "timeout"
        elif ex.exitcode == ExitCode.SUCCESS and handled:
            outcome, cause = Outcome.SUCCESS, None
        elif ex.exitcode == ExitCode.SUCCESS:
            outcome, cause = Outcome.FAILURE, "no_ack"  # exit 0 without durable ack
        elif ex.exitcode == ExitCode.PROGRESS_CONFLICT:
            outcome, cause = Outcome.CONFLICT, "conflict"
        elif ex.exitcode == ExitCode.STALE_TERM:
            outcome, cause = Outcome.FAILURE, "stale_term"
        elif ex.exitcode is not None and ex.exitcode < 0:
            outcome, cause = Outcome.FAILURE, "crash"
        else:
            outcome, cause = Outcome.FAILURE, "failure"
        self.hooks.on_exit(fam.name, cause, ex.duration)
        self.hooks.invocation_ended(inv.worker_id, cause)
        if outcome is Outcome.SUCCESS:
            self.completed[fam.name] += 1
        elif outcome is not Outcome.CONFLICT:
            self.failed[fam.name] += 1
        if self.core is None or self.term is None or self.term.generation != inv.term_generation:
            return  # dispatched by an earlier term: the current one recovers from durable facts
        if outcome is Outcome.FAILURE and cause == "stale_term" and not self._term_still_valid():
            self.lose_leadership("a Worker found the term stale")
            return
        self.core.on_worker_exit(fam.name, inv.scope_id, outcome, more, self.now(), token=inv.token)
        if outcome is Outcome.SUCCESS and log.isEnabledFor(logging.DEBUG):
            log.debug("invocation succeeded", extra=_success_fields(inv, ex.duration))
        if outcome is not Outcome.SUCCESS:
            details = self.hooks.exit_details(inv.worker_id, ex.exitcode)
            info = self.core.key_info(fam.name, inv.scope_id)
            retry_at = info.retry_at if info is not None else None
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
                    "error_code": cause,
                    "exit_code": ex.exitcode,
                    "exception_type": details.pop("exception_type", None),
                    **details,
                    "retry_count": info.consecutive_failures if info is not None else None,
                    "retry_delay": (
                        round((retry_at - self.now()).total_seconds(), 3) if retry_at else None
                    ),
                },
            )

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

    def next_wakeup(self) -> datetime | None:
        if self.core is None:
            return None
        return self.core.next_wakeup(self.now())

    def notify(self, family: str) -> None:
        if self.core is not None and family in self.families:
            self.core.on_notify(family)

    def notify_all(self) -> None:
        for name in self.families:
            self.notify(name)


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
