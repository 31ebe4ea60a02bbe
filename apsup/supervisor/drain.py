"""Graceful drain: after a stop request, let running Workers finish before stopping them.

On SIGTERM the host stops discovery and dispatch at once, then waits up to
``SHUTDOWN_DRAIN_SECONDS`` for its running Workers to exit by themselves, reaping each exit as it
comes (a finished invocation has acknowledged its request durably). Meanwhile it keeps renewing
its terms on elected backends, so the Workers' fenced commits stay valid; if a renewal is
refused the drain ends, since those commits would be refused anyway. Whatever still runs at the
end of the window gets the usual SIGTERM, ``SHUTDOWN_GRACE_SECONDS``, SIGKILL. A second
SIGTERM/SIGINT (``Host.stop`` called again) ends the drain immediately. Requests whose Worker did
not finish stay pending (requested > handled) for the next leader.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import TYPE_CHECKING

from multiprocess.connection import wait

from apsup.observability.logging import error_fields

if TYPE_CHECKING:
    from apsup.supervisor.host import Host

log = logging.getLogger("apsup.host")

#: Default drain window; deploy/ manifests size their termination grace for it.
DEFAULT_DRAIN_SECONDS = 30.0


def classify_kept(host: Host) -> None:
    """Classify the exits the last cycle kept, if it could not (logged, never raised)."""
    for sup in host.supervisors:
        try:
            sup.classify_exits()
        except Exception as exc:
            log.error("exits not classified", extra={"stage": "classify", **error_fields(exc)})


def _deliver(host: Host) -> None:
    classify_kept(host)
    for ex in host.pool.poll():
        for sup in host.supervisors:
            if sup.owns(ex.worker_id):
                sup.on_exit(ex)


def _renew(host: Host) -> bool:
    """Keep the terms alive; False when one was refused (its Workers can no longer commit)."""
    for sup in host.supervisors:
        if sup.term is None:
            continue
        if host.keeper.expired(sup.key):
            log.warning("drain ended: renew deadline passed", extra={"supervisor_key": sup.key})
            return False
        started = time.monotonic()
        try:
            with host._calls_until(host.keeper.deadline(sup.key)):
                renewed = host.backend.renew_term(sup.term, host.lease.lease_seconds)
        except Exception as exc:  # unreachable for a moment: the lease may still be valid
            log.warning(
                "renewal during drain failed",
                extra={"supervisor_key": sup.key, **error_fields(exc)},
            )
            continue
        if not renewed:
            log.warning("drain ended: renewal refused", extra={"supervisor_key": sup.key})
            return False
        host.keeper.held(sup.key, started, sup.term.generation)
    return True


def drain(host: Host, seconds: float) -> None:
    """Wait up to ``seconds`` for the pool's Workers to exit; returns early on a second stop."""
    if seconds <= 0 or not len(host.pool) or host.skip_drain.is_set():
        return
    started = time.monotonic()
    deadline = started + seconds
    log.info("draining running workers", extra={"running": len(host.pool), "drain": seconds})
    next_renew = started  # renew at once: the loop's last renewal may be a while ago
    while len(host.pool) and not host.skip_drain.is_set():
        now = time.monotonic()
        if now >= deadline:
            break
        if host.elected and now >= next_renew:
            next_renew = now + host.lease.renew_seconds
            if not _renew(host):
                break
        _deliver(host)
        if not len(host.pool):
            break
        wake = min(deadline, next_renew) if host.elected else deadline
        pool_due = host.pool.next_deadline()
        if pool_due is not None:
            wake = min(wake, pool_due)
        wait([host._wake_r, *host.pool.sentinels()], max(0.0, min(wake - now, 1.0)))
        with contextlib.suppress(OSError):
            while os.read(host._wake_r, 512):
                pass
    _deliver(host)
    log.info(
        "drain finished",
        extra={
            "left": len(host.pool),
            "seconds": round(time.monotonic() - started, 3),
            "skipped": host.skip_drain.is_set(),
        },
    )
