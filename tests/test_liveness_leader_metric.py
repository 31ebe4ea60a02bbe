"""``apsup_supervisor_leader`` reads 1 only while the term is established (the Supervisor
dispatches); a Lease that is held while establishment keeps failing shows as
``apsup_supervisor_lease_held`` 1 and ``apsup_supervisor_leader`` 0 (both backends, a real
fault: the binding-state table is renamed away before the claim and back later)."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import generate_latest

from apsup.store import migrate, open_backend
from apsup.supervisor.host import Host, LeasePolicy
from apsup.supervisor.runtime import HostObserver
from tests import liveness_families as lf
from tests.liveness_support import (
    BINDING_STATES,
    cycle_for,
    cycle_until,
    handled,
    live_host,
    rename_table,
    request,
)

pytestmark = pytest.mark.timeout(120)


def _gauges(host: Host, key: str) -> tuple[float | None, float | None]:
    observer = host.on_cycle
    assert isinstance(observer, HostObserver)
    text = generate_latest(observer.metrics.registry).decode()
    found: dict[str, float] = {}
    for line in text.splitlines():
        for name in ("apsup_supervisor_leader", "apsup_supervisor_lease_held"):
            if line.startswith(f'{name}{{supervisor_key="{key}"}}'):
                found[name] = float(line.rsplit(" ", 1)[1])
    return found.get("apsup_supervisor_leader"), found.get("apsup_supervisor_lease_held")


def test_leader_gauge_is_one_only_once_the_term_is_established(db_url: str, tmp_path: Path) -> None:
    migrate(db_url)
    backend = open_backend(db_url)
    try:
        g = request(backend, lf.live_work, "ok.1")
        rename_table(db_url, BINDING_STATES, "live_moved_states_m")
        with live_host(db_url, [lf.live_work], tmp_path, lease=LeasePolicy(3.0, 1.0, 0.5)) as b:
            host = b.host
            sup = host.supervisors[0]
            held_samples = 0

            def check() -> None:
                nonlocal held_samples
                leader, held = _gauges(host, sup.key)
                assert sup.core is None
                if leader is not None:
                    assert leader == 0, "a term that is not established is no leader"
                if sup.term is not None and held is not None:
                    assert held == 1
                    held_samples += 1

            cycle_for(host, 3.0, check)
            assert held_samples > 0, "the Lease was never observed held during the fault"

            rename_table(db_url, "live_moved_states_m", BINDING_STATES)
            cycle_until(
                host, lambda: handled(backend, lf.live_work, "ok.1", g), 30, "request handled"
            )
            host.cycle(max_wait=0.05)
            assert sup.established
            assert _gauges(host, sup.key) == (1.0, 1.0)
    finally:
        backend.dispose()
