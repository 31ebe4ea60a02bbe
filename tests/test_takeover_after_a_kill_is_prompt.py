"""After a kill, the survivor the placement rule names claims the Lease as soon as it runs out.

A replica killed with -9 leaves its Lease to expire and its membership rows behind for a while,
so until the Lease runs out every survivor still counts it, sees it preferred and would wait a
renewal interval of grace once the Lease is free. The survivor that becomes preferred without
the killed one schedules its next attempt for the Lease's expiry (database time), where the
lapsed holder stops counting; it used to schedule it for expiry + grace, so its next renewal
tick carried the takeover, up to a renewal interval late (the scale-out test's kill bound was
missed by that on a loaded machine). And once it holds the family it keeps it: the killed
replica's rows stay live for two Leases, and the survivor used to hand the family back to it.

Real host (dedicated mode) and membership on the real MySQL-compatible server; the kill is
simulated by a Lease of a holder that never renews and a membership row it never refreshes.
"""

from __future__ import annotations

import os
import socket
import time
from datetime import datetime
from pathlib import Path

import pytest
from sqlalchemy import select

from apsup.store import membership, migrate, open_backend
from apsup.store.membership import Member
from apsup.store.schema import leases
from apsup.supervisor.host import CLAIM_SLACK_SECONDS, LeasePolicy
from apsup.supervisor.launcher import build_host
from apsup.supervisor.placement import Balancer, assign
from tests.liveness_families import live_work

pytestmark = pytest.mark.backends("mysql")

#: A renewal interval far above the statements' latency: a schedule a grace late is obvious.
LEASE = LeasePolicy(12.0, 5.0, 0.5, renew_deadline=8.0)
HOLD_FOR = 3.0  # the killed holder's Lease runs out this long after the test starts
FAMILY = live_work.name
KEY = f"artifact:{FAMILY}"


def _member(holder: str, replica: str) -> Member:
    seen = datetime.utcnow()  # replaced by database time on write
    return Member(holder, replica, socket.gethostname(), os.getpid(), "0", "background",
                  "dedicated", None, seen, seen)  # fmt: skip


def _killed_replica_name(survivor: str) -> str:
    """A replica id the rule prefers for the family over ``survivor`` (so only its going away
    makes the survivor the preferred one)."""
    for i in range(1000):
        name = f"rep-killed-{i}"
        if assign([FAMILY], {name, survivor})[FAMILY] == name:
            return name
    raise AssertionError("no replica id preferred over the survivor")


def test_the_survivor_retries_at_the_expiry_and_claims_there(db_url: str, tmp_path: Path) -> None:
    migrate(db_url)
    survivor = "rep-survivor"
    killed = _killed_replica_name(survivor)
    other = open_backend(db_url)
    bundle = build_host(
        db_url,
        [live_work],
        mode="dedicated",
        lease=LEASE,
        worker_settings={"LIVE_DIR": str(tmp_path)},
        shutdown_grace=3.0,
        grace_seconds=2.0,
    )
    host = bundle.host
    try:
        (sup,) = host.supervisors
        assert sup.key == KEY
        # The killed replica: its Lease (runs out in HOLD_FOR s, never renewed) and its row.
        assert other.claim_term(KEY, "holder-of-killed", HOLD_FOR) is not None
        with other.read() as conn:
            membership.refresh(conn, _member("holder-of-killed", killed), now=other.db_time_sql())
        host.member = _member(host.holder_id, survivor)
        host.balancer = Balancer(survivor, [FAMILY], LEASE.lease_seconds, LEASE.lease_seconds / 2)

        host.start()  # refreshes its row, reads the membership, is refused the Lease
        scheduled = host._next_renew - time.monotonic()
        assert sup.term is None
        with other.read() as conn:
            expires = conn.execute(
                select(leases.c.expires_at).where(leases.c.supervisor_key == KEY)
            ).scalar_one()
        expiry_in = (expires - other.now()).total_seconds()
        assert 0 < expiry_in <= HOLD_FOR
        # The next attempt comes at the expiry, not a grace (5 s) or a renewal tick later.
        assert scheduled <= expiry_in + CLAIM_SLACK_SECONDS + 0.5, (scheduled, expiry_in)
        assert scheduled < LEASE.renew_seconds  # without the fix: the renewal tick (5 s)

        # That attempt takes the Lease: the lapsed holder's replica is no candidate any more.
        time.sleep(max(0.0, host._next_renew - time.monotonic()))
        host._claim(sup)
        assert sup.term is not None
        with other.read() as conn:
            holder = conn.execute(
                select(leases.c.holder_id).where(leases.c.supervisor_key == KEY)
            ).scalar_one()
        assert holder == host.holder_id
        # The killed replica's row is still live (two Leases' margin), yet the survivor does not
        # hand the family back to it: a Lease that ran out unrenewed took it out of the running.
        host._rebalance()
        assert sup.handing_off is None and sup.term is not None
    finally:
        host.shutdown()
        bundle.close()
        other.dispose()
