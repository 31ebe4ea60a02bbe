"""One small HTTP server per process: ``/healthz``, ``/readyz``, ``/metrics``, ``/status``.

stdlib ``ThreadingHTTPServer`` on a daemon thread, bound to 127.0.0.1 unless told otherwise
(``prometheus_client.start_http_server`` would bind 0.0.0.0). Handlers only read: a
``Heartbeat`` the loop touches, the metrics registry, and a ``StatusProvider`` snapshot, so a
slow or failing scrape can never stall scheduling.

- ``/healthz`` liveness: 200 while the loop heartbeat is younger than ``liveness_timeout``,
  else 503. Without a heartbeat or provider (metrics-only server) it reports the process up.
- ``/readyz``: ``evaluate_readiness`` of the snapshot; 503 only for ``down`` (a healthy standby
  answers 200 with status ``standby``).
- ``/metrics``: Prometheus exposition, format negotiated from ``Accept`` by prometheus-client.
- ``/status``: this process's own snapshot (what it leads, from memory).
- ``/cluster``: the cluster view (``apsup.observability.cluster``): durable state plus every
  leader's ``/status``, the same from any replica; ``apsup status`` and the console show it.
- ``/``: the web console (``apsup.observability.console``) of the cluster view, with
  ``console-main`` (its refreshed content), ``console.js`` and ``console.css``; every response
  carries ``Content-Security-Policy: default-src 'self'``.
"""

from __future__ import annotations

import html
import logging
import socket
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

import orjson
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from apsup.errors import ApsupError
from apsup.observability import console
from apsup.observability.console_auth import ConsoleAuth, Session, is_loopback
from apsup.observability.logging import redact
from apsup.observability.status import (
    StatusProvider,
    StatusSnapshot,
    SupervisorStatus,
    evaluate_readiness,
)

_log = logging.getLogger(__name__)

JSON = "application/json"


#: The console's pages (who may read them: ``console_auth``); health, readiness, metrics and
#: ``/status`` are not among them.
CONSOLE_PATHS = frozenset(
    {"/", "/console-main", "/scope", "/scope-main", "/search", "/search-main", "/cluster"}
)
#: Largest form a POST may carry.
MAX_FORM_BYTES = 8192
HTML = "text/html; charset=utf-8"


@dataclass(frozen=True)
class Request:
    """What a response may depend on besides the path: who asks, and with which session."""

    client: str
    cookie: str | None = None
    authorization: str | None = None


class ClusterSource(Protocol):
    """The cluster view a listener serves (``apsup.observability.cluster.ClusterProvider``)."""

    def __call__(self) -> dict[str, Any]: ...
    def recent(self) -> dict[str, Any] | None: ...
    def search(self, family: str, text: str) -> tuple[dict[str, Any], list[str] | None]: ...
    def scope(self, family: str, scope_id: str) -> tuple[dict[str, Any], dict[str, Any] | None]: ...
    def act(self, action: str, family: str, scope: str) -> str: ...


