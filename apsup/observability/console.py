"""The web console: ``GET /`` on any replica's listener, the page a person on call opens.

It renders the cluster view (``apsup.observability.cluster``), so every replica's page tells
the same story, read from the shared database plus each leader's live figures: first what
needs attention, then one row per replica, the leadership changes this replica has seen, and
per family its leader (by replica name) and term, running Workers against the budget, the ready
backlog, Scopes waiting to retry, parked and unacknowledged counts, the failing Scopes worst
first with their redacted errors, and a chart of invocations per minute over the last hour.

The page is complete without JavaScript. ``console.js`` (served by the same listener) swaps in
``console-main``, the same ``main`` rendered here, every few seconds while the tab is visible:
one renderer, and every value in it HTML-escaped here. Nothing is fetched from anywhere else
(``Content-Security-Policy: default-src 'self'``) and every link is relative, so the page also
works behind a reverse proxy under a path prefix. Read-only: served for GET and HEAD only.
"""

from __future__ import annotations

import html
import urllib.parse
from importlib import resources
from typing import Any

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


class Link:
    """A table cell that links to another console page (relative URL, text escaped)."""

    def __init__(self, text: object, href: str) -> None:
        self.text, self.href = text, href

    def html(self) -> str:
        return f'<a href="{_e(self.href)}">{_e(self.text)}</a>'


def scope_href(family: str, scope_id: str) -> str:
    return "scope?" + urllib.parse.urlencode({"family": family, "id": scope_id})


def action_form(csrf: str, action: str, family: str, scope: str, back: str, label: str) -> str:
    """A POST form for one operator action (``console_actions``), carrying the session's CSRF
    token; ``back``: the relative page to return to."""
    hidden = {"csrf": csrf, "action": action, "family": family, "scope": scope, "back": back}
    fields = "".join(f'<input type="hidden" name="{k}" value="{_e(v)}">' for k, v in hidden.items())
    return (
        f'<form class="action" method="post" action="action">{fields}'
        f'<button type="submit" data-action="{_e(action)}">{_e(label)}</button></form>'
    )


def _cell(value: object) -> str:
    return value.html() if isinstance(value, Link) else _e(value)


def _table(headers: list[str], rows: list[list[object]], empty: str, cls: str = "") -> str:
    if not rows:
        return f'<p class="empty">{_e(empty)}</p>'
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{_cell(c)}</td>" for c in r) + "</tr>" for r in rows)
    attr = f' class="{_e(cls)}"' if cls else ""
    return f"<table{attr}><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _waits(fam: dict[str, Any]) -> bool:
    return bool(fam.get("unacknowledged")) and bool(fam.get("oldest_request_age"))


def _age(seconds: object) -> str:
    """A duration for people: 45 s, 12 min, 3.5 h."""
    if not isinstance(seconds, int | float):
        return "-"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def chart(history: list[list[int]], now_minute: int) -> str:
    """An inline SVG bar chart with axes: succeeded (class ok) and failed (class failed)
    invocations per minute over the last ``CHART_MINUTES`` minutes (no plotting library)."""
    by_minute = {int(m): (int(ok), int(failed)) for m, ok, failed in history}
    left, plot_h, bottom, bar = 34, 60, 14, 5
    width = left + CHART_MINUTES * 6
    top = max([ok + failed for ok, failed in by_minute.values()] + [1])
    parts: list[str] = [
        f'<line class="axis" x1="{left - 2}" y1="0" x2="{left - 2}" y2="{plot_h}"/>',
        f'<line class="axis" x1="{left - 2}" y1="{plot_h}" x2="{width}" y2="{plot_h}"/>',
        f'<text class="tick" x="{left - 5}" y="9" text-anchor="end">{top}</text>',
        f'<text class="tick" x="{left - 5}" y="{plot_h}" text-anchor="end">0</text>',
        f'<text class="tick" x="{left}" y="{plot_h + bottom - 2}">-60 min</text>',
        f'<text class="tick" x="{left + 30 * 6}" y="{plot_h + bottom - 2}" '
        'text-anchor="middle">-30 min</text>',
        f'<text class="tick" x="{width}" y="{plot_h + bottom - 2}" text-anchor="end">now</text>',
    ]
    for i in range(CHART_MINUTES):
        minute = now_minute - (CHART_MINUTES - 1 - i)
        ok, failed = by_minute.get(minute, (0, 0))
        x = left + i * 6
        h_ok = round(plot_h * ok / top)
        h_failed = round(plot_h * failed / top)
        if h_ok:
            parts.append(
                f'<rect class="ok" x="{x}" y="{plot_h - h_ok}" width="{bar}" height="{h_ok}">'
                f"<title>{ok} succeeded</title></rect>"
            )
        if h_failed:
            y = plot_h - h_ok - h_failed
            parts.append(
                f'<rect class="failed" x="{x}" y="{y}" width="{bar}" height="{h_failed}">'
                f"<title>{failed} failed</title></rect>"
            )
    total_ok = sum(ok for ok, _ in by_minute.values())
    total_failed = sum(f for _, f in by_minute.values())
    height = plot_h + bottom
    return (
        f'<svg class="chart" viewBox="0 0 {width} {height}" width="{width}" height="{height}" '
        f'role="img" aria-label="invocations per minute, last hour">{"".join(parts)}</svg>'
        f'<p class="legend"><span class="ok">{total_ok} succeeded</span> · '
        f'<span class="failed">{total_failed} failed</span> in the last hour '
        "(invocations per minute, as counted by the leader)</p>"
    )


