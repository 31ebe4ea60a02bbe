"""The ``apsup status`` command: the cluster view (``apsup.observability.cluster``), built here
from the database (``--db``) or read from a replica's ``/cluster`` (``--url`` alone), printed
once or redrawn (``apsup.observability.status_view`` reads and renders; this module runs it).

Exit codes: 0 ok, 1 the database (or the replica) could not be read, 2 missing or unmigrated
database or bad arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from typing import Any, TextIO

import orjson
from sqlalchemy.engine import make_url
from sqlalchemy.exc import SQLAlchemyError

from apsup.errors import ConfigError
from apsup.observability.cluster import collect
from apsup.observability.logging import exception_message, redact, register_dsn
from apsup.observability.status_view import (
    EXIT_MISSING,
    EXIT_OK,
    EXIT_UNREADABLE,
    HOST_TIMEOUT,
    StatusUnavailable,
    discover_url,
    display_url,
    fetch_host_status,
    lease_seconds_from_env,
    local_listener,
    member_listener,
    open_checked,
    render_text,
)
from apsup.store import backend_kind, membership, redact_url

_CLEAR = "\x1b[H\x1b[2J"  # home, clear: the live view redraws in place


def _collect(backend: Any, db_url: str, host_url: str | None) -> dict[str, Any]:
    """The cluster view from the database: ``host_url``'s snapshot (if any) plus every other
    leader's, found through membership (a dedicated replica's families live in several
    processes, each its own leader)."""
    snap, host_error = (None, "") if host_url is None else fetch_host_status(host_url)
    shown = display_url(host_url) if host_url else None

    def own(m: membership.Member) -> bool:  # asked already, as host_url
        return (
            snap is not None
            and m.http_address is not None
            and (display_url(m.http_address) == shown)
        )

    return collect(
        backend,
        db_url,
        lease_seconds=lease_seconds_from_env(),
        local=snap,
        local_url=host_url,
        local_error=host_error,
        own=own,
    )


def fetch_cluster(
    url: str, timeout: float = HOST_TIMEOUT * 3, token: str | None = None
) -> dict[str, Any]:
    """A replica's cluster view (``/cluster``), for ``apsup status --url`` without ``--db``:
    the replica reads the database, so the operator needs no database credentials for it.
    ``token``: the console token, sent as a Bearer credential (a replica answers a client
    beyond loopback only with it)."""
    parts = urllib.parse.urlsplit(url)
    endpoint = urllib.parse.urlunsplit(
        (parts.scheme, parts.netloc, parts.path.rstrip("/") + "/cluster", "", "")
    )
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    request = urllib.request.Request(endpoint)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with opener.open(request, timeout=timeout) as resp:
            doc = orjson.loads(resp.read(8 * 1024 * 1024))
    except urllib.error.HTTPError as exc:
        detail = ""
        with contextlib.suppress(Exception):
            detail = str(orjson.loads(exc.read(64 * 1024)).get("error") or "")
        raise StatusUnavailable(
            f"{display_url(url)} answered HTTP {exc.code} for /cluster"
            + (f": {redact(detail)[:200]}" if detail else "")
            + (
                " (pass --token-file with the replicas' console token, or --db URL)"
                if exc.code in (401, 403)
                else " (an apsup listener of this version serves it; or pass --db URL)"
            ),
            EXIT_UNREADABLE,
        ) from None
    except (OSError, orjson.JSONDecodeError) as exc:
        reason = getattr(exc, "reason", exc)
        raise StatusUnavailable(
            f"cannot read {display_url(url)}/cluster: {type(reason).__name__}: "
            f"{exception_message(reason, 120)} (is the replica running? or pass --db URL)",
            EXIT_UNREADABLE,
        ) from None
    if not isinstance(doc, dict) or not isinstance(doc.get("families"), dict):
        raise StatusUnavailable(
            f"{display_url(url)}/cluster is not an apsup cluster view", EXIT_UNREADABLE
        )
    return doc


def _fail(message: str, code: int, err: TextIO) -> int:
    err.write(f"apsup status: {message}\n")
    err.flush()
    return code


def main(
    args: argparse.Namespace,
    out: TextIO | None = None,
    err: TextIO | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """``apsup status``; ``args`` has ``db``, ``url``, ``once``, ``json``, ``interval``."""
    out = out or sys.stdout
    err = err or sys.stderr
    problem = _bad_arguments(args)
    if problem is not None:
        return _fail(problem, EXIT_MISSING, err)
    interval = float(args.interval)
    if args.url and not args.db:  # the replica reads the database for us
        return _remote(args, interval, out, err, sleep)
    if args.db:
        db_url = str(args.db)
    else:
        from apsup.config import Settings

        db_url = str(Settings.database_url_from_env())  # ConfigError -> exit 2 in the CLI
    with contextlib.suppress(Exception):
        if make_url(db_url).password:
            register_dsn(db_url)  # any driver message quoting the DSN or password is masked
    host_url = args.url or discover_url() or local_listener(db_url)
    if host_url is None and backend_kind(db_url) != "sqlite":
        host_url = member_listener(db_url)  # a replica's row names its listener
    try:
        backend = open_checked(db_url)
    except StatusUnavailable as exc:
        return _fail(str(exc), exc.code, err)
    try:
        return _run(backend, db_url, host_url, args, interval, out, err, sleep)
    finally:
        backend.dispose()


def _run(
    backend: Any,
    db_url: str,
    host_url: str | None,
    args: argparse.Namespace,
    interval: float,
    out: TextIO,
    err: TextIO,
    sleep: Callable[[float], None],
) -> int:
    def collect() -> dict[str, Any]:
        try:
            return _collect(backend, db_url, host_url)
        except (SQLAlchemyError, OSError) as exc:
            message = (
                f"cannot read {redact_url(db_url)}: {type(exc).__name__}: {exception_message(exc)}"
            )
            raise StatusUnavailable(message, EXIT_UNREADABLE) from None

    return _show(
        collect, f"apsup status  ·  {redact_url(db_url)}\n", args, interval, out, err, sleep
    )


def _bad_arguments(args: argparse.Namespace) -> str | None:
    """What to change in the arguments (checked before anything is read), or None."""
    if args.url and urllib.parse.urlsplit(args.url).scheme not in ("http", "https"):
        return (
            "--url must be a replica's HTTP endpoint, e.g. http://127.0.0.1:8080 "
            f"(got {display_url(args.url)})"
        )
    interval = float(args.interval)
    if not (args.once or args.json or interval > 0):
        return f"--interval must be > 0 seconds, got {interval:g}"
    return None


def _remote(
    args: argparse.Namespace,
    interval: float,
    out: TextIO,
    err: TextIO,
    sleep: Callable[[float], None],
) -> int:
    """``apsup status --url`` alone: render the replica's ``/cluster``."""
    try:
        token = _token(getattr(args, "token_file", None))
    except ConfigError as exc:
        return _fail(str(exc), EXIT_MISSING, err)
    return _show(lambda: fetch_cluster(args.url, token=token), "", args, interval, out, err, sleep)


