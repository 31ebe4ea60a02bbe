"""Metrics scraped over real HTTP: per-Family series, no unbounded labels (RFC §12).

Dedicated mode exposes one endpoint per Supervisor process (see apsup.observability.metrics);
the last test runs two such processes and scrapes both.
"""

from __future__ import annotations

import http.client
import inspect
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from apsup.observability.health import HealthServer, Heartbeat, fan_in
from apsup.observability.metrics import FailureCause, SupervisorMetrics, supervisor_port

FAMILIES = ("topic-memory", "experience")
ALLOWED_LABELS = {"family", "cause", "supervisor_key", "le"}
HOOKS = (
    "on_dispatch",
    "on_exit",
    "on_scan_started",
    "on_scan_completed",
    "observe_discovery",
    "set_leadership",
    "update_family",
    "set_unacknowledged",
)


def scrape(port: int, accept: str | None = None) -> tuple[str, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", "/metrics", headers={"Accept": accept} if accept else {})
        resp = conn.getresponse()
        assert resp.status == 200
        return resp.read().decode(), resp.getheader("Content-Type") or ""
    finally:
        conn.close()


def samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    return [
        (s.name, s.labels, s.value)
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    ]


def value(text: str, name: str, **labels: str) -> float:
    found = [v for n, lab, v in samples(text) if n == name and lab == labels]
    assert len(found) == 1, f"{name}{labels} not exposed exactly once"
    return found[0]


def drive(m: SupervisorMetrics) -> None:
    """What a loop does in a few cycles; scope/worker ids exist here but cannot be passed."""
    for fam in FAMILIES:
        m.on_scan_started(fam)
        m.observe_discovery(fam, 0.004)
        m.on_scan_completed(fam)
        m.update_family(fam, budget=4, running=2, ready=3, retry_wait=1)
        m.set_unacknowledged(fam, 5)
    for _scope in ("scope-aaa", "scope-bbb"):
        m.on_dispatch("topic-memory")
    m.on_exit("topic-memory", None, 1.5)
    m.on_exit("topic-memory", FailureCause.TIMEOUT, 600.0)
    m.on_exit("experience", "stale_term", 0.3)
    m.on_exit("experience", "not-a-cause", 0.3)  # unknown causes collapse to "failure"
    m.set_leadership("global", True, 3)
    m.set_leadership("global", True, 3)  # same term: no change counted
    m.set_leadership("global", True, 4)


@pytest.fixture
def served() -> Iterator[tuple[SupervisorMetrics, HealthServer]]:
    m = SupervisorMetrics(families=FAMILIES)
    server = HealthServer(metrics=m, heartbeat=Heartbeat())
    server.start()
    yield m, server
    server.stop()


def test_per_family_series_over_http(served) -> None:
    m, server = served
    drive(m)
    text, ctype = scrape(server.port)
    assert ctype.startswith("text/plain")
    assert value(text, "apsup_dispatches_total", family="topic-memory") == 2
    assert value(text, "apsup_dispatches_total", family="experience") == 0  # pre-created
    assert value(text, "apsup_capacity_budget", family="experience") == 4
    assert value(text, "apsup_capacity_used", family="experience") == 2
    assert value(text, "apsup_ready_scopes", family="topic-memory") == 3
    assert value(text, "apsup_retry_wait_scopes", family="topic-memory") == 1
    assert value(text, "apsup_unacknowledged_requests", family="experience") == 5
    assert value(text, "apsup_scans_started_total", family="experience") == 1
    assert value(text, "apsup_scans_completed_total", family="experience") == 1
    assert value(text, "apsup_discovery_latency_seconds_count", family="topic-memory") == 1
    assert value(text, "apsup_invocation_duration_seconds_count", family="topic-memory") == 2
    assert value(text, "apsup_invocation_successes_total", family="topic-memory") == 1
    fails = "apsup_invocation_failures_total"
    assert value(text, fails, family="topic-memory", cause="timeout") == 1
    assert value(text, fails, family="experience", cause="stale_term") == 1
    assert value(text, fails, family="experience", cause="failure") == 1
    assert "apsup_invocation_timeouts" not in text  # failures_total{cause="timeout"} only
    assert value(text, "apsup_supervisor_leader", supervisor_key="global") == 1
    assert value(text, "apsup_supervisor_generation", supervisor_key="global") == 4
    assert value(text, "apsup_supervisor_term_changes_total", supervisor_key="global") == 2


def test_no_unbounded_label_anywhere(served) -> None:
    m, server = served
    drive(m)
    m.on_dispatch("scope-aaa")  # a Scope id passed by mistake does not become a series
    text, _ = scrape(server.port)
    # apsup_build_info's version labels and the default process/python collectors are bounded
    labels = {
        name
        for n, lab, _ in samples(text)
        if n.startswith("apsup_") and n != "apsup_build_info"
        for name in lab
    }
    assert labels <= ALLOWED_LABELS
    assert "scope-aaa" not in text and "scope-bbb" not in text
    assert value(text, "apsup_dispatches_total", family="_unknown") == 1
    causes = {lab["cause"] for n, lab, _ in samples(text) if "cause" in lab}
    assert causes == {c.value for c in FailureCause}


def test_hook_signatures_cannot_take_ids() -> None:
    for hook in HOOKS:
        params = set(inspect.signature(getattr(SupervisorMetrics, hook)).parameters) - {"self"}
        assert not {p for p in params if p.startswith(("scope", "worker", "request"))}, hook


def test_hooks_never_raise() -> None:
    m = SupervisorMetrics()
    m.on_exit("f", None, "not a number")  # type: ignore[arg-type]
    m.update_family("f", budget=object(), running=0, ready=0, retry_wait=0)  # type: ignore[arg-type]
    m.set_leadership("global", True, "x")  # type: ignore[arg-type]
    m.observe_discovery("f", None)  # type: ignore[arg-type]


def test_openmetrics_negotiation(served) -> None:
    m, server = served
    drive(m)
    text, ctype = scrape(server.port, accept="application/openmetrics-text")
    assert ctype.startswith("application/openmetrics-text") and text.rstrip().endswith("# EOF")


def test_standalone_serve_binds_loopback() -> None:
    m = SupervisorMetrics(families=["a"])
    try:
        port = m.serve()
        assert m._server is not None and m._server.address == ("127.0.0.1", port)
        m.on_dispatch("a")
        assert value(scrape(port)[0], "apsup_dispatches_total", family="a") == 1
    finally:
        m.close()


def test_supervisor_port_layout() -> None:
    assert supervisor_port(9300, None) == 9300
    assert [supervisor_port(9300, i) for i in range(3)] == [9301, 9302, 9303]
    assert supervisor_port(0, 5) == 0  # ephemeral everywhere


CHILD = textwrap.dedent(
    """
    import sys
    from apsup.observability import HealthServer, Heartbeat, SupervisorMetrics, supervisor_port

    fam, base, index = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    key = "artifact:" + fam
    metrics = SupervisorMetrics(families=[fam])
    metrics.set_leadership(key, True, 1)
    metrics.on_dispatch(fam)
    metrics.update_family(fam, 2, 1, 0, 0)
    family = {"status": "ok", "reason": None, "budget": 2, "running": 1, "ready": 0,
              "retry_wait": 0, "next_retry_at": None, "due_at": None, "unacknowledged": 0}
    snap = {"role": "background", "mode": "dedicated", "heartbeat_age": None, "supervisors": [
        {"key": key, "leader": True, "holder": "h", "generation": 1, "families": {fam: family}}]}
    server = HealthServer(metrics=metrics, status=lambda: snap, heartbeat=Heartbeat(),
                          port=supervisor_port(base, index))
    print(server.start(), flush=True)
    sys.stdin.read()  # until the parent closes our stdin
    server.stop()
    """
)


def test_dedicated_mode_one_endpoint_per_family_process() -> None:
    families = sorted(FAMILIES)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD, fam, "0", str(i)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for i, fam in enumerate(families)
    ]
    try:
        ports = []
        for proc in procs:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            assert line.strip().isdigit(), f"child failed to start (rc={proc.poll()})"
            ports.append(int(line))
        seen: dict[str, set[str]] = {}
        for fam, port in zip(families, ports, strict=True):
            text, _ = scrape(port)
            seen[fam] = {lab["family"] for _, lab, _ in samples(text) if "family" in lab}
            assert value(text, "apsup_dispatches_total", family=fam) == 1
            assert value(text, "apsup_supervisor_leader", supervisor_key=f"artifact:{fam}") == 1
        assert seen == {fam: {fam} for fam in families}  # each process: its own Family only
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        with HealthServer(status=fan_in(urls), heartbeat=Heartbeat()) as launcher:
            conn = http.client.HTTPConnection("127.0.0.1", launcher.port, timeout=10)
            conn.request("GET", "/readyz")
            resp = conn.getresponse()
            body = orjson.loads(resp.read())
            conn.close()
        assert (resp.status, body["status"]) == (200, "ok")
        assert set(body["families"]) == set(families)
    finally:
        for proc in procs:
            if proc.stdin is not None:
                proc.stdin.close()
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