def _leader(fam: dict[str, Any]) -> str:
    lease = fam.get("leader")
    if lease is None:
        return "no Lease yet"
    if lease.get("state") != "active":
        key, state, term = lease.get("key"), lease.get("state"), lease.get("generation")
        return f"none (Lease {key} {state}, term {term})"
    who = lease.get("replica") or (str(lease.get("holder") or "-")[:8])
    return f"{who} (Lease {lease.get('key')}, term {lease.get('generation')})"


def _failing_state(f: dict[str, Any]) -> str:
    if f.get("parked"):
        return "parked"
    return f"retry at {f['next_attempt_at']}" if f.get("next_attempt_at") else "-"


def _family_actions(name: str, fam: dict[str, Any], csrf: str | None) -> str:
    if csrf is None:
        return ""
    back = "./#family-" + urllib.parse.quote(name)
    forms = [
        action_form(csrf, "resume", name, "", back, "resume")
        if fam.get("paused")
        else action_form(csrf, "pause", name, "", back, "pause")
    ]
    if fam.get("failing_count"):
        forms.append(action_form(csrf, "retry-failing", name, "", back, "retry all failing"))
    return f'<div class="actions">{"".join(forms)}</div>'


def _family(name: str, fam: dict[str, Any], now_minute: int, csrf: str | None = None) -> str:
    running = [
        [
            Link(r.get("scope"), scope_href(name, str(r.get("scope")))),
            f"{float(r.get('age', 0)):.1f} s",
            r.get("pid"),
        ]
        for r in fam.get("running_scopes", [])
    ]
    failing = [
        [
            Link(f.get("scope"), scope_href(name, str(f.get("scope")))),
            f.get("consecutive_failures"),
            f.get("error_type"),
            f.get("error"),
            f.get("failed_at"),
            _failing_state(f),
        ]
        for f in fam.get("failing", [])
    ]
    status = fam.get("status") or "no live figures"
    live = fam.get("budget") is not None
    counts = (
        f"running {_e(fam.get('running'))} / {_e(fam.get('budget'))} · "
        f"ready {_e(fam.get('ready'))} · waiting to retry {_e(fam.get('retry_wait'))} · "
        if live
        else "live figures unavailable (no leader answered) · "
    )
    return (
        f'<section class="family" id="family-{_e(name)}" data-family="{_e(name)}">'
        f'<h2>{_e(name)} <span class="badge {_e(status)}">{_e(status)}</span></h2>'
        f'<p class="facts">leader: <span class="leader">{_e(_leader(fam))}</span> · '
        f"policy {_e(fam.get('policy'))} · next check {_e(fam.get('due_at'))}</p>"
        f'<p class="facts">{counts}'
        f"parked {_e(fam.get('parked_count', 0))} · "
        f"unacknowledged {_e(fam.get('unacknowledged'))}"
        + (f" (oldest {_e(_age(fam.get('oldest_request_age')))})" if _waits(fam) else "")
        + f" · dirty {_e(fam.get('dirty'))}"
        + (f" · {_e(fam.get('reason'))}" if fam.get("reason") else "")
        + "</p>"
        + _family_actions(name, fam, csrf)
        + "<h3>Running</h3>"
        + _table(["scope", "age", "pid"], running, "nothing running" if live else "not known")
        + f"<h3>Failing ({_e(fam.get('failing_count', 0))})</h3>"
        + _table(
            ["scope", "failures", "error type", "error", "last failure", "state"],
            failing,
            "no failing Scope",
            "failing",
        )
        + chart(fam.get("history", []), now_minute)
        + "</section>"
    )


