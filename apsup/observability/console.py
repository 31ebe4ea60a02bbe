"""The web console: ``GET /`` on the host's listener, one page a person on call can open.

It shows what ``/status`` holds, per family: policy and next check, who leads (this replica or
which other holder, and the term), running Workers against the budget with each running Scope
and its age, the ready backlog, requests waiting in retry, the failing Scopes with their
redacted errors, and a chart of invocations per minute over the last hour; and the replicas.
The page is rendered here, so it is complete without JavaScript; ``console.js`` (served by the
same listener, like ``console.css``) refreshes it from ``status`` every few seconds without a
reload. Nothing is fetched from anywhere else: the listener sends
``Content-Security-Policy: default-src 'self'``, and every link is relative, so the page also
works behind a reverse proxy under a path prefix. Read-only: it is served for GET and HEAD only,
and every value is HTML-escaped.
"""

from __future__ import annotations

import html
from importlib import resources
from typing import Any

from apsup.observability.status import StatusSnapshot, evaluate_readiness

#: Seconds between refreshes of the page by ``console.js``.
REFRESH_SECONDS = 3
#: The static files the listener serves beside the page: name -> content type.
STATIC = {
    "console.js": "application/javascript; charset=utf-8",
    "console.css": "text/css; charset=utf-8",
    "favicon.svg": "image/svg+xml",
}
#: Minutes shown in the chart.
CHART_MINUTES = 60


def static_file(name: str) -> bytes:
    return resources.files("apsup.observability").joinpath("static", name).read_bytes()


def _e(value: object) -> str:
    return html.escape("-" if value is None else str(value), quote=True)


def _table(headers: list[str], rows: list[list[object]], empty: str) -> str:
    if not rows:
        return f'<p class="empty">{_e(empty)}</p>'
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{_e(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def chart(history: list[list[int]], now_minute: int) -> str:
    """An inline SVG bar chart: succeeded (class ok) and failed (class failed) invocations per
    minute over the last ``CHART_MINUTES`` minutes, drawn here (no plotting library)."""
    by_minute = {int(m): (int(ok), int(failed)) for m, ok, failed in history}
    width, height, bar = CHART_MINUTES * 6, 60, 5
    top = max([ok + failed for ok, failed in by_minute.values()] + [1])
    bars: list[str] = []
    for i in range(CHART_MINUTES):
        minute = now_minute - (CHART_MINUTES - 1 - i)
        ok, failed = by_minute.get(minute, (0, 0))
        x = i * 6
        h_ok = round(height * ok / top)
        h_failed = round(height * failed / top)
        if h_ok:
            bars.append(
                f'<rect class="ok" x="{x}" y="{height - h_ok}" width="{bar}" height="{h_ok}">'
                f"<title>{ok} succeeded</title></rect>"
            )
        if h_failed:
            y = height - h_ok - h_failed
            bars.append(
                f'<rect class="failed" x="{x}" y="{y}" width="{bar}" height="{h_failed}">'
                f"<title>{failed} failed</title></rect>"
            )
    total_ok = sum(ok for ok, _ in by_minute.values())
    total_failed = sum(f for _, f in by_minute.values())
    return (
        f'<svg class="chart" viewBox="0 0 {width} {height}" width="{width}" height="{height}" '
        f'role="img" aria-label="invocations per minute, last hour">{"".join(bars)}</svg>'
        f'<p class="legend"><span class="ok">{total_ok} succeeded</span> · '
        f'<span class="failed">{total_failed} failed</span> in the last hour (per minute)</p>'
    )


def _family(name: str, fam: dict[str, Any], sup: dict[str, Any], now_minute: int) -> str:
    leader = "this replica" if sup.get("leader") else f"holder {sup.get('holder') or '-'}"
    running = [
        [r.get("scope"), f"{float(r.get('age', 0)):.1f} s"] for r in fam.get("running_scopes", [])
    ]
    failing = [
        [
            f.get("scope"),
            f.get("consecutive_failures"),
            f.get("error_type"),
            f.get("error"),
            f.get("next_attempt_at"),
            "yes" if f.get("parked") else "",
        ]
        for f in fam.get("failing", [])
    ]
    status = fam.get("status", "ok")
    paused = " · paused" if fam.get("paused") else ""
    return (
        f'<section class="family" data-family="{_e(name)}">'
        f'<h2>{_e(name)} <span class="badge {_e(status)}">{_e(status)}{_e(paused)}</span></h2>'
        f'<p class="facts">policy {_e(fam.get("policy"))} · next check {_e(fam.get("due_at"))} · '
        f"leader: {_e(leader)} (key {_e(sup.get('key'))}, term {_e(sup.get('generation'))})</p>"
        f'<p class="facts">running {_e(fam.get("running"))} / {_e(fam.get("budget"))} · '
        f"ready {_e(fam.get('ready'))} · waiting to retry {_e(fam.get('retry_wait'))} · "
        f"unacknowledged {_e(fam.get('unacknowledged'))}"
        + (f" · reason: {_e(fam.get('reason'))}" if fam.get("reason") else "")
        + "</p>"
        + "<h3>Running</h3>"
        + _table(["scope", "age"], running, "nothing running")
        + f"<h3>Failing ({_e(fam.get('failing_count', 0))})</h3>"
        + _table(
            ["scope", "failures", "error type", "error", "next attempt", "parked"],
            failing,
            "no failing Scope",
        )
        + chart(fam.get("history", []), now_minute)
        + "</section>"
    )


def body(snapshot: StatusSnapshot | None, error: str | None, now_minute: int) -> str:
    """The page's ``main`` content for ``snapshot`` (``console.js`` renders the same)."""
    if snapshot is None:
        return f'<p class="error">status unavailable: {_e(error)}</p>'
    ready = evaluate_readiness(
        snapshot, heartbeat_age=snapshot.get("heartbeat_age"), liveness_timeout=30.0
    )
    parts = [
        f'<p class="facts">role {_e(snapshot.get("role"))} · mode {_e(snapshot.get("mode"))} · '
        f'readiness <span class="badge {_e(ready["status"])}">{_e(ready["status"])}</span>'
        + (f" · {_e(ready['reason'])}" if ready.get("reason") else "")
        + "</p>"
    ]
    replicas = snapshot.get("replicas")
    if replicas is not None:
        rows: list[list[object]] = [
            [
                r.get("replica_id", "")[:8],
                r.get("host"),
                r.get("pid"),
                r.get("role"),
                ", ".join(r.get("leads", [])) or "standby",
                r.get("last_seen"),
            ]
            for r in replicas
        ]
        parts.append(
            "<h2>Replicas</h2>"
            + _table(["replica", "host", "pid", "role", "leads", "last seen"], rows, "none")
        )
    for sup in snapshot.get("supervisors", []):
        for name, fam in sorted(sup.get("families", {}).items()):
            parts.append(_family(name, dict(fam), dict(sup), now_minute))
    return "".join(parts)


def page(snapshot: StatusSnapshot | None, error: str | None, now_minute: int) -> bytes:
    return (
        "<!doctype html>"
        '<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        "<title>apsup console</title>"
        '<link rel="icon" href="favicon.svg" type="image/svg+xml">'
        '<link rel="stylesheet" href="console.css"></head>'
        f'<body><header><h1>apsup</h1><span id="updated">rendered by the host</span></header>'
        f'<main id="console" data-refresh="{REFRESH_SECONDS}">'
        f"{body(snapshot, error, now_minute)}</main>"
        '<script src="console.js"></script></body></html>'
    ).encode()
