"""The host loop: one thread that drives one or more Supervisors and their Worker pool.

It sleeps until the earliest of: a Worker exit (pool sentinels), a control notification, a
signal, a schedule/retry deadline, a Worker timeout, and on MySQL the renewal and bounded
request-polling deadlines. The MySQL leader's poll for requests committed by other processes is
adaptive: one statement for all its families every ``POLL_FAST_SECONDS`` while it dispatches,
backing off to ``POLL_SECONDS`` once idle (docs/wake-ups.md says why). On SQLite it also checks
the database files' signature once a second (a ``stat``, not a query) to recover wake-ups that
never arrived; an idle SQLite host issues no database statement (RFC §8). See
``apsup.supervisor.control`` for the wake-up guarantee.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from types import FrameType

from apsup.observability.logging import error_fields, exception_message
from apsup.scheduling import Backoff
from apsup.store import SqlBackend, intents, membership, operator_state
from apsup.store.leases import ModeConflictError, Term, new_holder_id
from apsup.supervisor.activity_recorder import ActivityRecorder
from apsup.supervisor.control import ALL, ControlChannel
from apsup.supervisor.drain import classify_kept, drain
from apsup.supervisor.lease_keeper import LeaseKeeper, default_renew_deadline
from apsup.supervisor.notifications import ALL as NOTIFY_ALL
from apsup.supervisor.notifications import NotificationListener
from apsup.supervisor.nudge import NudgeListener
from apsup.supervisor.placement import Balancer
from apsup.supervisor.startup import configuration_problem
from apsup.supervisor.supervisor import Supervisor
from apsup.workers.fds import readable
from apsup.workers.pool import WorkerPool

log = logging.getLogger("apsup.host")

#: On elected backends a term that failed to establish this many times in a row is released,
#: so that another replica may establish it (this host competes again at its next renewal).
ESTABLISH_ATTEMPTS = 5
#: A startup step (schema check, SQLite's first claim) that met an infrastructure error is
#: retried after this delay, doubling up to the cap, for as long as it takes.
STARTUP_RETRY_INITIAL = 0.2
STARTUP_RETRY_MAX = 5.0
STARTUP_BACKOFF = Backoff(base=STARTUP_RETRY_INITIAL, cap=STARTUP_RETRY_MAX, jitter=0.0)
#: Elected backends: the request poll runs this often after the last dispatch or Worker exit,
#: for ``POLL_HOLD_SECONDS``; then each empty poll waits ``POLL_BACKOFF`` times longer than the
#: previous one, up to ``LeasePolicy.poll_seconds`` (the idle rate).
POLL_FAST_SECONDS = 0.1
#: The longest a nudge waits for its publisher's commit to become visible (cycle by cycle,
#: never blocking) before its family is notified anyway.
NUDGE_BARRIER_SECONDS = 2.0
#: A barrier still held is tried again after this delay, doubling up to the maximum (a
#: publisher commits right after its datagram: the first retry nearly always finds it done).
NUDGE_RETRY_FIRST = 0.001
NUDGE_RETRY_MAX = 0.05
POLL_HOLD_SECONDS = 3.0
POLL_BACKOFF = 1.5
#: A standby claims this long after the Lease it met runs out (database time), so its claim
#: lands just after the expiry rather than just before it.
CLAIM_SLACK_SECONDS = 0.05


@dataclass(frozen=True)
class LeasePolicy:
    """Lease timing for elected backends (ignored on SQLite, whose terms never expire).

    ``renew_deadline``: a leader that has not renewed for this long (monotonic, from the start
    of its last successful renewal) steps down; strictly between ``renew_seconds`` and
    ``lease_seconds`` (default two thirds of the Lease). See ``apsup.supervisor.lease_keeper``.
    """

    lease_seconds: float = 15.0
    renew_seconds: float = 5.0
    poll_seconds: float = 2.0
    renew_deadline: float | None = None

    def __post_init__(self) -> None:
        deadline = self.deadline
        if not self.renew_seconds < deadline < self.lease_seconds:
            raise ValueError(
                f"renew deadline ({deadline:g}s) must lie between the renewal interval "
                f"({self.renew_seconds:g}s) and the Lease ({self.lease_seconds:g}s)"
            )

    @property
    def deadline(self) -> float:
        """The effective renew deadline in seconds."""
        if self.renew_deadline is not None:
            return self.renew_deadline
        return default_renew_deadline(self.lease_seconds)

    @property
    def worker_fence_seconds(self) -> float:
        """The longest a Worker's fenced transaction may hold the Lease row lock.

        A renewal due while a Worker holds the lock waits for it; a lock taken just before a
        renewal is due must be released in time for that renewal to finish before the renew
        deadline: renewal interval + bound < deadline, with a fifth of the gap kept for the
        renewal's own round trip. Defaults (15 s Lease): 4 s; a 3 s Lease: 0.8 s."""
        return 0.8 * (self.deadline - self.renew_seconds)