def _summary(view: dict[str, Any]) -> str:
    summary = view.get("summary") or {"status": "ok", "items": []}
    status = summary["status"]
    items = "".join(f"<li>{_e(i['text'])}</li>" for i in summary["items"])
    return (
        f'<section class="summary"><h2>Cluster <span class="badge {_e(status)}">{_e(status)}'
        f"</span></h2>"
        + (f"<ul>{items}</ul>" if items else '<p class="empty">nothing needs attention</p>')
        + f'<p class="facts">database {_e(view.get("database"))} · database time '
        f"{_e(view.get('database_time'))} · this page: {_e(_source(view))}</p></section>"
    )


def _source(view: dict[str, Any]) -> str:
    host = view.get("host") or {}
    role = host.get("role") or "-"
    return f"a {role} replica's console, the same cluster view as every replica's"


def _replicas(view: dict[str, Any]) -> str:
    rows: list[list[object]] = [
        [
            r["replica"],
            r["state"] + (f" since {r['vanished_at']}" if r.get("vanished_at") else ""),
            r["host"],
            f"{r['role']}/{r['mode']}",
            ", ".join(r["leads"]) or "standby",
            len(r["processes"]),
            f"{r['age']:.1f} s ago",
        ]
        for r in view.get("replicas", [])
    ]
    return "<h2>Replicas</h2>" + _table(
        ["replica", "state", "host", "role/mode", "leads", "processes", "last seen"],
        rows,
        "no membership rows (a SQLite host is the only replica)",
        "replicas",
    )


def _events(view: dict[str, Any]) -> str:
    rows: list[list[object]] = [
        [e["at"], e["key"], e["from"] or "-", e["to"], e["term"], e["why"]]
        for e in view.get("events", [])
    ]
    return "<h2>Leadership changes</h2>" + _table(
        ["when", "Lease", "from", "to", "term", "why"],
        rows,
        "none seen since this replica started",
        "events",
    )


def search_form(view: dict[str, Any], family: str | None = None, text: str = "") -> str:
    """Search a family's Scopes by exact id or prefix (a GET: the result is deep-linkable)."""
    options = "".join(
        f'<option value="{_e(n)}"{" selected" if n == family else ""}>{_e(n)}</option>'
        for n in view.get("families", {})
    )
    return (
        '<form class="search" action="search" method="get">'
        f'<label>family <select name="family">{options}</select></label> '
        f'<label>Scope id or prefix <input name="q" value="{_e(text) if text else ""}" '
        'required maxlength="512"></label> <button type="submit">Search</button></form>'
    )


def search_body(view: dict[str, Any], family: str, text: str, found: list[str]) -> str:
    rows: list[list[object]] = [[Link(s, scope_href(family, s))] for s in found]
    return (
        search_form(view, family, text)
        + f"<h2>Scopes of {_e(family)} matching {_e(text)}</h2>"
        + _table(["scope"], rows, "no Scope has this id or prefix", "results")
        + '<p><a href="./">back to the cluster</a></p>'
    )


def _scope_actions(detail: dict[str, Any], csrf: str | None) -> str:
    if csrf is None or not detail["known"]:
        return ""
    family, scope = detail["family"], detail["scope"]
    back = scope_href(family, scope)
    state = detail["state"] or {}
    forms = []
    if state.get("consecutive_failures"):
        forms.append(action_form(csrf, "retry", family, scope, back, "retry now"))
    if state.get("parked"):
        forms.append(action_form(csrf, "unpark", family, scope, back, "unpark"))
    else:
        forms.append(action_form(csrf, "park", family, scope, back, "park"))
    forms.append(action_form(csrf, "stop", family, scope, back, "stop and park"))
    return f'<div class="actions">{"".join(forms)}</div>'


