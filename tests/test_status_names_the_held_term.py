"""``/status`` never reports a term the host no longer holds as leading (elected backends).

A host whose term ran out while its loop was away drops it and, the Lease being free, claims the
next one in the same loop pass. Until that pass ends (the new term's establishment reads the
database, which takes a while under load), the snapshot the HTTP thread serves is the previous
pass's, and names the old term as leading. The status is judged against the term held *now*:
the old generation is reported as not leading, and the next snapshot names the new one. A
fault run saw the other answer: a replica reported a term as leading 0.4-0.6 s after that
term's Lease had run out, while it held the next term.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from apsup.store.leases import Term
from apsup.supervisor.host import LeasePolicy
from apsup.supervisor.runtime import HostObserver
from tests import liveness_families as lf
from tests.liveness_support import cycle_until, live_host

pytestmark = [pytest.mark.backends("mysql"), pytest.mark.timeout(120)]

LEASE = LeasePolicy(3.0, 1.0, 0.5)


def _entry(status: Any, key: str) -> dict[str, Any]:
    """The status entry of ``key`` (an empty one before the first snapshot names it)."""
    found = (e for e in status["supervisors"] if e["key"] == key)
    return next(found, {"leader": False, "generation": None})


def test_a_term_replaced_in_one_pass_is_not_reported_leading(
    db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with live_host(db_url, [lf.live_work], tmp_path, lease=LEASE) as bundle:
        host = bundle.host
        sup = host.supervisors[0]
        observer = host.on_cycle
        assert isinstance(observer, HostObserver)

        def leading() -> bool:
            entry = _entry(observer.status(), sup.key)
            return sup.core is not None and entry["leader"] and entry["generation"] is not None

        cycle_until(host, leading, 30, "an established leader in /status")
        old = _entry(observer.status(), sup.key)["generation"]

        mid_pass: list[tuple[int, dict[str, Any]]] = []
        become_leader = sup.become_leader

        def spy(term: Term) -> None:
            # Inside the pass that claimed ``term``: what /status answers right now.
            mid_pass.append((term.generation, _entry(observer.status(), sup.key)))
            become_leader(term)

        monkeypatch.setattr(sup, "become_leader", spy)
        # The loop stays away past the renew deadline and past the Lease's end.
        time.sleep(LEASE.lease_seconds + 0.6)
        cycle_until(host, lambda: mid_pass, 15, "the next term claimed")
        generation, entry = mid_pass[0]
        assert generation > old
        assert entry["generation"] == old  # the previous pass's snapshot is still served ...
        assert entry["leader"] is False  # ... but it does not vouch for the term it names
        cycle_until(
            host,
            lambda: (
                (e := _entry(observer.status(), sup.key))["leader"]
                and e["generation"] == generation
            ),
            15,
            "the new term reported leading",
        )