class Heartbeat:
    """Monotonic timestamp of the loop's last iteration; ``beat()`` is one float store.

    Starts beaten, so a freshly started process gets ``liveness_timeout`` of grace. An idle loop
    that sleeps until its next deadline must still wake (no database work needed) at least every
    ``liveness_timeout / 3`` to beat, or ``/healthz`` reports it dead.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._last = clock()

    def beat(self) -> None:
        self._last = self._clock()

    def age(self) -> float:
        return max(0.0, self._clock() - self._last)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    app: HealthServer

    def handle_error(self, request: Any, client_address: Any) -> None:
        _log.debug("health server request from %s failed", client_address, exc_info=True)


class _Server6(_Server):
    address_family = socket.AF_INET6


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    timeout = 10  # a stuck client must not hold a handler thread forever

    def _target(self) -> tuple[str, dict[str, str]]:
        path, _, query = self.path.partition("?")
        args = {k: v[0] for k, v in urllib.parse.parse_qs(query, max_num_fields=8).items()}
        return path.rstrip("/") or "/", args

    def _request(self) -> Request:
        return Request(
            client=str(self.client_address[0]),
            cookie=self.headers.get("Cookie"),
            authorization=self.headers.get("Authorization"),
        )

    def do_GET(self) -> None:
        try:
            path, args = self._target()
            code, ctype, body = self.server.app.respond(
                path, self.headers.get("Accept", ""), args, self._request()
            )
        except Exception as exc:  # never let a handler bug take the server down
            code, ctype = 500, JSON
            body = orjson.dumps({"error": redact(f"{type(exc).__name__}: {exc}")[:200]})
        self.send_response(code)
        self._headers(ctype, len(body))
        self.wfile.write(body)

    def do_POST(self) -> None:
        """The console's login, logout and actions (form posts; nothing else accepts POST)."""
        headers: dict[str, str] = {}
        try:
            path, _ = self._target()
            length = int(self.headers.get("Content-Length") or 0)
            if length > MAX_FORM_BYTES:
                code, ctype, body = 413, JSON, orjson.dumps({"error": "form too large"})
            else:
                raw = self.rfile.read(length).decode("utf-8", "replace") if length else ""
                form = {k: v[0] for k, v in urllib.parse.parse_qs(raw, max_num_fields=16).items()}
                code, ctype, body, headers = self.server.app.post(path, form, self._request())
        except Exception as exc:
            code, ctype = 500, JSON
            body = orjson.dumps({"error": redact(f"{type(exc).__name__}: {exc}")[:200]})
        self.send_response(code)
        for name, value in headers.items():
            self.send_header(name, value)
        self._headers(ctype, len(body))
        self.wfile.write(body)

    def _headers(self, ctype: str, length: int) -> None:
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(length))
        self.send_header("Cache-Control", "no-store")
        # The console loads nothing but this listener's own files (``console``).
        self.send_header("Content-Security-Policy", "default-src 'self'")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.end_headers()

    def do_HEAD(self) -> None:
        """Probes and load balancers that use HEAD get GET's status and headers, no body."""
        try:
            path, args = self._target()
            code, ctype, body = self.server.app.respond(
                path, self.headers.get("Accept", ""), args, self._request()
            )
        except Exception:
            code, ctype, body = 500, JSON, b""
        self.send_response(code)
        self._headers(ctype, len(body))

    def log_message(self, format: str, *args: Any) -> None:
        _log.debug("health %s " + format, self.client_address[0], *args)


