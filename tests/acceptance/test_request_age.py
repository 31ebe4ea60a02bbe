"""Requests that wait are visible by their age: the leader reports how long the oldest request
it knows of has gone unacknowledged (``/status``, ``apsup_oldest_request_age_seconds``), the
cluster summary lists a request older than its bound, and the figure falls back to 0 once
the request is handled. A parked Scope waits for the operator: it is reported as parked and
does not age the family (both backends, a real host and real Workers)."""

from __future__ import annotations

from typing import Any

import pytest

from apsup import operator
from apsup.observability import cluster
from apsup.observability.health import Heartbeat
from apsup.observability.metrics import SupervisorMetrics
from apsup.supervisor.request_ages import RequestAges
from apsup.supervisor.runtime import HostObserver
from tests.acceptance.families import configure
from tests.acceptance.harness import LiveHost, handled, request, set_flag, write

pytestmark = pytest.mark.timeout(180)


class _Observed:
    """The host's observer as ``apsup run`` wires it: its ``/status`` and its metrics."""

    def __init__(self, host: LiveHost) -> None:
        self.host = host
        self.metrics = SupervisorMetrics(families=list(host.supervisor.families))
        self.observer = HostObserver(
            role="all",
            mode="global",
            metrics=self.metrics,
            heartbeat=Heartbeat(),
            lease_read_seconds=1,
        )

    def family(self, name: str) -> dict[str, Any]:
        self.observer._ages.clear()  # the once-a-second memo: each look here is a new one
        self.observer(self.host.host)
        return dict(self.observer.status()["supervisors"][0]["families"][name])

    def metric(self, name: str) -> float:
        value = self.metrics.registry.get_sample_value(
            "apsup_oldest_request_age_seconds", {"family": name}
        )
        assert value is not None
        return value


def test_a_waiting_request_ages_until_it_is_handled(hosts, store) -> None:
    fam = configure("acc-manual", disabled=True, max_workers=1, timeout=120)
    host = hosts.live_host([fam])
    seen = _Observed(host)
    request(store, fam, "gate.busy")  # takes the only slot and keeps it
    host.run_until(lambda: host.supervisor.running, "the gate Worker runs")
    request(store, fam, "ok.waits")  # no capacity: it waits
    host.run_for(1.5)
    first = seen.family(fam.name)["oldest_request_age"]
    host.run_for(1.5)
    later = seen.family(fam.name)["oldest_request_age"]
    assert first >= 1.0 and later >= first + 1.0, (first, later)
    assert seen.metric(fam.name) == pytest.approx(later, abs=0.5)
    set_flag(store, "gate:gate.busy")  # both run and are acknowledged
    host.run_until(
        lambda: handled(store, fam, "gate.busy") and handled(store, fam, "ok.waits"), "both"
    )
    host.run_until(lambda: not host.supervisor.running, "the Workers' exits")
    assert seen.family(fam.name)["oldest_request_age"] == 0
    assert seen.metric(fam.name) == 0


def test_a_parked_scope_does_not_age_its_family(hosts, store) -> None:
    fam = configure("acc-manual", disabled=True, max_workers=1, timeout=120)
    host = hosts.live_host([fam])
    seen = _Observed(host)
    request(store, fam, "gate.parked")
    host.run_until(lambda: host.supervisor.running, "the gate Worker runs")
    host.run_for(1.2)
    assert seen.family(fam.name)["oldest_request_age"] >= 1.0
    write(store, lambda conn: operator.stop(conn, fam, "gate.parked"))  # stop parks it
    host.host.wake()
    host.run_until(lambda: not host.supervisor.running, "the stopped Worker's exit", limit=30)
    host.run_for(1.0)  # the leader reads the parked set
    status = seen.family(fam.name)
    assert not handled(store, fam, "gate.parked")  # its request is kept...
    assert status["oldest_request_age"] == 0  # ...and counted as parked, not as waiting


def test_the_cluster_summary_lists_an_old_request() -> None:
    def view(age: float, unacknowledged: int) -> dict[str, Any]:
        fam = {
            "leader": {"state": "active"},
            "budget": 1,
            "unacknowledged": unacknowledged,
            "oldest_request_age": age,
        }
        return {"families": {"f": fam}, "replicas": [], "sources": []}

    bound = cluster.OLD_REQUEST_SECONDS
    items = cluster.summary(view(bound + 60, 1))["items"]
    assert [i["kind"] for i in items] == ["old-request"]
    assert "f: a request has waited 11 min" in items[0]["text"]
    assert cluster.summary(view(bound + 60, 1))["status"] == "attention"
    assert cluster.summary(view(bound - 1, 1))["items"] == []
    assert cluster.summary(view(bound + 60, 0))["items"] == []  # handled since the leader looked


def test_request_ages_rules() -> None:
    ages = RequestAges()
    ages.seen("f", "a", 10.0)
    ages.seen("f", "a", 20.0)  # seen again: the first sighting counts
    ages.seen("f", "b", 15.0)
    assert ages.oldest("f", 30.0) == 20.0
    assert ages.oldest("f", 30.0, parked={"a"}) == 15.0
    ages.handled("f", "a", more_since=25.0)  # a later request arrived during that run
    assert ages.oldest("f", 30.0) == 15.0
    ages.handled("f", "b")
    assert ages.oldest("f", 30.0) == 5.0
    ages.handled("f", "a")
    assert ages.oldest("f", 30.0) == 0.0 and ages.oldest("other", 30.0) == 0.0
    ages.seen("f", "c", 1.0)
    ages.clear()  # a new term saw nothing yet
    assert ages.oldest("f", 30.0) == 0.0
