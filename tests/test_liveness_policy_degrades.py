"""A family whose policy cannot compute its next check degrades alone (both backends).

Such values (an interval of 1e12 s overflows datetime arithmetic; a cron for 30 February never
fires) used to raise out of the core's decision and kill the host, stopping every family. Here
the policy is forced past validation on a real host: the other family keeps dispatching, the
broken one still runs explicit requests, and status reports only it as degraded, naming the
policy.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from apsup.policy import Cron, Interval, Policy
from apsup.store import migrate, open_backend
from tests import liveness_families as lf
from tests.liveness_support import cycle_until, handled, live_host, readiness, request

pytestmark = pytest.mark.timeout(120)


def broken(kind: str) -> Policy:
    """A policy that passed validation, then made uncomputable (validation is not this test's
    concern: configuration is checked elsewhere)."""
    if kind == "interval":
        interval = Interval(60.0)
        object.__setattr__(interval, "seconds", 1e12)
        return interval
    cron = Cron("0 2 * * *", "UTC")
    object.__setattr__(cron, "expr", "0 2 30 2 *")
    object.__setattr__(cron, "_text", "0 2 30 2 *")  # the parsed form the maths reads
    return cron


@pytest.mark.parametrize("kind", ["interval", "cron"])
def test_uncomputable_policy_degrades_only_its_family(
    db_url: str, tmp_path: Path, kind: str
) -> None:
    migrate(db_url)
    backend = open_backend(db_url)
    good = lf.live_work
    bad = lf.live_scan.with_overrides(policy=broken(kind))
    try:
        with live_host(db_url, [good, bad], tmp_path) as b:
            host, sup = b.host, b.host.supervisors[0]
            cycle_until(
                host,
                lambda: (
                    sup.core is not None
                    and sup.core.snapshot()[bad.name].last_error_stage is not None
                ),
                30,
                "the policy error to surface",
            )
            wanted = {(good, f"ok.{i}"): request(backend, good, f"ok.{i}") for i in range(3)}
            wanted[(bad, "ok.b")] = request(backend, bad, "ok.b")
            for fam in (good, bad):
                sup.notify(fam.name)
            cycle_until(
                host,
                lambda: all(handled(backend, f, s, g) for (f, s), g in wanted.items()),
                60,
                "requests of both families handled",
            )
            status = readiness(host)
            assert status["families"][good.name]["status"] in ("ok", "disabled"), status
            assert status["families"][bad.name]["status"] == "degraded", status
            assert "policy" in str(status["families"][bad.name]["reason"]), status
            assert sup.established
    finally:
        backend.dispose()