class HealthServer:
    """Serves the process's health, readiness, metrics and status; ``start()``/``stop()``."""

    def __init__(
        self,
        *,
        metrics: CollectorRegistry | Any = None,
        status: StatusProvider | None = None,
        cluster: ClusterSource | None = None,
        auth: ConsoleAuth | None = None,
        heartbeat: Heartbeat | None = None,
        liveness_timeout: float = 30.0,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        # Anything with a ``registry`` (``SupervisorMetrics``) or a bare registry: duck-typed, so
        # this module does not import metrics (which imports it to serve standalone).
        self.registry: CollectorRegistry | None = getattr(metrics, "registry", metrics)
        self._refresh: Callable[[], None] | None = getattr(metrics, "refresh", None)
        self.status = status
        self.cluster = cluster
        self.auth = auth or ConsoleAuth(None)
        self.heartbeat = heartbeat
        self.liveness_timeout = liveness_timeout
        self._bind = (host, port)
        self._httpd: _Server | None = None
        self._thread: threading.Thread | None = None

    # --- lifecycle ---------------------------------------------------------------------------

    def start(self) -> int:
        """Bind and serve on a daemon thread; returns the bound port (useful with port 0)."""
        if self._httpd is None:
            cls = _Server6 if ":" in self._bind[0] else _Server
            httpd = cls(self._bind, _Handler)
            httpd.app = self
            self._httpd = httpd
            self._thread = threading.Thread(
                target=httpd.serve_forever,
                kwargs={"poll_interval": 0.1},  # bounds how long stop() waits; no I/O per tick
                name="apsup-health",
                daemon=True,
            )
            self._thread.start()
        return self.port

    def stop(self) -> None:
        httpd, thread = self._httpd, self._thread
        self._httpd = self._thread = None
        if httpd is not None:
            httpd.shutdown()
            httpd.server_close()
        if thread is not None:
            thread.join(timeout=5)

    def __enter__(self) -> HealthServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def address(self) -> tuple[str, int]:
        if self._httpd is None:
            raise RuntimeError("HealthServer is not started")
        host, port = self._httpd.server_address[:2]
        return str(host), int(port)

    @property
    def port(self) -> int:
        return self.address[1]

    # --- responses ---------------------------------------------------------------------------

    def _snapshot(self) -> tuple[StatusSnapshot | None, str | None]:
        if self.status is None:
            return None, "no status provider"
        try:
            snap = self.status()
        except Exception as exc:
            return None, redact(f"status provider failed: {type(exc).__name__}: {exc}")[:200]
        if self.heartbeat is not None:
            snap = {**snap, "heartbeat_age": self.heartbeat.age()}
        return snap, None

    def _cluster(self) -> tuple[dict[str, Any] | None, str | None]:
        if self.cluster is None:
            return None, "this listener has no database to read the cluster view from"
        try:
            return self.cluster(), None
        except Exception as exc:
            return None, redact(f"cluster view failed: {type(exc).__name__}: {exc}")[:200]

    def _cluster_degraded(self) -> str | None:
        """Why the last cluster view (if recent) says degraded, else None."""
        view = self.cluster.recent() if self.cluster is not None else None
        summary = (view or {}).get("summary") or {}
        if summary.get("status") != "degraded":
            return None
        return "; ".join(
            i["text"]
            for i in summary.get("items", [])
            if i["kind"] in ("no-leader", "replica-gone")
        )[:300]

    def _liveness(self) -> tuple[int, bytes]:
        if self.heartbeat is not None:
            age: float | None = self.heartbeat.age()
        elif self.status is not None:
            snap, error = self._snapshot()
            if snap is None:
                return 503, orjson.dumps({"status": "down", "reason": error})
            age = snap["heartbeat_age"]
        else:
            return 200, orjson.dumps({"status": "ok", "heartbeat_age": None})
        alive = age is not None and age <= self.liveness_timeout
        body = {"status": "ok" if alive else "down", "heartbeat_age": age}
        return (200 if alive else 503), orjson.dumps(body)

    def respond(
        self,
        path: str,
        accept: str,
        args: dict[str, str] | None = None,
        request: Request | None = None,
    ) -> tuple[int, str, bytes]:
        """(HTTP code, content type, body) for a GET of ``path`` with query ``args``, asked by
        ``request`` (None: an in-process caller, which may read everything)."""
        args = args or {}
        session = self.auth.session(request.cookie) if request is not None else None
        if path == "/login" and self.cluster is not None:
            return self._login_page(session)
        if path in CONSOLE_PATHS and self.cluster is not None:
            refused = self._refused(path, request, session)
            if refused is not None:
                return refused
        if path in ("/scope", "/scope-main", "/search", "/search-main"):
            return self._scope_pages(path, args, session)
        if path in ("/", "/console-main") and self.cluster is not None:
            view, error = self._cluster()
            csrf = session.csrf if session is not None else None
            if path == "/":
                flash = self._take_flash(session)
                return (
                    200,
                    HTML,
                    console.page(
                        view, error, _minute(), session=self._session_state(session), flash=flash
                    ),
                )
            return 200, HTML, console.body(view, error, _minute(), csrf).encode()
        if path == "/cluster" and self.cluster is not None:
            view, error = self._cluster()
            if view is None:
                return 503, JSON, orjson.dumps({"error": error})
            return 200, JSON, orjson.dumps(view, default=str)
        if path.lstrip("/") in console.STATIC:
            name = path.lstrip("/")
            return 200, console.STATIC[name], console.static_file(name)
        if path == "/healthz":
            code, body = self._liveness()
            return code, JSON, body
        if path == "/readyz" and self.status is not None:
            snap, error = self._snapshot()
            age = snap["heartbeat_age"] if snap is not None else None
            ready = evaluate_readiness(
                snap, heartbeat_age=age, liveness_timeout=self.liveness_timeout, error=error
            )
            cluster = self._cluster_degraded()
            if cluster is not None and ready["status"] in ("ok", "standby"):
                # This process is fine; the cluster is not (200 still: restarting this
                # process would not help). Only a view built already counts: a probe never
                # waits for the database or another replica.
                ready = {**ready, "status": "degraded", "reason": f"cluster: {cluster}"}
            return (503 if ready["status"] == "down" else 200), JSON, orjson.dumps(ready)
        if path == "/status" and self.status is not None:
            snap, error = self._snapshot()
            if snap is None:
                return 503, JSON, orjson.dumps({"error": error})
            return 200, JSON, orjson.dumps(snap, default=str)
        if path == "/metrics" and self.registry is not None:
            if self._refresh is not None:
                self._refresh()
            encoder, ctype = choose_encoder(accept)
            return 200, ctype, encoder(self.registry)
        return 404, JSON, orjson.dumps({"error": f"no such endpoint: {path[:64]}"})

    def _scope_pages(
        self, path: str, args: dict[str, str], session: Session | None = None
    ) -> tuple[int, str, bytes]:
        """A Scope's page and the search (``scope?family=F&id=S``, ``search?family=F&q=P``),
        and their refreshed content (``scope-main``, ``search-main``)."""
        html_type = "text/html; charset=utf-8"
        cluster = self.cluster
        family = args.get("family", "")
        key = args.get("id" if path.startswith("/scope") else "q", "")
        if cluster is None:
            return 404, JSON, orjson.dumps({"error": "this listener has no console"})
        if not family or not key:
            what = "id" if path.startswith("/scope") else "q"
            body = f"<p class='error'>pass family=NAME and {what}=... in the URL</p>"
            return 400, html_type, console.page(None, None, _minute(), main=body)
        try:
            if path.startswith("/scope"):
                view, detail = cluster.scope(family, key)
                csrf = session.csrf if session is not None else None
                main = console.scope_body(detail, family, key, csrf)
            else:
                view, found = cluster.search(family, key)
                main = (
                    f"<p class='error'>no family {html.escape(family)} in this cluster</p>"
                    if found is None
                    else console.search_body(view, family, key, found)
                )
        except Exception as exc:
            error = redact(f"{type(exc).__name__}: {exc}")[:200]
            main = f"<p class='error'>cluster view unavailable: {html.escape(error)}</p>"
        if path.endswith("-main"):
            return 200, html_type, main.encode()
        query = urllib.parse.urlencode({"family": family, ("id" if "scope" in path else "q"): key})
        source = f"{path.lstrip('/')}-main?{query}"
        return (
            200,
            html_type,
            console.page(
                None,
                None,
                _minute(),
                main=main,
                source=source,
                session=self._session_state(session),
                flash=self._take_flash(session),
            ),
        )

    # --- access and actions --------------------------------------------------------------

    def _session_state(self, session: Session | None) -> str:
        if not self.auth.enabled:
            return "off"
        return "login" if session is None else session.csrf

    @staticmethod
    def _take_flash(session: Session | None) -> list[str]:
        if session is None or not session.flash:
            return []
        shown, session.flash[:] = list(session.flash), []
        return shown

    def _refused(
        self, path: str, request: Request | None, session: Session | None
    ) -> tuple[int, str, bytes] | None:
        """None if ``request`` may read the console page ``path``, else the refusal."""
        if request is None or is_loopback(request.client) or session is not None:
            return None
        if path == "/cluster" and self.auth.bearer(request.authorization):
            return None
        if not self.auth.enabled:
            reason = (
                "this replica's console answers loopback clients only: reach it through an SSH "
                "tunnel or port-forward, or set CONSOLE_TOKEN_FILE to let operators log in"
            )
            if path == "/cluster":
                return 403, JSON, orjson.dumps({"error": reason})
            return (
                403,
                HTML,
                console.page(
                    None, None, _minute(), main=f"<p class='error'>{html.escape(reason)}</p>"
                ),
            )
        if path == "/cluster":
            return 401, JSON, orjson.dumps({"error": "send Authorization: Bearer <console token>"})
        return (
            200,
            HTML,
            console.page(None, None, _minute(), main=console.login_body(), session="login"),
        )

    def _login_page(self, session: Session | None) -> tuple[int, str, bytes]:
        if not self.auth.enabled:
            main = (
                "<p class='error'>actions are off on this replica: set CONSOLE_TOKEN_FILE (a "
                "file holding a token of 16+ characters) to turn them on</p>"
            )
        elif session is not None:
            main = "<p>You are logged in. <a href='./'>Back to the cluster</a></p>"
        else:
            main = console.login_body()
        return (
            200,
            HTML,
            console.page(None, None, _minute(), main=main, session=self._session_state(session)),
        )

    def post(
        self, path: str, form: dict[str, str], request: Request
    ) -> tuple[int, str, bytes, dict[str, str]]:
        """A console form: ``login`` (the token), ``logout`` and ``action`` (a session and its
        CSRF token required). Answers with a redirect (303) to a console page."""
        if self.cluster is None or path not in ("/login", "/logout", "/action"):
            return 404, JSON, orjson.dumps({"error": f"no such form: {path[:64]}"}), {}
        if path == "/login":
            if not self.auth.enabled:
                return (*self._login_page(None), {})
            session = self.auth.login(form.get("token", ""), request.client)
            if session is None:
                _log.warning("console login refused", extra={"client": request.client})
                page = console.page(
                    None, None, _minute(), main=console.login_body("wrong token"), session="login"
                )
                return 401, HTML, page, {}
            _log.info("console login", extra={"client": request.client})
            return 303, HTML, b"", {"Location": "./", "Set-Cookie": ConsoleAuth.cookie(session)}
        session = self.auth.session(request.cookie)
        if session is None or not ConsoleAuth.csrf_ok(session, form.get("csrf", "")):
            reason = "log in first (or again): the session is missing, expired or not this form's"
            page = console.page(
                None, None, _minute(), main=console.login_body(reason),
                session=self._session_state(None),
            )  # fmt: skip
            return 403, HTML, page, {}
        if path == "/logout":
            self.auth.logout(session)
            return 303, HTML, b"", {"Location": "./", "Set-Cookie": ConsoleAuth.cookie(None)}
        action, family, scope = (
            form.get("action", ""),
            form.get("family", ""),
            form.get("scope", ""),
        )
        try:
            message = self.cluster.act(action, family, scope)
            outcome = "done"
        except Exception as exc:
            message = redact(
                str(exc) if isinstance(exc, ApsupError) else f"{type(exc).__name__}: {exc}"
            )[:300]
            outcome = "refused" if isinstance(exc, ApsupError) else "failed"
        _log.info(
            "console action",
            extra={
                "action": action,
                "family": family,
                "scope": scope or None,
                "who": session.who,
                "outcome": outcome,
                "result": message,
            },
        )
        session.flash.append(message if outcome == "done" else f"{action} {outcome}: {message}")
        return 303, HTML, b"", {"Location": _safe_back(form.get("back", ""))}


def _safe_back(back: str) -> str:
    """A relative console page to return to after an action (never another site)."""
    if back.startswith(("scope?", "search?", "./")) and "//" not in back and "\\" not in back:
        return back
    return "./"


def _minute() -> int:
    return int(time.time() // 60)


def fan_in(
    urls: Sequence[str], *, timeout: float = 2.0, liveness_timeout: float = 30.0
) -> StatusProvider:
    """A StatusProvider merging the ``/status`` of dedicated per-Family Supervisor processes.

    The launcher serves it on its own port so one probe covers the host. A child that does not
    answer, or whose loop heartbeat is stale, contributes a Supervisor with ``lease_error`` set,
    which readiness reports as ``down`` for that child (``degraded`` overall while others run).
    """
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never via a proxy

    def provide() -> StatusSnapshot:
        merged: StatusSnapshot = {
            "role": "background",
            "mode": "dedicated",
            "supervisors": [],
            "heartbeat_age": None,
        }
        for url in urls:
            try:
                with opener.open(url.rstrip("/") + "/status", timeout=timeout) as resp:
                    child: StatusSnapshot = orjson.loads(resp.read())
            except Exception as exc:
                merged["supervisors"].append(_unreachable(url, f"{type(exc).__name__}: {exc}"))
                continue
            merged["role"], merged["mode"] = child["role"], child["mode"]
            if "replicas" in child and "replicas" not in merged:
                merged["replicas"] = child["replicas"]
            age = child.get("heartbeat_age")
            stale = age is None or age > liveness_timeout
            for sup in child["supervisors"]:
                if stale:
                    sup = {**sup, "lease_error": f"loop heartbeat stale at {url}"}
                merged["supervisors"].append(sup)
        return merged

    return provide


def _unreachable(url: str, error: str) -> SupervisorStatus:
    return {
        "key": f"unreachable:{url}",
        "leader": False,
        "holder": None,
        "generation": None,
        "families": {},
        "lease_error": redact(f"status endpoint unreachable: {error}")[:200],
    }
