"""Keeping a Lease on an elected backend: the renew deadline, on a monotonic clock.

The database grants a term until ``expires_at`` = (database time of the renewal) + Lease. The
host cannot read that clock while it is cut off, so it keeps its own, conservative one: a term
held since a renewal attempt that *started* at monotonic time ``t`` is valid locally until
``t + renew_deadline``, with ``renew_deadline`` strictly below the Lease (the split Kubernetes'
leader election uses: lease duration > renew deadline > retry period). The database cannot have
started that renewal before ``t``, so the host gives up before any standby may acquire, and the
gap (Lease - renew deadline) absorbs the rate difference of the two clocks.

The deadline does not wait for the host loop. A watchdog thread wakes at the earliest deadline;
when a term passes it without a renewal, the watchdog calls ``on_expire(key)`` (the host signals
that Supervisor's Workers and wakes its loop) while the loop may still be blocked in a database
call. From that instant ``valid(key)`` is False: ``/status`` and ``/readyz`` report the replica
as not leader and the Supervisor dispatches nothing, whatever stage the loop is in. The loop
then drops the term at its next stage boundary. Every database call the loop makes while it
holds a term is itself bounded by the earliest deadline (``SqlBackend.call_deadline``), so the
loop reaches that boundary soon after.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from apsup.observability.logging import error_fields

log = logging.getLogger("apsup.host")

#: Default renew deadline as a share of the Lease: two renewal attempts fit before it when the
#: renewal interval is at most a third of the Lease (the configuration's rule).
RENEW_DEADLINE_SHARE = 2.0 / 3.0


def default_renew_deadline(lease_seconds: float) -> float:
    return lease_seconds * RENEW_DEADLINE_SHARE


class LeaseKeeper:
    """Per Supervisor key: the monotonic instant until which its term may act.

    Thread-safe: the loop records claims and renewals, the watchdog thread expires, the HTTP
    thread asks ``valid``.
    """

    def __init__(
        self,
        renew_deadline: float,
        on_expire: Callable[[str], None],
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not renew_deadline > 0:
            raise ValueError("renew_deadline must be > 0")
        self.renew_deadline = float(renew_deadline)
        self._on_expire = on_expire
        self._clock = clock
        self._cond = threading.Condition()
        #: key -> monotonic deadline of the term it holds
        self._deadlines: dict[str, float] = {}
        #: key -> generation of the term it holds (when the caller named it)
        self._generations: dict[str, int] = {}
        #: keys whose deadline passed without a renewal (until the loop drops their term)
        self._expired: set[str] = set()
        self._thread: threading.Thread | None = None
        self._closed = False

    # -- the loop's side ----------------------------------------------------------------------
    def held(self, key: str, attempt_started: float, generation: int | None = None) -> None:
        """A claim or renewal (of term ``generation``) that started at ``attempt_started``
        succeeded."""
        with self._cond:
            if key in self._expired:
                return  # given up already: the loop drops this term, it is not revived
            self._deadlines[key] = attempt_started + self.renew_deadline
            if generation is not None:
                self._generations[key] = generation
            self._cond.notify_all()
        self._ensure_watchdog()

    def dropped(self, key: str) -> None:
        """The term of ``key`` is gone (released, refused, expired): forget it."""
        with self._cond:
            self._deadlines.pop(key, None)
            self._generations.pop(key, None)
            self._expired.discard(key)
            self._cond.notify_all()

    # -- anyone's side ------------------------------------------------------------------------
    def deadline(self, key: str) -> float | None:
        with self._cond:
            return self._deadlines.get(key)

    def earliest(self) -> float | None:
        """The earliest deadline of any held term (None when none is held)."""
        with self._cond:
            return min(self._deadlines.values(), default=None)

    def valid(self, key: str, generation: int | None = None) -> bool:
        """Whether the term of ``key`` may still act (dispatch, report itself leader); with
        ``generation``, whether that term is the one held: a host that lost a term and claimed
        the next one in the same loop pass must not vouch for the old one (its status snapshot
        may still name it until the loop takes the next)."""
        with self._cond:
            due = self._deadlines.get(key)
            if generation is not None and self._generations.get(key, generation) != generation:
                return False
            return due is not None and key not in self._expired and self._clock() < due

    def expired(self, key: str) -> bool:
        """Whether ``key`` holds a term past its deadline (the loop must drop it)."""
        with self._cond:
            due = self._deadlines.get(key)
            return due is not None and (key in self._expired or self._clock() >= due)

    def left(self, key: str) -> float | None:
        """Seconds until the deadline of ``key`` (negative once passed), None if no term."""
        due = self.deadline(key)
        return None if due is None else due - self._clock()

    # -- the watchdog -------------------------------------------------------------------------
    def _ensure_watchdog(self) -> None:
        with self._cond:
            if self._thread is not None or self._closed:
                return
            self._thread = threading.Thread(
                target=self._watch, name="apsup-lease-watchdog", daemon=True
            )
            self._thread.start()

    def _watch(self) -> None:
        while True:
            fire: list[str] = []
            with self._cond:
                if self._closed:
                    return
                now = self._clock()
                pending = {k: d for k, d in self._deadlines.items() if k not in self._expired}
                for key, due in pending.items():
                    if now >= due:
                        self._expired.add(key)
                        fire.append(key)
                if not fire:
                    nearest = min(pending.values(), default=None)
                    self._cond.wait(None if nearest is None else max(0.0, nearest - now))
                    continue
            for key in fire:
                log.warning(
                    "renew deadline passed: stepping down",
                    extra={"supervisor_key": key, "renew_deadline": self.renew_deadline},
                )
                try:
                    self._on_expire(key)
                except Exception as exc:  # the loop drops the term anyway
                    log.error(
                        "step-down hook failed",
                        extra={"supervisor_key": key, **error_fields(exc)},
                    )

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)
