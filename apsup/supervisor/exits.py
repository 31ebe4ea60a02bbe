"""How a confirmed Worker exit is classified: one pure table, walked row by row by its tests.

The exit status is the only thing a Worker tells its Supervisor, and processor code runs in
the same process as the wrapper that sets it. So a status means more than "the Worker exited
with N" only when the wrapper vouched for it on the launch's hold pipe (``WorkerExit.vouched``),
a descriptor the processor is never given: ``sys.exit(9)`` or ``os._exit(3)`` in a processor
is a failure like any other exit, never an acknowledgment, a conflict or a stale term. A
success needs the durable acknowledgment (``handled``) whatever the status says.
"""

from __future__ import annotations

from dataclasses import dataclass

from apsup.scheduling import Outcome
from apsup.workers.exit_codes import STORAGE_EXITS, ExitCode


@dataclass(frozen=True)
class ExitFacts:
    """What is known about one exit once its acknowledgment (if any) has been made."""

    exitcode: int
    #: The wrapper vouched for ``exitcode`` (the host's own acknowledgment result is vouched).
    vouched: bool
    #: The pool stopped it at (or the Worker's own backstop after) its deadline.
    timed_out: bool
    #: The intent row shows the claimed generation acknowledged.
    handled: bool
    #: For a vouched STALE_TERM: whether the dispatching term is still the valid one.
    term_valid: bool = False


def classify(f: ExitFacts) -> tuple[Outcome, str | None]:
    """(outcome, cause) of one exit; cause None is a success. First matching row wins."""
    code = f.exitcode
    if f.handled and (f.timed_out or code in (ExitCode.SUCCESS, ExitCode.STATUS_LOST)):
        # Acknowledged durably: a deadline that passed after the acknowledgment is no timeout;
        # STATUS_LOST (status gone with the forkserver): the durable row decides.
        return Outcome.SUCCESS, None
    if f.timed_out:
        return Outcome.TIMEOUT, "timeout"
    if code == ExitCode.SUCCESS:
        return Outcome.FAILURE, "no_ack"  # exit 0 without a durable acknowledgment
    if code < 0:
        return Outcome.FAILURE, "crash"  # killed by a signal
    if not f.vouched:
        return Outcome.FAILURE, "failure"  # the processor's own exit status: no meaning
    if code == ExitCode.PROGRESS_CONFLICT:
        return Outcome.CONFLICT, "conflict"
    if code == ExitCode.STALE_TERM:
        # Our term stands: the Worker's view was wrong, not the processor's failure; retried
        # like a conflict, without growing the backoff. Else the term is gone.
        return (Outcome.CONFLICT, "stale_term") if f.term_valid else (Outcome.FAILURE, "stale_term")
    if code in STORAGE_EXITS:
        # The database refused the write (disk full ...): a short fixed retry, no failure.
        return Outcome.CONFLICT, "storage"
    return Outcome.FAILURE, "failure"


def asks_acknowledgment(exitcode: int, vouched: bool) -> bool:
    """The wrapper asks its host to acknowledge for it (the processor returned normally)."""
    return vouched and exitcode == ExitCode.RETURNED_UNACKNOWLEDGED
