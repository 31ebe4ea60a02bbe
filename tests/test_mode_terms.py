"""Terms of the two modes are never both live.

Leases are per key (``global`` or ``artifact:<family>``), and a host claims only its own mode's
keys. Measured before: after ``artifact:X`` then ``global`` were claimed, the old term still
committed an acknowledgment (e.g. a dedicated SQLite host SIGKILLed, its ``setsid`` Workers
alive, restarted in ``global`` without ``switch-mode``). Now SQLite invalidates the other mode at
every claim and every key at host startup, and MySQL refuses to claim while the other mode holds
a live Lease, naming ``apsup maintenance switch-mode``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from apsup.errors import StaleTermError
from apsup.store import intents, migrate
from apsup.store.base import SqlBackend
from apsup.store.leases import GLOBAL_KEY, ModeConflictError, Term, dedicated_key

pytestmark = [pytest.mark.timeout(120), pytest.mark.backends("sqlite", "mysql", "postgresql")]

BINDING = "fam"
LEASE_S = 30.0


def _requested(backend: SqlBackend, scope: str) -> int:
    with backend.transaction() as conn:
        return intents.request(conn, BINDING, scope)


def _acknowledge(backend: SqlBackend, term: Term, scope: str, generation: int) -> bool:
    return backend.run_fenced(
        term, lambda conn: intents.acknowledge(conn, BINDING, scope, generation, None)
    )


@pytest.mark.parametrize(
    ("old_key", "new_key"),
    [(dedicated_key(BINDING), GLOBAL_KEY), (GLOBAL_KEY, dedicated_key(BINDING))],
    ids=["dedicated-then-global", "global-then-dedicated"],
)
def test_a_term_of_the_other_mode_never_commits(
    backend: SqlBackend, old_key: str, new_key: str
) -> None:
    generation = _requested(backend, "s")
    old = backend.claim_term(old_key, "old-holder", LEASE_S)
    assert old is not None
    if backend.name != "sqlite":
        # The old mode's Lease is live: the other mode must not get a term beside it.
        with pytest.raises(ModeConflictError, match="apsup maintenance switch-mode"):
            backend.claim_term(new_key, "new-holder", LEASE_S)
        assert _acknowledge(backend, old, "s", generation)  # the one live term still works
        generation = _requested(backend, "s")
        backend.release_term(old)  # the old replica stops (or its Lease expires)
    new = backend.claim_term(new_key, "new-holder", LEASE_S)
    assert new is not None
    with pytest.raises(StaleTermError):
        _acknowledge(backend, old, "s", generation)
    assert _acknowledge(backend, new, "s", generation)


@pytest.mark.mysql_only
def test_an_expired_lease_of_the_other_mode_is_no_obstacle(backend: SqlBackend) -> None:
    old = backend.claim_term(dedicated_key(BINDING), "old-holder", 0.2)
    assert old is not None
    import time

    time.sleep(1.0)
    assert backend.claim_term(GLOBAL_KEY, "new-holder", LEASE_S) is not None
    with pytest.raises(ModeConflictError):  # and now the dedicated key is refused in turn
        backend.claim_term(dedicated_key(BINDING), "old-holder", LEASE_S)


@pytest.mark.backends("sqlite")
def test_a_sqlite_host_start_invalidates_every_earlier_term(tmp_path: Path) -> None:
    from apsup.store import open_backend
    from apsup.supervisor.launcher import build_host
    from tests.replicas import families

    url = f"sqlite:///{tmp_path / 'x.db'}"
    migrate(url)
    backend = open_backend(url)
    try:
        # A term of a family this host does not run, of the same mode it will claim.
        gone = backend.claim_term(dedicated_key("retired-family"), "old-holder", 0)
        assert gone is not None
        bundle = build_host(url, list(families.registry), mode="dedicated")
        try:
            bundle.host.start()  # SQLite claims (bumps) its terms when the host starts
            assert all(sup.term is not None for sup in bundle.host.supervisors)
            bundle.host.shutdown()
        finally:
            bundle.close()
        with pytest.raises(StaleTermError):
            backend.run_fenced(gone, lambda conn: None)
    finally:
        backend.dispose()
