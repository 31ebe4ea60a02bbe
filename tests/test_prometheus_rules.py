"""The shipped alert rules and dashboard are checked, not just shipped: ``promtool check rules``
and ``promtool test rules`` (series that fire and series that stay quiet), and every metric the
dashboard or the rules query exists in the code (a renamed series breaks this test, not the
operator's dashboard). Under CI=true a missing promtool fails instead of skipping.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from apsup.observability.metrics import FailureCause, SupervisorMetrics

REPO = Path(__file__).resolve().parent.parent
RULES = REPO / "deploy" / "prometheus" / "apsup-rules.yaml"
RULE_TESTS = REPO / "tests" / "prometheus" / "apsup-rules.test.yaml"
DASHBOARD = REPO / "deploy" / "grafana" / "apsup.json"
_NAME = re.compile(r"\b((?:apsup|process|python)_[a-zA-Z0-9_]+)\b")


def _promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        if os.environ.get("CI") == "true":
            pytest.fail("promtool is missing: apt-get install prometheus (Debian ships promtool)")
        pytest.skip("promtool not installed (apt-get install prometheus)")
    return path


def _run(*args: str) -> None:
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_promtool_check_rules() -> None:
    _run(_promtool(), "check", "rules", str(RULES))


def test_promtool_unit_tests_fire_and_stay_quiet() -> None:
    text = RULE_TESTS.read_text()
    assert "exp_alerts: []" in text  # the quiet cases are part of the suite
    _run(_promtool(), "test", "rules", str(RULE_TESTS))


def _exported_names() -> set[str]:
    m = SupervisorMetrics(families=["f"])
    m.on_dispatch("f")
    m.on_exit("f", None, 1.0)
    for cause in FailureCause:
        m.on_exit("f", cause, 1.0)
    m.on_scan_started("f")
    m.on_scan_completed("f")
    m.observe_discovery("f", 0.01)
    m.set_leadership("global", True, 1)
    m.update_family("f", 2, 1, 1, 1)
    m.set_unacknowledged("f", 1)
    m.set_stall("f", None, 0)
    m.set_family_timing("f", 60, 600)
    names = _defined_in_source()
    for metric in m.registry.collect():
        names.add(metric.name)
        names.update(sample.name for sample in metric.samples)
    return names


def _defined_in_source() -> set[str]:
    """Series defined anywhere else in the code (e.g. the dedicated launcher's own registry),
    with the suffixes Prometheus exposes for them."""
    pattern = re.compile(r'(Gauge|Counter|Histogram)\(\s*"(apsup_[a-z0-9_]+)"')
    out: set[str] = set()
    for folder in ("apsup", "workers"):
        for path in (REPO / folder).rglob("*.py"):
            for kind, name in pattern.findall(path.read_text()):
                out.add(name)
                if kind == "Counter":
                    out.add(name + "_total")
                if kind == "Histogram":
                    out.update(name + s for s in ("_bucket", "_count", "_sum"))
    return out


def _names(exprs: list[str]) -> set[str]:
    return {n for e in exprs for n in _NAME.findall(e)}


def test_dashboard_queries_name_only_existing_metrics() -> None:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    for var in dash["templating"]["list"]:
        if isinstance(var.get("query"), dict):
            exprs.append(var["query"]["query"])
    used = _names(exprs)
    exported = _exported_names()
    assert used and not used - exported, sorted(used - exported)
    titles = " ".join(p["title"].lower() for p in dash["panels"])
    for topic in ("capacity", "ready", "retry-wait", "oldest running", "last success"):
        assert topic in titles, topic
    for must in (
        "apsup_invocation_failures_total",
        "apsup_discovery_latency_seconds_bucket",
        "apsup_supervisor_leader",
    ):
        assert must in used, must


def test_rules_name_only_existing_metrics() -> None:
    used = _names([RULES.read_text()])
    missing = used - _exported_names()
    assert used and not missing, sorted(missing)


def test_docs_list_every_series() -> None:
    text = (REPO / "docs" / "metrics.md").read_text()
    documented = set(re.findall(r"`((?:apsup)_[a-z0-9_]+)", text))
    exported = {n for n in _exported_names() if n.startswith("apsup_")}
    families = {
        n.removesuffix("_total").removesuffix("_bucket").removesuffix("_count").removesuffix("_sum")
        for n in exported
        if not n.endswith("_created")
    }
    bare = {d.removesuffix("_total") for d in documented}
    assert not families - bare, sorted(families - bare)
    for alert in re.findall(r"alert: (\w+)", RULES.read_text()):
        assert alert in text, alert
