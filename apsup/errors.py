"""Typed errors. One root so callers can catch everything apsup raises on purpose.

Each message says what to change; driver errors are wrapped with ``raise ... from exc``.
"""

from __future__ import annotations


class ApsupError(Exception):
    """An apsup error."""


class ConfigError(ApsupError, ValueError):
    """Startup configuration is invalid; the message names the family/variable and the fix."""


class StaleTermError(ApsupError):
    """The leadership term that dispatched this work is no longer valid; nothing was committed."""


class ProgressConflict(ApsupError):
    """Raised by a processor when its own progress/Head CAS lost a race.

    The Supervisor redispatches after a short fixed delay without counting a failure (RFC §7).
    """


class ContextError(ApsupError, ValueError):
    """A serialized ExecutionContext is malformed or of an unknown version."""


class IntentError(ApsupError, ValueError):
    """An intent operation violates the generation rules (e.g. acknowledging above requested)."""


class BackendError(ApsupError):
    """The database backend failed in a way that is not a term loss (retries exhausted, ...)."""


class DeadlinePassed(BackendError):
    """A database call of a leader would outlive the time left on its Lease: not attempted (or
    cut short), so the loop reaches its step-down instead of waiting on the database."""


class FencedTransactionTimeout(BackendError):
    """A fenced transaction stayed open past its bound (derived from the Lease) and the database
    ended it: nothing of it committed. Keep fenced transactions short: compute outside
    ``ctx.fenced()``, write inside it."""


class ForeignLock(BackendError):
    """A row the leader would write is locked by another transaction (an application's open
    request for the same Scope): the write is deferred and retried, never waited for while the
    Lease row is held."""

    def __init__(self, binding: str, scope_id: str) -> None:
        super().__init__(
            f"the intent row of {binding!r} Scope {scope_id!r} is locked by another "
            "transaction; its acknowledgment is retried once the lock is released"
        )
        self.binding = binding
        self.scope_id = scope_id


class WorkerStartError(ApsupError):
    """The Worker forkserver could not start for a reason a retry may fix (a fork refused by the
    kernel, the forkserver killed while starting): not a configuration error."""


class StartupInterrupted(ApsupError):
    """A stop (SIGTERM/SIGINT, ``Runtime.stop``) arrived while the host was still starting."""


class HostConflictError(ApsupError):
    """Another host already runs on this SQLite database (multi-process SQLite is unsupported)."""


class InvalidSettings(ConfigError):
    """Every configuration problem found at startup, one line each (``problems``)."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        if len(problems) == 1:
            text = f"invalid configuration: {problems[0]}"
        else:
            text = f"invalid configuration ({len(problems)} problems):\n" + "\n".join(
                f"  - {p}" for p in problems
            )
        super().__init__(text)


class ActionRefused(ApsupError, ValueError):
    """The action cannot be carried out as asked; the message says why."""


class StatusUnavailable(ApsupError):
    """The database cannot be shown; ``code`` is the exit code, the message says what to do."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


class ModeConflictError(ConfigError):
    """A term of the other mode is still live: claiming would let two terms commit at once."""


class SchemaRevisionError(ConfigError):
    """The database's apsup schema does not match this code (exit 2; names the fix)."""


class UnknownScope(ApsupError, LookupError):
    """The family has no such Scope (it was never marked dirty nor requested)."""


class ForkServerStuck(ApsupError, TimeoutError):
    """The forkserver did not report a forked pid in time (wedged, or a preload import hangs).
    The pool has killed it, so no untracked Worker can appear later; the next launch starts a
    fresh forkserver, and Workers of the killed one become ``"unconfirmed"``."""