def scope_body(
    detail: dict[str, Any] | None, family: str, scope_id: str, csrf: str | None = None
) -> str:
    """One Scope's page (``scope_view.scope_detail``); ``csrf``: a session's token (its
    action buttons are shown)."""
    if detail is None:
        return f'<p class="error">no family {_e(family)} in this cluster</p>'
    gens = detail["generations"]
    state = detail["state"]
    running = detail["running"]
    if running is not None:
        now = (
            f"running on {_e(running['replica'])} (pid {_e(running['pid'])}, "
            f"{float(running['age'] or 0):.1f} s, G {_e(running['generation'])})"
        )
    elif state is not None and state["parked"]:
        now = "parked by the operator (apsup scopes unpark)"
    elif state is not None and state["next_attempt_at"]:
        now = f"waiting to retry at {_e(state['next_attempt_at'])}"
    elif gens is not None and gens["requested"] > gens["handled"]:
        now = "requested, waiting for a Worker"
    elif gens is not None and gens["dirty"] > gens["clean"]:
        now = "dirty, waiting for the next check"
    elif detail["known"]:
        now = "idle: everything requested is handled"
    else:
        now = "unknown: never requested or marked dirty"
    facts = [["state now", now]]
    if gens is not None:
        facts += [
            ["requested / handled", f"{gens['requested']} / {gens['handled']}"],
            ["dirty / clean", f"{gens['dirty']} / {gens['clean']}"],
        ]
    if state is not None:
        facts += [
            ["consecutive failures", state["consecutive_failures"]],
            ["last error", f"{state['error_type'] or '-'}: {state['error'] or ''}"],
            ["last failure", state["last_failure_at"]],
        ]
        if state["stop_requested"] or state["retry_requested"]:
            asked = "stop" if state["stop_requested"] else "retry"
            facts.append(["operator", f"{asked} asked, not yet carried out by the leader"])
    rows = "".join(f"<tr><th>{_e(k)}</th><td>{_e(v) if k != 'state now' else v}</td></tr>"
                   for k, v in facts)  # fmt: skip
    back = "search?" + urllib.parse.urlencode({"family": family, "q": scope_id})
    return (
        f'<section class="scope"><h2>{_e(scope_id)} <span class="badge">{_e(family)}</span></h2>'
        f'<table class="scope-facts"><tbody>{rows}</tbody></table>'
        f"{_scope_actions(detail, csrf)}</section>"
        f'<p><a href="{_e(back)}">'
        'search this family</a> · <a href="./">back to the cluster</a></p>'
    )


def body(
    view: dict[str, Any] | None, error: str | None, now_minute: int, csrf: str | None = None
) -> str:
    """The page's ``main`` content for the cluster ``view`` (``console-main`` serves it)."""
    if view is None:
        return f'<p class="error">cluster view unavailable: {_e(error)}</p>'
    parts = [_summary(view), search_form(view), _replicas(view), _events(view)]
    for name, fam in view.get("families", {}).items():
        parts.append(_family(name, dict(fam), now_minute, csrf))
    if not view.get("families"):
        parts.append('<p class="empty">no families yet: nothing requested or scanned</p>')
    return "".join(parts)


def _csrf(session: str | None) -> str | None:
    return None if session in (None, "off", "login") else session


def _session_bar(session: str | None) -> str:
    if session is None or session == "off":
        return '<span class="session">read-only (no console credential configured)</span>'
    if session == "login":
        return '<span class="session"><a href="login">log in to act</a></span>'
    return (
        '<form class="session" method="post" action="logout">'
        f'<input type="hidden" name="csrf" value="{_e(session)}">'
        '<button type="submit">log out</button></form>'
    )


def login_body(error: str | None = None) -> str:
    """The login form: the console token, POSTed (never in a URL)."""
    return (
        "<h2>Log in to act</h2>"
        + (f'<p class="error">{_e(error)}</p>' if error else "")
        + '<form class="login" method="post" action="login">'
        '<label>console token <input type="password" name="token" required '
        'autocomplete="current-password"></label> <button type="submit">Log in</button></form>'
        '<p class="facts">The token is the content of the file named by CONSOLE_TOKEN_FILE '
        "(or CONSOLE_TOKEN) on this replica.</p>"
    )


def page(
    view: dict[str, Any] | None,
    error: str | None,
    now_minute: int,
    *,
    main: str | None = None,
    source: str = "console-main",
    session: str | None = None,
    flash: list[str] | None = None,
) -> bytes:
    """The whole page; ``main``: its content (the cluster's by default), ``source``: the
    relative URL ``console.js`` refreshes it from; ``session``: "off" (no credential
    configured), "login" (one is, this reader has no session) or a session's CSRF token;
    ``flash``: the outcome of the last actions."""
    content = body(view, error, now_minute, _csrf(session)) if main is None else main
    notes = "".join(f'<p class="flash">{_e(m)}</p>' for m in flash or [])
    return (
        "<!doctype html>"
        '<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        '<meta name="color-scheme" content="light dark">'
        "<title>apsup console</title>"
        '<link rel="icon" href="favicon.svg" type="image/svg+xml">'
        '<link rel="stylesheet" href="console.css"></head>'
        f'<body><header><h1><a href="./">apsup</a></h1>'
        f'<span id="updated">rendered by the host</span>{_session_bar(session)}</header>'
        f'<div id="flash">{notes}</div>'
        f'<main id="console" data-refresh="{REFRESH_SECONDS}" data-source="{_e(source)}">'
        f"{content}</main>"
        '<script src="console.js"></script></body></html>'
    ).encode()
