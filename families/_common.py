"""Small helpers shared by the reference families (column types, errors, settings, digests).

Nothing here reaches into the Supervisor: families talk to apsup only through ``@family``,
``Family.mark_dirty/request`` and the ``ExecutionContext`` they receive.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from datetime import UTC, datetime

from sqlalchemy import DateTime
from sqlalchemy.dialects import mysql

from apsup.context import ExecutionContext
from apsup.errors import ApsupError
from apsup.store.schema import Identifier

#: Microsecond precision on MySQL/OceanBase, like ``apsup.store.schema.Timestamp``.
Timestamp = DateTime().with_variant(mysql.DATETIME(fsp=6), "mysql")

SCOPE_LENGTH = 255
SCOPE = Identifier(SCOPE_LENGTH)  # byte-exact on MySQL too
DIGEST_LENGTH = 64


class DomainError(ApsupError):
    """A family's business rule refused an operation. Messages never contain Source bodies."""


class AuthorizationDenied(DomainError, PermissionError):
    """The (background or caller) principal may not act on this Scope.

    Raised by a processor it is a failure of that Scope only (RFC §6): the Supervisor backs the
    key off and keeps scheduling every other Scope and family.
    """


class SourceFailure(DomainError):
    """A Source position could not be processed; progress stops before it (never skipped)."""

    def __init__(self, family: str, scope_id: str, position: int) -> None:
        super().__init__(
            f"{family}: scope {scope_id!r} cannot process source position {position}; "
            "the cursor stays before it and later sources wait"
        )
        self.scope_id = scope_id
        self.position = position


def utcnow() -> datetime:
    """Naive UTC, the convention of every timestamp apsup stores."""
    return datetime.now(UTC).replace(tzinfo=None)


def int_setting(ctx: ExecutionContext, prefix: str, name: str, default: int) -> int:
    """``<PREFIX>_<NAME>`` from the context's settings, else ``default`` (must be >= 1)."""
    from apsup.config import DEFAULT_PREFIX

    # Settings.worker_env() ships the full environment names; bare names are accepted for
    # contexts built by hand (tests, embedding).
    raw = ctx.settings.get(f"{DEFAULT_PREFIX}{prefix}_{name}", ctx.settings.get(f"{prefix}_{name}"))
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise DomainError(f"setting {prefix}_{name} must be an integer, got {raw!r}") from None
    if value < 1:
        raise DomainError(f"setting {prefix}_{name} must be >= 1, got {value}")
    return value


def digest(parts: Iterable[str | bytes], seed: str = "") -> str:
    """A deterministic 64-hex digest of ``parts`` (length-prefixed, so boundaries matter)."""
    h = hashlib.sha256(seed.encode())
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        h.update(len(data).to_bytes(8, "big"))
        h.update(data)
    return h.hexdigest()


def finish_without_work(ctx: ExecutionContext, dirty_generation: int) -> None:
    """NOOP completion (RFC §3, §6): no work remained in the snapshot, so mark clean only up to
    the dirty generation read *before* the domain facts, and acknowledge G, in one fenced txn."""
    with ctx.fenced() as conn:
        if dirty_generation:
            ctx.mark_clean(conn, dirty_generation)
        ctx.acknowledge(conn)