class Host:
    def __init__(
        self,
        supervisors: list[Supervisor],
        backend: SqlBackend,
        pool: WorkerPool,
        *,
        lease: LeasePolicy | None = None,
        control: ControlChannel | None = None,
        shutdown_grace: float = 10.0,
        on_cycle: Callable[[Host], None] | None = None,
    ) -> None:
        self.supervisors = supervisors
        self.backend = backend
        self.pool = pool
        self.lease = lease or LeasePolicy()
        self.control = control
        self.shutdown_grace = shutdown_grace
        self.on_cycle = on_cycle
        self.elected = backend.name != "sqlite"
        self.holder_id = new_holder_id()
        self.stopping = threading.Event()
        #: Seconds running Workers may finish after ``stop()`` (``apsup.supervisor.drain``).
        self.shutdown_drain = 0.0
        self.skip_drain = threading.Event()
        self.heartbeat = time.monotonic()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._next_renew = 0.0
        self._next_poll = 0.0
        self._poll_interval = POLL_FAST_SECONDS
        self._last_activity = time.monotonic()
        self._activity_mark: tuple[int, int] = (0, 0)
        #: Each held term's renew deadline, kept by a watchdog that steps down on time even
        #: while this loop is blocked (elected backends; SQLite terms never expire).
        self.keeper = LeaseKeeper(self.lease.deadline, self._deadline_passed)
        if self.elected:
            for sup in supervisors:
                sup.lease_valid = functools.partial(self.keeper.valid, sup.key)
                # A family whose steps keep failing is retried at least once per renewal.
                sup.error_delay_max = min(sup.error_delay_max, self.lease.renew_seconds)
            # A frozen leader (SIGSTOP, VM pause) inside a transaction that locks its Lease row
            # must not keep a standby from taking over once the Lease runs out: the server ends
            # such a transaction after the margin between renew deadline and Lease.
            margin = max(1.0, self.lease.lease_seconds - self.lease.deadline)
            fence = getattr(backend, "fence_timeout", None)
            if isinstance(fence, float | int):
                backend.fence_timeout = min(float(fence), margin) if fence > 0 else margin  # type: ignore[attr-defined]
        self._control_quiet_until = 0.0
        self._next_watch = 0.0
        #: Steps to pass before this host claims anything (the schema check when it could not
        #: run yet, SQLite's invalidation of earlier terms), in order; see ``_startup``.
        self.preflight: list[Callable[[], object]] = []
        #: SQLite keys whose startup claim has not succeeded yet (SQLite claims only then).
        self._unclaimed: set[str] = set() if self.elected else {s.key for s in supervisors}
        #: Why startup is not complete (None once it is); readiness reports it.
        self.startup_error: str | None = None
        self._startup_failures = 0
        self._next_startup = 0.0
        #: This host process's membership row (elected backends; ``apsup.store.membership``),
        #: set by the runtime before ``start``; refreshed with the lease cadence.
        self.member: membership.Member | None = None
        self._next_member = 0.0
        self._member_refreshes = 0
        #: Elected backends: the per-minute activity every replica's chart reads.
        self.activity = ActivityRecorder(backend) if self.elected else None
        #: Dedicated mode with several replicas: which replica should lead each key, and the
        #: graceful handover of the keys this host should not hold (``placement``); set by the
        #: runtime. None: claim whenever a Lease is free (global mode, SQLite).
        self.balancer: Balancer | None = None
        #: How long a handover lets running Workers finish before it stops them.
        self.handoff_drain = 0.0
        #: Elected backends: nudges from publishers on other processes and replicas
        #: (``apsup.supervisor.nudge``); set by the runtime beside its HTTP listener.
        self.nudges: NudgeListener | None = None
        #: PostgreSQL: the LISTEN connection publishers' notifications arrive on.
        self.listener: NotificationListener | None = None
        #: Per family, the Scope of a nudge whose publisher's commit is not visible yet, and
        #: since when, and when it is tried next (``_drain_nudges``).
        self._barriers: dict[str, tuple[str, float, float]] = {}
        self._handoff_until: dict[str, float] = {}

    # -- control ------------------------------------------------------------------------------
    def stop(self) -> None:
        """Request a graceful shutdown (thread- and signal-safe); a second call skips the drain."""
        if self.stopping.is_set():
            self.skip_drain.set()
        self.stopping.set()
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")

    def wake(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"w")

    def install_signal_handlers(self) -> None:
        def handler(signum: int, frame: FrameType | None) -> None:
            self.stop()

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)

    # -- leadership ---------------------------------------------------------------------------
    def _claim(self, sup: Supervisor) -> None:
        if self.preflight:
            return  # the startup checks have not passed yet
        if self._stopping_workers(sup):
            return  # Workers of its previous term are still being stopped: no second Worker
        started = time.monotonic()
        try:
            term, retry_in = self._claim_placed(sup.key)
        except ModeConflictError as exc:  # stay a candidate; the message says what to do
            log.warning("lease not claimed: %s", exc, extra={"supervisor_key": sup.key})
            return
        if term is not None:
            if not self.elected:  # SQLite terms never expire: nothing to keep
                sup.become_leader(term)
                return
            self.keeper.held(sup.key, started, term.generation)
            with self._calls_until(self.keeper.deadline(sup.key)):
                sup.become_leader(term)  # never raises: a failed establishment is retried
            return
        # Held by another replica: try again as soon as that is useful (database time), not a
        # whole renewal interval later.
        if retry_in is not None:
            retry = time.monotonic() + max(0.0, retry_in) + CLAIM_SLACK_SECONDS
            self._next_renew = min(self._next_renew, retry)
        if self.balancer is not None and self.balancer.should_claim_now(sup.key):
            # The preferred replica of a key another one holds: that one hands it over soon
            # (releasing it); claim again within a poll interval rather than a renewal one.
            retry = time.monotonic() + min(self.lease.poll_seconds, self.lease.renew_seconds)
            self._next_renew = min(self._next_renew, retry)

    def _claim_placed(self, key: str) -> tuple[Term | None, float | None]:
        """``claim_term``, placed: the preferred replica of ``key`` claims a free Lease at
        once, the others only once it has been free for a renewal interval (the preferred one
        had its chance). A Lease found free but within that grace makes this host read the
        membership again (the free Lease may mean a replica left) and decide anew.

        Returns the term, or None and the seconds after which another attempt is worth it.
        For a Lease still held that is its expiry, not expiry + grace: a holder that did not
        renew (killed) is no candidate then, and this host may be the one to claim at once;
        waiting for the grace too would add a renewal interval to every takeover after a kill.
        """
        bal = self.balancer
        lease_seconds = self.lease.lease_seconds
        if bal is None:
            term = self.backend.claim_term(key, self.holder_id, lease_seconds)
            return term, self.backend.held_for.get(key)
        self._read_placement()
        grace = 0.0 if bal.should_claim_now(key) else self.lease.renew_seconds
        term = self.backend.claim_term(key, self.holder_id, lease_seconds, grace)
        left = self.backend.held_for.get(key)
        if term is None and left is not None and left <= grace and grace:
            # Ran out, within the grace: the holder may have gone.
            self._read_placement(force=True)
            if bal.should_claim_now(key, self.backend.lapsed_holder.get(key)):
                term = self.backend.claim_term(key, self.holder_id, lease_seconds)
                left = self.backend.held_for.get(key)
        if term is not None:
            lapsed = self.backend.lapsed_holder.get(key)
            if lapsed is not None:
                bal.ran_out(lapsed)  # or this host would hand the key back to it
            return term, None
        if left is not None and left > grace:  # still held: worth a look once it runs out
            return None, left - grace
        return None, left

    def _read_placement(self, *, force: bool = False) -> None:
        """Read the membership for placement when the view is due (every half Lease), in one
        statement on the read connection; a failed read keeps the old view (and hands nothing
        over on it: ``Balancer.hand_over_to`` wants a fresh one)."""
        bal = self.balancer
        now = time.monotonic()
        if bal is None or not (force or bal.due(now)):
            return
        try:
            with self._calls_until(self.keeper.earliest()), self.backend.read() as conn:
                rows, db_now = membership.members_at(conn, self.backend.db_time_sql())
        except Exception as exc:
            log.warning("membership not read for placement", extra=error_fields(exc))
            return
        bal.update(rows, db_now or datetime.utcnow(), now)  # no row: the time is not used

    @contextlib.contextmanager
    def _calls_until(self, deadline: float | None) -> Iterator[None]:
        """Database calls in this block end by ``deadline`` (a held term's renew deadline)."""
        saved = self.backend.call_deadline
        self.backend.call_deadline = deadline
        try:
            yield
        finally:
            self.backend.call_deadline = saved

    def _deadline_passed(self, key: str) -> None:
        """Watchdog thread: a term passed its renew deadline. Signal its Workers now (the loop
        may be blocked in a database call) and wake the loop, which drops the term."""
        for sup in self.supervisors:
            if sup.key == key:
                self.pool.signal_from_thread(list(sup.running), signal.SIGTERM)
        self.wake()

    def _step_down_expired(self) -> None:
        """Drop every term past its renew deadline (stop dispatch, stop its Workers), and
        forget the deadlines of terms the Supervisors dropped themselves."""
        if not self.elected:
            return
        for sup in self.supervisors:
            if sup.term is None:
                if self.keeper.deadline(sup.key) is not None:
                    self.keeper.dropped(sup.key)
                continue
            if self.keeper.expired(sup.key):
                sup.lose_leadership(
                    f"not renewed within the renew deadline ({self.lease.deadline:g}s)"
                )
                self.keeper.dropped(sup.key)
                # The term is gone: classifying its Workers' exits is a standby's read, bounded
                # by the static limits, not by the deadline that just passed.
                with self._calls_until(None):
                    self._terminate_workers(sup)

    def _stopping_workers(self, sup: Supervisor) -> bool:
        """Whether Workers of ``sup`` are still being stopped (exit not confirmed yet; Workers
        the pool gave up on as unconfirmed no longer count)."""
        live = {h.worker_id for h in self.pool.running() if h.state != "unconfirmed"}
        return any(wid in live for wid in sup.running)

    def _terminate_workers(self, sup: Supervisor) -> None:
        """A Supervisor without a term has no business running Workers, whichever path found
        the term gone (renewal, a stale fenced step, a Worker's report). Stop them now, like a
        shutdown but only this Supervisor's: SIGTERM, SIGKILL after the pool's grace, and wait
        (bounded) for the confirmed exits, so no key of theirs is dispatched again meanwhile."""
        if sup.term is not None:
            return
        ids = {wid for wid in sup.running if wid not in sup.unclassified}
        if not ids:
            return
        self.pool.terminate(ids)
        deadline = (
            time.monotonic()
            + self.shutdown_grace
            + self.pool.grace_seconds
            + self.pool.confirm_seconds
        )
        while True:
            for ex in self.pool.poll():
                for s in self.supervisors:
                    if s.owns(ex.worker_id):
                        s.on_exit(ex)
            live = [
                h for h in self.pool.running() if h.worker_id in ids and h.state != "unconfirmed"
            ]
            remaining = deadline - time.monotonic()
            if not live or remaining <= 0:
                return
            readable([h.sentinel for h in live], min(0.05, remaining))

    def _release(self, sup: Supervisor, reason: str) -> None:
        term = sup.term
        sup.lose_leadership(reason)
        self.keeper.dropped(sup.key)
        self._terminate_workers(sup)
        if term is None:
            return
        try:
            self.backend.release_term(term)
        except Exception as exc:
            log.warning("release failed", extra={"supervisor_key": sup.key, **error_fields(exc)})

    def _establish(self) -> None:
        """Retry establishment of held terms; on elected backends release a term that keeps
        failing so that a standby can try (SQLite has no other host: it keeps retrying)."""
        for sup in self.supervisors:
            if sup.term is None or sup.core is not None:
                continue
            if (
                not sup.establish()
                and self.elected
                and sup.establish_failures >= (ESTABLISH_ATTEMPTS)
            ):
                self._release(sup, "term establishment failed repeatedly")

    def _maintain_leases(self) -> None:
        """Renew held terms and compete for the others, every ``renew_seconds``. A renewal's
        calls end by its term's renew deadline; a term that misses it is dropped by the
        watchdog's step-down, whatever the database does."""
        if not self.elected:
            return
        self._step_down_expired()
        now = time.monotonic()  # not the cycle's start: earlier stages may have taken a while
        if now < self._next_renew:
            return
        self._next_renew = now + self.lease.renew_seconds
        for sup in self.supervisors:
            try:
                if sup.term is None:
                    with self._calls_until(None):
                        self._claim(sup)
                    continue
                started = time.monotonic()
                with self._calls_until(self.keeper.deadline(sup.key)):
                    renewed = self.backend.renew_term(sup.term, self.lease.lease_seconds)
                    if renewed:
                        self.keeper.held(sup.key, started, sup.term.generation)
                        sup.sync_clock(self.backend.renewed_at)  # the renewal read the time
                if not renewed:
                    sup.lose_leadership("renewal refused")
                    self.keeper.dropped(sup.key)
                    self._terminate_workers(sup)
            except Exception as exc:  # database unreachable: keep trying; standby stays healthy
                log.warning(
                    "lease step failed",
                    extra={"supervisor_key": sup.key, **error_fields(exc)},
                )
        self._step_down_expired()

    def _rebalance(self) -> None:
        """Dedicated scale-out: hand over each held key that the placement gives to another
        live replica. Handing over stops admitting new invocations at once, lets the running
        Workers finish for up to ``handoff_drain`` seconds, then stops the rest and releases
        the Lease explicitly, so the preferred replica claims it within a poll."""
        bal = self.balancer
        if bal is None or self.stopping.is_set():
            return
        self._read_placement()
        now = time.monotonic()
        for sup in self.supervisors:
            if sup.term is None:
                self._handoff_until.pop(sup.key, None)
                continue
            if sup.handing_off is None:
                target = bal.hand_over_to(sup.key, now)
                if target is None:
                    continue
                sup.handing_off = target
                self._handoff_until[sup.key] = now + self.handoff_drain
                log.info(
                    "handing over",
                    extra={
                        "supervisor_key": sup.key,
                        "term": sup.term.generation,
                        "to_replica": target,
                        "running": len(sup.running),
                        "drain": self.handoff_drain,
                    },
                )
            elif bal.preferred(sup.key) == bal.replica_id:
                sup.handing_off = None  # the membership changed back: keep it
                self._handoff_until.pop(sup.key, None)
                log.info("handover cancelled", extra={"supervisor_key": sup.key})
                continue
            if sup.running and now < self._handoff_until.get(sup.key, 0.0):
                continue  # Workers still finishing
            self._hand_over(sup)

    def _hand_over(self, sup: Supervisor) -> None:
        """Stop what still runs, then release the term, only if every one of its Workers is
        confirmed gone and the term is still within its renew deadline: a release this host
        cannot confirm is left to the Lease's own expiry."""
        term, target = sup.term, sup.handing_off
        if term is None:
            return
        deadline = self.keeper.deadline(sup.key)
        sup.lose_leadership(f"handed over to replica {target}", level=logging.INFO)
        self.keeper.dropped(sup.key)
        self._handoff_until.pop(sup.key, None)
        if self.balancer is not None:
            self.balancer.handed(sup.key)
        self._terminate_workers(sup)
        left = {h.worker_id for h in self.pool.running()} & set(sup.running)
        if left:
            log.warning(
                "lease not released: a Worker's exit is not confirmed; it runs out by itself",
                extra={"supervisor_key": sup.key, "running": len(left)},
            )
            return
        if deadline is None or time.monotonic() >= deadline:
            return  # past the renew deadline: nothing this host writes could be confirmed
        try:
            with self._calls_until(deadline):
                self.backend.release_term(term)
        except Exception as exc:  # the Lease runs out by itself
            log.warning("release failed", extra={"supervisor_key": sup.key, **error_fields(exc)})
            return
        log.info(
            "lease released",
            extra={"supervisor_key": sup.key, "term": term.generation, "to_replica": target},
        )

    def _refresh_membership(self) -> None:
        """Keep this process's membership row fresh (its calls end by the earliest renew
        deadline, like every call of a leader)."""
        member = self.member
        if member is None or not self.elected or self.stopping.is_set():
            return  # a stopping host leaves the membership: it must not write itself back
        now = time.monotonic()
        if now < self._next_member:
            return
        # On its own timer, not the renewals' (those come every 2/3 Lease by default): several
        # refreshes per Lease, so one late or failed one leaves the row well within the margin
        # others judge it by (``membership.gone_after``).
        self._next_member = now + membership.refresh_interval(self.lease.lease_seconds)
        try:
            # On the autocommit read connection, database time in the statement itself: one
            # round trip per refresh (an idle leader's statements are counted).
            with self._calls_until(self.keeper.earliest()), self.backend.read() as conn:
                membership.refresh(conn, member, now=self.backend.db_time_sql())
        except Exception as exc:
            log.warning("membership not refreshed", extra=error_fields(exc))
            return
        self._member_refreshes += 1
        if self._member_refreshes % membership.PRUNE_EVERY == 0:
            self._prune_membership()

    def _record_activity(self) -> None:
        if self.activity is not None:
            self.activity.record(self.supervisors)

    def _prune_membership(self) -> None:
        """Delete rows of processes gone for longer than ``membership.GONE_KEPT_SECONDS``
        (every replica does it now and then; the delete is idempotent)."""
        try:
            with self._calls_until(self.keeper.earliest()):
                before = self.backend.now() - timedelta(seconds=membership.GONE_KEPT_SECONDS)
                self.backend.run(lambda conn: membership.prune(conn, before))
        except Exception as exc:
            log.warning("old membership rows not pruned", extra=error_fields(exc))

    # -- loop ---------------------------------------------------------------------------------
    def _startup(self, now: float) -> None:
        """Pass the startup steps, then (SQLite) claim every key. While the database does not
        answer (locked, unreachable), retry after a bounded backoff, with the reason in the log
        and in readiness; a configuration error raises ``ConfigError``: no retry can fix it."""
        if now < self._next_startup:
            return
        pending = [s for s in self.supervisors if s.key in self._unclaimed]
        if not self.preflight and not pending:
            return
        stage = "check"
        try:
            while self.preflight:
                self.preflight[0]()
                del self.preflight[0]
            stage = "claim"
            for sup in pending:
                self._claim(sup)
                if sup.term is not None:
                    self._unclaimed.discard(sup.key)
        except Exception as exc:
            problem = configuration_problem(exc, self.backend)
            if problem is not None:
                raise problem from (None if problem is exc else exc)
            self._startup_failures += 1
            delay = STARTUP_BACKOFF.delay(self._startup_failures)
            self._next_startup = time.monotonic() + delay
            self.startup_error = (
                f"starting: {stage} failed ({type(exc).__name__}: {exception_message(exc, 120)})"
            )
            log.warning(
                "startup step failed; retrying",
                extra={
                    "stage": stage,
                    **error_fields(exc),
                    "retry_count": self._startup_failures,
                    "retry_delay": round(delay, 3),
                },
            )
            return
        if self._unclaimed:  # refused without an error (mode conflict, logged): try again later
            self._next_startup = time.monotonic() + STARTUP_RETRY_MAX
            return
        if self._startup_failures:
            log.warning("startup completed", extra={"retry_count": self._startup_failures})
        self.startup_error = None
        self._startup_failures = 0

    def start(self) -> None:
        """Pass the startup steps and establish terms (SQLite: always; MySQL: when the Lease is
        free). A database that does not answer yet does not end the host: the loop retries
        (``_startup``); only a configuration error raises."""
        self._startup(time.monotonic())
        self._next_renew = time.monotonic() + self.lease.renew_seconds  # a refused claim: sooner
        if self.balancer is not None:  # be seen, and see the others, before competing
            self._refresh_membership()
        for sup in self.supervisors:
            if not self.elected:
                break  # SQLite claims in ``_startup``
            try:
                self._claim(sup)
            except Exception as exc:
                log.warning(
                    "initial claim failed", extra={"supervisor_key": sup.key, **error_fields(exc)}
                )
        self._last_activity = time.monotonic()  # a new term: requests may be waiting already
        self._poll_interval = min(POLL_FAST_SECONDS, self.lease.poll_seconds)
        self._next_poll = time.monotonic() + self._poll_interval

    def cycle(self, max_wait: float | None = None) -> None:
        """One iteration: act on everything due, then sleep until the next reason to wake.

        No error escapes: each stage is guarded, so a database blip costs one iteration of that
        stage, never the host process (a restart would only meet the same blip). The one
        exception is a configuration error found by a startup step (``ConfigError``)."""
        now = time.monotonic()
        self.heartbeat = now
        self._startup(now)
        self._guarded("exits", self._deliver_exits)
        if self.control is not None:
            self._guarded("control", self._drain_control)
        if self.nudges is not None and time.monotonic() >= self.nudges.quiet_until:
            self._guarded("nudge", self._drain_nudges)
        if self.listener is not None:
            self._guarded("notifications", self._drain_notifications)
        now = time.monotonic()
        if self.elected and now >= self._next_poll:
            self._next_poll = now + self._next_poll_interval(now)
            self._guarded("poll", self._poll_requests)  # requests committed by other processes
        self._guarded("lease", self._maintain_leases)
        self._guarded("membership", self._refresh_membership)
        if self.activity is not None and self.activity.due(time.monotonic()):
            self._guarded("activity", self._record_activity)
        self._guarded("establish", self._establish)
        if self.balancer is not None:
            self._guarded("placement", self._rebalance)
        for sup in self.supervisors:
            # Discovery yields to the next renewal (each statement is time-limited).
            until = self._next_renew if self.elected else None
            self._guarded("step", functools.partial(sup.step, until=until), key=sup.key)
            self._terminate_workers(sup)  # the step may have found the term stale
        # After the dispatches: the Workers that took the freed slots are starting meanwhile.
        self._guarded("classify", self._classify_exits)
        if self.elected:
            self._note_activity()
        if self.on_cycle is not None:
            self._guarded("observe", lambda: self.on_cycle(self) if self.on_cycle else None)
        self._sleep(max_wait)

    def _next_poll_interval(self, now: float) -> float:
        """Fast while recently active, then growing geometrically up to ``poll_seconds``."""
        fast = min(POLL_FAST_SECONDS, self.lease.poll_seconds)
        if now - self._last_activity < POLL_HOLD_SECONDS:
            self._poll_interval = fast
        else:
            self._poll_interval = min(self.lease.poll_seconds, self._poll_interval * POLL_BACKOFF)
        return self._poll_interval

    def _note_activity(self) -> None:
        """A dispatch or a Worker exit since the last cycle: poll fast again (more requests
        tend to follow; an idle leader costs ``poll_seconds``' rate only)."""
        mark = (
            sum(len(sup.running) for sup in self.supervisors),
            sum(sum(sup.completed.values()) + sum(sup.failed.values()) for sup in self.supervisors),
        )
        if mark == self._activity_mark:
            return
        self._activity_mark = mark
        now = time.monotonic()
        self._last_activity = now
        self._poll_interval = min(POLL_FAST_SECONDS, self.lease.poll_seconds)
        self._next_poll = min(self._next_poll, now + self._poll_interval)

    def _poll_requests(self) -> None:
        """One indexed statement for every family of the established Supervisors; only the
        families with a pending request are notified (each then reads its request page)."""
        sups = [sup for sup in self.supervisors if sup.established]
        if not sups:
            return
        bindings = {fam.binding_name for sup in sups for fam in sup.families.values()}
        with self.backend.read() as conn:  # one statement: requests and operator controls
            pending, controls = operator_state.poll(
                conn,
                bindings,
                now=self.backend.db_time_sql(),
                since=max(sup.core_since for sup in sups),  # the latest term start: safe
            )
        for sup in sups:
            for name, fam in sup.families.items():
                if fam.binding_name in pending:
                    sup.notify(name, new_requests=False)  # pending, not necessarily new
            sup.refresh_controls(controls)  # operator actions, seen within one poll

    def _refresh_controls(self) -> None:
        """Operator actions on a wake-up (SQLite: the CLI notifies, the file watch sees it)."""
        sups = [sup for sup in self.supervisors if sup.established]
        if not sups:
            return
        bindings = {fam.binding_name for sup in sups for fam in sup.families.values()}
        with self.backend.read() as conn:
            controls = operator_state.controls(conn, bindings)
        for sup in sups:
            sup.refresh_controls(controls)

    def _drain_nudges(self) -> None:
        """Nudges (family, Scope) from publishers: once each publisher's commit is visible,
        notify the family as the poll would have; and poll fast for a while, as after any
        activity. The commit is waited for without blocking: the Scope's intent row is locked
        ``SKIP LOCKED`` (its publisher holds the lock until its COMMIT); a row still held is
        tried again at the next cycles, for at most ``NUDGE_BARRIER_SECONDS``, after which the
        family is notified anyway (the poll stays the safety net). So a Scope named by a
        datagram whose row an open transaction holds never stalls the loop."""
        assert self.nudges is not None
        now = time.monotonic()
        for family, scope in self.nudges.drain():
            # one barrier per family: the fast poll finds the others
            self._barriers.setdefault(family, (scope, now, now))
        if not self._barriers:
            return
        sups = [sup for sup in self.supervisors if sup.established]
        for family, (scope, since, due) in list(self._barriers.items()):
            if due > now:
                continue
            visible = not scope or now - since >= NUDGE_BARRIER_SECONDS
            for sup in sups:
                fam = sup.families.get(family)
                if fam is None or visible:
                    continue
                try:
                    with self.backend.transaction() as conn:
                        row = intents.get(
                            conn, fam.binding_name, scope, for_update=True, skip_locked=True
                        )
                    visible = row is not None
                except Exception as exc:  # a bad or spoofed Scope: the poll still runs
                    log.debug("nudge barrier failed", extra=error_fields(exc))
                    visible = True
            if not visible:  # still held by its publisher: tried again soon, then less often
                wait = min(NUDGE_RETRY_MAX, max(NUDGE_RETRY_FIRST, 2 * (due - since)))
                self._barriers[family] = (scope, since, now + wait)
                continue
            del self._barriers[family]
            for sup in sups:
                if family in sup.families:
                    sup.notify(family)
        self._last_activity = now
        self._poll_interval = min(POLL_FAST_SECONDS, self.lease.poll_seconds)
        self._next_poll = min(self._next_poll, now + self._poll_interval)

    def _drain_notifications(self) -> None:
        """Families notified by publishers' commits (visible already: no barrier), and a full
        request pass after each (re)connect of the listener; then poll fast for a while, as
        after any activity."""
        assert self.listener is not None
        names = self.listener.drain()
        if not names:
            return
        for sup in self.supervisors:
            if not sup.established:
                continue
            if NOTIFY_ALL in names:
                sup.notify_all()
                continue
            for family in names & set(sup.families):
                sup.notify(family)
        now = time.monotonic()
        self._last_activity = now
        self._poll_interval = min(POLL_FAST_SECONDS, self.lease.poll_seconds)
        self._next_poll = min(self._next_poll, now + self._poll_interval)

    def _deliver_exits(self) -> None:
        """Confirmed exits free their capacity now; they are classified after the step."""
        exits = list(self.pool.poll())
        for sup in self.supervisors:
            mine = [ex for ex in exits if sup.owns(ex.worker_id)]
            if mine:
                sup.on_exits(mine)

    def _classify_exits(self) -> None:
        for sup in self.supervisors:
            # Acknowledged together where they ask for it (one transaction per term).
            sup.classify_exits(hold=True)  # exits close in time share one transaction
            sup.retry_classification()
            self._terminate_workers(sup)  # a Worker may have reported the term stale

    def _guarded(self, stage: str, fn: Callable[[], object], key: str | None = None) -> None:
        """Run one stage of a cycle: its database calls end by the renew deadline of the term
        it serves (``key``'s, else the earliest held); terms past it are dropped before and after
        it (a stage must not run on a deadline that already passed: its calls would all fail)."""
        self._step_down_expired()
        deadline = None
        if self.elected:
            deadline = self.keeper.earliest() if key is None else self.keeper.deadline(key)
        try:
            with self._calls_until(deadline):
                fn()
        except Exception as exc:
            log.error(
                "host step failed",
                extra={"stage": stage, **error_fields(exc)},
                exc_info=log.isEnabledFor(logging.DEBUG),
            )
        self._step_down_expired()

    def _drain_control(self) -> None:
        """Datagrams (coalesced, at most once per ``min_interval``) and the file watch."""
        assert self.control is not None
        now = time.monotonic()
        names: set[str] = set()
        if now >= self._control_quiet_until:
            names = self.control.drain()
            if names:
                self._control_quiet_until = now + self.control.min_interval
        if now >= self._next_watch:
            self._next_watch = now + self.control.watch_seconds
            if self.control.files_changed():
                names.add(ALL)
        if not names:
            return
        # The publisher sent its datagram just before its COMMIT, holding SQLite's write lock:
        # taking the lock once (an empty write transaction) makes its commit visible to the
        # reads below. A failure here only delays the wake-up to the next file-watch tick.
        try:
            with self.backend.engine.begin():
                pass
        except Exception as exc:
            log.debug("wake-up barrier failed", extra={**error_fields(exc)})
        for sup in self.supervisors:
            if ALL in names:
                sup.notify_all()
            else:
                for family in names:
                    sup.notify(family)
        self._refresh_controls()

    def _sleep(self, max_wait: float | None) -> None:
        timeout = self._timeout()
        if max_wait is not None:
            timeout = max_wait if timeout is None else min(timeout, max_wait)
        sentinels = self.pool.sentinels()
        objects: list[int] = [self._wake_r, *sentinels]
        if self.nudges is not None:
            quiet = self.nudges.quiet_until - time.monotonic()
            if quiet > 0:  # a flood waits in the kernel; drained once per interval
                timeout = quiet if timeout is None else min(timeout, quiet)
            else:
                objects.append(self.nudges.fileno())
        if self.listener is not None:
            fd = self.listener.fileno()
            if fd is not None:
                objects.append(fd)
            elif (due := self.listener.due()) is not None:  # down: reconnect when due
                left = max(0.0, due - time.monotonic())
                timeout = left if timeout is None else min(timeout, left)
        if self.control is not None:
            # While quiet, pending datagrams wait in the kernel: a flood costs one drain per
            # interval, not one loop iteration per datagram.
            quiet = self._control_quiet_until - time.monotonic()
            if quiet > 0:
                timeout = quiet if timeout is None else min(timeout, quiet)
            else:
                objects.append(self.control.fileno())
        end = None if timeout is None else time.monotonic() + timeout
        # A launched Worker's pid arriving needs no cycle: the pool reads it and the wait goes
        # on (with its deadline now among the pool's), until anything else is ready.
        while (ready := readable(objects, timeout)) and self._settled(ready):
            due = self.pool.next_deadline()
            now = time.monotonic()
            timeout = None if end is None else max(0.0, end - now)
            if due is not None:
                step = max(0.0, due - now)
                timeout = step if timeout is None else min(timeout, step)
            objects[1 : 1 + len(sentinels)] = sentinels = self.pool.sentinels()
        with contextlib.suppress(OSError):
            while os.read(self._wake_r, 512):
                pass

    def _settled(self, ready: Iterable[int]) -> bool:
        """``pool.settle_launches`` inside the wait, guarded like every stage of a cycle: on an
        error the wait ends and the next cycle's guarded ``poll`` handles those fds."""
        try:
            return self.pool.settle_launches(ready)
        except Exception as exc:
            log.error("host step failed", extra={"stage": "settle", **error_fields(exc)})
            return False

    def _timeout(self) -> float | None:
        candidates: list[float] = []
        mono = time.monotonic()
        for sup in self.supervisors:
            due = sup.next_wakeup()
            if due is not None:
                candidates.append((due - sup.now()).total_seconds())
            classify = sup.classify_due()
            if classify is not None:
                candidates.append(classify - mono)
        deadline = self.pool.next_deadline()
        if deadline is not None:
            candidates.append(deadline - mono)
        if self.elected:
            candidates.append(self._next_renew - mono)
            candidates.append(self._next_poll - mono)
            if self.member is not None:
                candidates.append(self._next_member - mono)
            deadline = self.keeper.earliest()
            if deadline is not None:
                candidates.append(deadline - mono)
        if self.control is not None:
            candidates.append(self._next_watch - mono)
        if self._barriers:
            candidates.append(min(due for _, _, due in self._barriers.values()) - mono)
        if self.preflight or self._unclaimed:
            candidates.append(self._next_startup - mono)
        if not candidates:
            return None
        return max(0.0, min(candidates))

    def run(self) -> None:
        self.start()
        try:
            while not self.stopping.is_set():
                self.cycle()
        finally:
            self.shutdown()

    def shutdown(self) -> None:
        """Stop discovery and dispatch, stop Workers within a bound, release the terms.

        Unacknowledged requests stay durable; clearing the queues completes nothing (RFC §9).
        """
        terms = [(sup, sup.term) for sup in self.supervisors]
        for sup in self.supervisors:
            sup.core = None  # no more decisions
        if self.balancer is not None and self.member is not None:
            # Leave first: the others place this replica's keys elsewhere while it drains, so
            # the preferred survivor claims each one as soon as it is released.
            replica = self.balancer.replica_id
            try:
                with self._calls_until(self.keeper.earliest()):
                    self.backend.run(lambda conn: membership.remove_replica(conn, replica))
            except Exception as exc:
                log.warning("membership not removed", extra=error_fields(exc))
        drain(self, self.shutdown_drain)
        classify_kept(self)
        for ex in self.pool.terminate_all(self.shutdown_grace):
            for sup in self.supervisors:
                if sup.owns(ex.worker_id):
                    sup.on_exit(ex)
        if self.activity is not None:  # the last seconds' counts, before the terms go
            self._guarded("activity", self._record_activity)
        for sup, term in terms:
            if term is not None:
                try:
                    self.backend.release_term(term)
                except Exception as exc:
                    log.warning(
                        "release failed", extra={"supervisor_key": sup.key, **error_fields(exc)}
                    )
                sup.term = None
            self.keeper.dropped(sup.key)
        self.keeper.close()
        if self.member is not None and self.elected:
            try:
                self.backend.run(lambda conn: membership.remove(conn, self.holder_id))
            except Exception as exc:  # the row goes stale by itself after the Lease
                log.warning("membership not removed", extra=error_fields(exc))
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
