"""Persistence: schema, intents, scan state, leases, and one module per backend."""

from __future__ import annotations

from apsup.store.backends import backend_kind, connect, open_backend, worker_preload
from apsup.store.base import SqlBackend, redact_url
from apsup.store.leases import Backend, Term

__all__ = [
    "Backend",
    "SqlBackend",
    "Term",
    "backend_kind",
    "connect",
    "migrate",
    "open_backend",
    "redact_url",
    "worker_preload",
]


def migrate(url: str, revision: str | None = None, *, reference_families: bool = False) -> None:
    """Upgrade apsup's schema on ``url`` (``apsup.store.revision.migrate``): the framework
    tables, plus the reference families' tables when ``reference_families`` (or already there).
    """
    from apsup.store.revision import migrate as _migrate

    _migrate(url, None if revision == "head" else revision, reference_families=reference_families)