def _token(path: str | None) -> str | None:
    """The console token: ``--token-file``, else the replicas' own configuration."""
    from apsup.config import DEFAULT_PREFIX, Settings

    if path is None:
        return Settings.console_token_from_env()
    name = DEFAULT_PREFIX + "CONSOLE_TOKEN_FILE"
    try:
        return Settings.console_token_from_env({name: path})
    except ConfigError as exc:
        problems = getattr(exc, "problems", None) or [str(exc)]
        raise ConfigError("; ".join(problems).replace(name, "--token-file")) from None


def _show(
    collect: Callable[[], dict[str, Any]],
    title: str,
    args: argparse.Namespace,
    interval: float,
    out: TextIO,
    err: TextIO,
    sleep: Callable[[float], None],
) -> int:
    """Print the view ``collect`` builds (``StatusUnavailable``: why not) once (``--json``,
    ``--once``) or every ``interval`` seconds until Ctrl-C, keeping the last one shown."""
    if args.json or args.once:
        try:
            view = collect()
        except StatusUnavailable as exc:
            return _fail(str(exc), exc.code, err)
        if args.json:
            out.write(orjson.dumps(view, option=orjson.OPT_INDENT_2).decode() + "\n")
        else:
            out.write(render_text(view))
        out.flush()
        return EXIT_OK

    tty = out.isatty()
    last: dict[str, Any] | None = None
    previous = _quit_on_ctrl_c()
    try:
        while True:
            error: str | None = None
            try:
                last = collect()
            except StatusUnavailable as exc:
                error = str(exc)
            text = (
                render_text(last, error)
                if last is not None
                else f"{title}refresh failed: {error}\n"
            )
            footer = f"\nrefreshing every {interval:g}s  ·  Ctrl-C to quit\n"
            out.write((_CLEAR + text + footer) if tty else (text + footer + "\n"))
            out.flush()
            sleep(interval)
    except KeyboardInterrupt:
        if tty:
            out.write("\n")
        return EXIT_OK
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


def _quit_on_ctrl_c() -> Any:
    """Make SIGINT end the live view even when it was started with SIGINT ignored (a shell's
    background job, a CI runner): the view says "Ctrl-C to quit" and must keep that promise.
    Returns the handler to restore, None when nothing was installed (not the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGINT, signal.default_int_handler)
