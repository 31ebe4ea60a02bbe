"""Optional tracing: the host's span per invocation reaches the Worker as trace context, the
processor's spans and log records share its trace id, and without the package nothing is
imported. Runs a real host process with an SDK provider exporting to a file (both backends)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests import visibility_families as fams
from tests.test_worker_visibility import Host, host_factory, request, wait_for

__all__ = ["host_factory"]  # the fixture, imported for this module's tests

pytestmark = pytest.mark.timeout(240)
REPO = Path(__file__).resolve().parent.parent


def test_invocation_span_and_trace_ids_in_worker_logs(
    host_factory: Callable[..., Host], db_url: str, tmp_path: Path, monkeypatch
) -> None:
    spans_path = tmp_path / "spans.jsonl"
    monkeypatch.setenv("VIS_TRACE_FILE", str(spans_path))
    h = host_factory()
    request(db_url, fams.vis_traced, "s1")

    def invocation_span() -> dict | None:
        if not spans_path.exists():
            return None
        for line in spans_path.read_text().splitlines():
            doc = json.loads(line)
            if doc["name"] == "apsup.invocation":
                return doc
        return None

    span = wait_for(invocation_span, "the exported invocation span")
    attrs = span["attributes"]
    assert attrs["apsup.family"] == "vis-traced" and attrs["apsup.scope"] == "s1"
    assert attrs["apsup.outcome"] == "success" and span["status"] != "ERROR"
    (rec,) = [r for r in h.records() if r.get("msg") == "inside the processor's span"]
    assert rec["trace_id"] == span["trace_id"]  # the processor's span nests under the host's
    assert rec["worker_id"] == attrs["apsup.worker_id"]


def test_nothing_is_imported_without_the_package() -> None:
    code = """
import importlib.abc, sys

class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "opentelemetry":
            raise ModuleNotFoundError(name)
        return None

sys.meta_path.insert(0, Hide())
import logging
from apsup.observability import tracing
from apsup.observability.logging import JsonFormatter
from apsup.observability.metrics import SupervisorMetrics
from apsup.supervisor.runtime import MetricsHooks
import apsup.workers.invoke

hooks = MetricsHooks(SupervisorMetrics())
assert hooks.spans is None and not tracing.enabled()
assert hooks.invocation_started("w", {"family": "f"}) == {}
tracing.attach_context({"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"})
JsonFormatter().format(logging.LogRecord("x", 20, "f", 1, "m", (), None))
assert not [m for m in sys.modules if m.startswith("opentelemetry")], "imported"
print("clean")
"""
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=60,
    )
    assert out.returncode == 0 and "clean" in out.stdout, out.stderr[-2000:]
