"""RFC §12 end to end on a real Runtime (both backends): one family's provider fails while the
Lease is valid -> aggregate readiness is ``degraded`` with that family degraded, the other family
keeps dispatching, and ``/metrics`` scraped over HTTP carries per-family series and no
unbounded identifiers."""

from __future__ import annotations

import re
import urllib.request

from apsup.store import intents, migrate, open_backend
from apsup.supervisor.control import notify
from apsup.supervisor.runtime import Runtime
from tests import observability_families as fams
from tests.replicas.support import http_get, running, settings_for, wait_for


def _metrics(port: int) -> str:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        return resp.read().decode()


def _value(text: str, name: str, family: str) -> float:
    match = re.search(rf'^{name}{{family="{family}"}} ([0-9.e+]+)$', text, re.M)
    return float(match.group(1)) if match else 0.0


def test_partial_degradation_and_metrics_over_http(db_url: str) -> None:
    migrate(db_url)
    runtime = Runtime(settings_for(db_url, registry=fams.registry), fams.registry)
    with running(runtime):
        port = runtime.http_port
        assert port is not None
        backend = open_backend(db_url)
        try:
            with backend.transaction() as conn:
                wanted = {f"s{i}": fams.obs_ok.request(conn, f"s{i}") for i in range(5)}
        finally:
            backend.dispose()
        notify(db_url, fams.obs_ok.name)

        def all_handled() -> bool:
            b = open_backend(db_url)
            try:
                with b.read() as conn:
                    return all(
                        (row := intents.get(conn, fams.obs_ok.binding_name, s)) is not None
                        and row.handled_generation >= g
                        for s, g in wanted.items()
                    )
            finally:
                b.dispose()

        wait_for(all_handled, timeout=60, what="obs-ok requests handled")

        def degraded_view() -> dict | None:
            code, body = http_get(port, "/readyz")
            fam_status = body.get("families", {})
            if code == 200 and fam_status.get("obs-broken", {}).get("status") == "degraded":
                return body
            return None

        body = wait_for(degraded_view, timeout=30, what="obs-broken reported degraded")
        assert body["check"] == "artifact_processing_supervisor"
        assert body["status"] == "degraded"
        assert body["families"]["obs-ok"]["status"] == "ok"
        assert "reconcile" in body["families"]["obs-broken"]["reason"]

        def scraped() -> str | None:
            text = _metrics(port)
            return text if _value(text, "apsup_dispatches_total", "obs-ok") >= 5 else None

        text = wait_for(scraped, timeout=30, what="dispatch counter scraped")
        assert _value(text, "apsup_capacity_budget", "obs-ok") == 2
        assert 'apsup_supervisor_leader{supervisor_key="global"} 1.0' in text
        apsup_lines = "\n".join(
            line
            for line in text.splitlines()
            if line.startswith("apsup_") and not line.startswith("apsup_build_info")
        )  # the default process/python collectors and build info carry bounded labels of their own
        labels = set(re.findall(r"(\w+)=\"", apsup_lines))
        assert labels <= {"family", "cause", "supervisor_key", "le"}, labels
        assert "s1" not in re.findall(r'"([^"]*)"', text)  # no scope id anywhere
