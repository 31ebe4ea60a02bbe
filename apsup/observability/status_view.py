"""What ``apsup status`` shows: a one-screen, per-family view of the scheduler (RFC §12), read
and merged here, rendered as text here; ``status_cli`` runs the command.

Two sources, merged per family:

- **the database** (always; ``--db URL``, default ``..._DATABASE_URL``): unacknowledged requests
  (``requested > handled``) and dirty scopes (``dirty > clean``) from the index-backed counts in
  ``apsup.store.intents``, the last automatic check from ``binding_states`` (checkpoint, scan
  generation, scan in progress) and the leader of each Lease key (holder, term, expiry).
  Family names come from the database too (distinct binding names of ``intents`` and
  ``binding_states``) so the view needs no ``--app``; the distinct names are read with a loose
  index scan (one ``MIN(binding_name) > last`` seek per family), never by scanning the table.
- **the leaders' ``/status`` endpoints**: the host at ``--url`` (or discovered from
  ``..._HTTP_PORT``/``..._HTTP_HOST``, the address a SQLite host publishes beside its database,
  or a live replica's membership row) and every other live member holding a Lease
  (``apsup.observability.cluster``): the in-memory figures only a Supervisor knows: next due
  time, capacity used/budget, ready, retry-wait and next retry, degraded state, which Supervisor
  (Lease key) owns the family. A leader that does not answer leaves its columns ``-``.

``--url`` without ``--db`` shows that replica's ``/cluster`` instead (the same document, built
by the replica): no database credentials needed.

Modes: ``--json`` prints one JSON document and exits; ``--once`` prints the table once; otherwise
the table is redrawn every ``--interval`` seconds until Ctrl-C (database errors during a refresh
are shown in the header, the view keeps running).

The view never prints a password: the database URL is shown through ``redact_url`` (credentials
and query dropped), error messages pass through the log redactor with the DSN registered, and a
``--url`` is shown without user info. Exit codes: 0 ok, 1 the database could not be read,
2 missing or unmigrated database (the message says to run ``apsup migrate``) or bad arguments.
"""

from __future__ import annotations

import contextlib
import os
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import orjson
from sqlalchemy import Connection, func, inspect, select
from sqlalchemy.exc import DBAPIError

from apsup.errors import ConfigError
from apsup.errors import StatusUnavailable as StatusUnavailable
from apsup.observability.console import CHART_MINUTES
from apsup.observability.logging import exception_message, redact
from apsup.observability.status import StatusSnapshot, evaluate_readiness
from apsup.store import activity, backend_kind, membership, open_backend, operator_state, redact_url
from apsup.store import intents as intent_store
from apsup.store import scans as scan_store
from apsup.store.leases import GLOBAL_KEY, INVALIDATED, LeaseRow, all_leases, dedicated_key
from apsup.store.schema import binding_states, counters, intents, leases

EXIT_OK = 0
EXIT_UNREADABLE = 1
EXIT_MISSING = 2

#: Upper bound on the families listed (one index seek each); more are reported as truncated.
MAX_FAMILIES = 200
HOST_TIMEOUT = 2.0
#: The HealthServer's default liveness limit; readiness shown here applies the server's rules.
LIVENESS_TIMEOUT = 30.0
NO_HOST = "no host status endpoint"
SCHEMA_TABLES = (intents.name, binding_states.name, leases.name, counters.name)


# --- time helpers ----------------------------------------------------------------------------


def _iso(value: datetime | None) -> str | None:
    """Naive UTC (database time) or aware datetime -> ISO-8601 with ``Z``."""
    if value is None:
        return None
    if value.tzinfo is not None:
        value = value.astimezone(UTC).replace(tzinfo=None)
    return value.isoformat() + "Z"


def _parse(value: object) -> datetime | None:
    """An ISO string from ``/status`` (``...Z`` or ``+00:00``) -> naive UTC, else None."""
    if not isinstance(value, str) or not value:
        return None
    text = value[:-1] if value.endswith("Z") else value
    try:
        parsed = datetime.fromisoformat(text)
    except ValueError:
        return None
    if parsed.tzinfo is not None:
        parsed = parsed.astimezone(UTC).replace(tzinfo=None)
    return parsed


def _span(seconds: float) -> str:
    s = round(abs(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def _until(when: datetime | None, now: datetime) -> str:
    if when is None:
        return "-"
    delta = (when - now).total_seconds()
    if abs(delta) < 1:
        return "now"
    return f"in {_span(delta)}" if delta > 0 else f"overdue {_span(delta)}"


def _ago(when: datetime | None, now: datetime) -> str:
    if when is None:
        return "never"
    delta = (now - when).total_seconds()
    if abs(delta) < 1:
        return "just now"
    return f"{_span(delta)} ago" if delta > 0 else f"in {_span(delta)}"


# --- database side ---------------------------------------------------------------------------


#: Failing Scopes listed per family (worst first).
FAILING_LIMIT = 10


@dataclass(frozen=True)
class DbFamily:
    binding: str
    unacknowledged: int
    dirty: int
    scan: scan_store.ScanState | None
    paused: bool = False
    failing_count: int = 0
    failing: tuple[operator_state.ScopeState, ...] = ()
    parked_count: int = 0
    #: [minute, succeeded, failed] of the last hour from the activity table (elected backends).
    history: tuple[tuple[int, int, int], ...] = ()


@dataclass(frozen=True)
class DbView:
    now: datetime
    families: dict[str, DbFamily]
    leases: list[LeaseRow]
    truncated: bool
    members: tuple[membership.Member, ...] = ()


def _distinct_bindings(conn: Connection, limit: int) -> tuple[list[str], bool]:
    """Binding names of intents (loose index scan on the primary key) and binding_states."""
    names: set[str] = set()
    c = intents.c
    last: str | None = None
    while len(names) < limit:
        stmt = select(func.min(c.binding_name))
        if last is not None:
            stmt = stmt.where(c.binding_name > last)
        value = conn.execute(stmt).scalar_one_or_none()
        if value is None:
            break
        names.add(str(value))
        last = str(value)
    rows = conn.execute(
        select(binding_states.c.binding_name).order_by(binding_states.c.binding_name).limit(limit)
    )
    names.update(str(r[0]) for r in rows)
    ordered = sorted(names)
    return ordered[:limit], len(ordered) > limit or len(names) >= limit


def read_database(backend: Any, extra_bindings: Iterable[str] = ()) -> DbView:
    """Counts, scan state and leases in one read transaction (bounded queries only)."""
    now = backend.now()
    with backend.read() as conn:
        names, truncated = _distinct_bindings(conn, MAX_FAMILIES)
        for extra in extra_bindings:
            if extra not in names and len(names) < MAX_FAMILIES:
                names.append(extra)
        controls = operator_state.controls(conn, names)
        since = activity.epoch_minute(now) - CHART_MINUTES + 1
        minutes = activity.recent(conn, names, since)
        families = {
            name: DbFamily(
                binding=name,
                unacknowledged=intent_store.count_pending_requests(conn, name),
                dirty=intent_store.count_dirty(conn, name),
                scan=scan_store.get_state(conn, name),
                paused=bool(name in controls and controls[name].paused),
                failing_count=operator_state.failing_count(conn, name),
                failing=tuple(operator_state.failing(conn, name, FAILING_LIMIT)),
                parked_count=operator_state.parked_count(conn, name),
                history=tuple((m, ok, bad) for m, ok, bad in minutes.get(name, ())),
            )
            for name in sorted(names)
        }
        lease_rows = list(all_leases(conn))
        members = tuple(membership.members(conn))
    return DbView(
        now=now, families=families, leases=lease_rows, truncated=truncated, members=members
    )


def lease_seconds_from_env() -> float:
    """The Lease the replicas run with (``LEASE_SECONDS`` here, else the default 15 s): a
    membership row older than that belongs to a process that is gone."""
    from apsup.config import DEFAULT_LEASE_SECONDS, Settings

    try:
        return Settings.lease_seconds_from_env()
    except ConfigError:  # the replicas refuse to start with it: judge by the default
        return DEFAULT_LEASE_SECONDS


def member_listener(db_url: str) -> str | None:
    """A live replica's HTTP listener from membership (MySQL/OceanBase), a leader's first."""
    try:
        backend = open_backend(db_url)
    except Exception:
        return None
    try:
        now = backend.now()
        with backend.read() as conn:
            members = membership.members(conn)
            held = {
                r.holder_id
                for r in all_leases(conn)
                if r.expires_at is not None and r.expires_at > now
            }
    except Exception:
        return None
    finally:
        backend.dispose()
    live = [m for m in members if m.http_address and m.alive(now, lease_seconds_from_env())]
    live.sort(key=lambda m: (m.holder_id not in held, m.replica_id))
    return live[0].http_address if live else None


def _failing_json(s: operator_state.ScopeState) -> dict[str, Any]:
    return {
        "scope": s.scope_id,
        "consecutive_failures": s.consecutive_failures,
        "error_type": s.last_error_type,
        "error": None if s.last_error is None else redact(s.last_error),  # again: never shown
        "failed_at": _iso(s.last_failure_at),
        "next_attempt_at": _iso(s.next_attempt_at),
        "parked": s.parked,
    }


def _mysql_code(exc: BaseException) -> int | None:
    args = getattr(getattr(exc, "orig", None), "args", ())
    return args[0] if args and isinstance(args[0], int) else None


#: MySQL error numbers / PostgreSQL SQLSTATEs (or, for a refused connect, which carries no
#: SQLSTATE in psycopg, the server's words) of a missing database and of refused credentials.
_NO_DATABASE = {1049, "3D000"}
_DENIED = {1044, 1045, "28000", "28P01"}


def _refusal(exc: BaseException) -> str | None:
    """``"missing"``, ``"denied"`` or None for a driver error met opening the database."""
    orig = getattr(exc, "orig", None)
    code = _mysql_code(exc) or getattr(orig, "sqlstate", None)
    text = str(orig or exc)
    if code in _NO_DATABASE or ('database "' in text and "does not exist" in text):
        return "missing"
    if code in _DENIED or "authentication failed" in text:
        return "denied"
    return None


def open_checked(url: str) -> Any:
    """Open the backend, refusing (exit 2) a missing or unmigrated database; never creates one."""
    shown = redact_url(url)
    try:
        kind = backend_kind(url)
    except ConfigError as exc:
        raise StatusUnavailable(str(exc), EXIT_MISSING) from None
    migrate_hint = "run `apsup migrate --db URL` first"
    if kind == "sqlite":
        from apsup.store.sqlite import database_path

        path = database_path(url)
        if path is None:
            raise StatusUnavailable(
                "an in-memory SQLite database has no status to show; pass --db sqlite:////path",
                EXIT_MISSING,
            )
        if not path.is_file():
            raise StatusUnavailable(
                f"no database at {shown}: {migrate_hint}, or pass --db with the URL the host uses",
                EXIT_MISSING,
            )
    backend = open_backend(url)
    try:
        with backend.read() as conn:
            inspector = inspect(conn)
            missing = [t for t in SCHEMA_TABLES if not inspector.has_table(t)]
    except DBAPIError as exc:
        backend.dispose()
        refusal = _refusal(exc)
        if refusal == "missing":
            raise StatusUnavailable(
                f"database {shown} does not exist: create it and {migrate_hint}", EXIT_MISSING
            ) from None
        if refusal == "denied":
            raise StatusUnavailable(
                f"access to {shown} was denied ({exception_message(exc.orig or exc, 120)}): "
                "check the user and password in the database URL",
                EXIT_MISSING,
            ) from None
        raise StatusUnavailable(
            f"cannot read {shown}: {type(exc.orig or exc).__name__}: "
            f"{exception_message(exc.orig or exc, 160)}",
            EXIT_UNREADABLE,
        ) from None
    except Exception as exc:  # e.g. a driver argument in the URL query the driver rejects
        backend.dispose()
        raise StatusUnavailable(
            f"cannot open {shown}: {type(exc).__name__}: {exception_message(exc, 160)}",
            EXIT_MISSING,
        ) from None
    if missing:
        backend.dispose()
        raise StatusUnavailable(
            f"{shown} has no apsup schema (missing {', '.join(missing)}): {migrate_hint}",
            EXIT_MISSING,
        )
    return backend


# --- host side -------------------------------------------------------------------------------


def display_url(url: str) -> str:
    """An http URL without user info, query or fragment."""
    try:
        parts = urllib.parse.urlsplit(url)
        host = parts.hostname or ""
        port = f":{parts.port}" if parts.port else ""
    except ValueError:
        return "<invalid url>"
    if ":" in host:
        host = f"[{host}]"
    return f"{parts.scheme}://{host}{port}{parts.path}"


def discover_url(env: dict[str, str] | None = None) -> str | None:
    """``http://HTTP_HOST:HTTP_PORT`` from the runtime environment when a fixed port is set."""
    from apsup.config import DEFAULT_PREFIX

    values = os.environ if env is None else env
    raw = (values.get(DEFAULT_PREFIX + "HTTP_PORT") or "").strip()
    try:
        port = int(raw)
    except ValueError:
        return None
    if not 0 < port < 65536:
        return None  # unset, or 0 (an ephemeral port nobody else can know)
    host = (values.get(DEFAULT_PREFIX + "HTTP_HOST") or "").strip() or "127.0.0.1"
    if host in ("0.0.0.0", ""):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}"


def local_listener(db_url: str) -> str | None:
    """The listener a SQLite host on this machine published beside its database."""
    from apsup.supervisor.control import local_listener

    return local_listener(db_url)


def _status_endpoint(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    path = parts.path.rstrip("/")
    if not path.endswith("/status"):
        path += "/status"
    netloc = parts.hostname or ""
    if ":" in netloc:
        netloc = f"[{netloc}]"
    if parts.port:
        netloc += f":{parts.port}"
    return urllib.parse.urlunsplit((parts.scheme, netloc, path, "", ""))


def fetch_host_status(url: str, timeout: float = HOST_TIMEOUT) -> tuple[StatusSnapshot | None, str]:
    """(snapshot, "") or (None, why it is unavailable). Never raises, never uses a proxy."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(_status_endpoint(url), timeout=timeout) as resp:
            body = resp.read(4 * 1024 * 1024)
    except urllib.error.HTTPError as exc:
        detail = ""
        with contextlib.suppress(Exception):
            detail = str(orjson.loads(exc.read(64 * 1024)).get("error") or "")
        return None, f"HTTP {exc.code}" + (f": {redact(detail)[:200]}" if detail else "")
    except Exception as exc:
        reason = getattr(exc, "reason", exc)
        return None, f"{type(reason).__name__}: {exception_message(reason, 120)}"
    try:
        snap = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None, "the endpoint did not answer JSON (is this an apsup health port?)"
    if not isinstance(snap, dict) or not isinstance(snap.get("supervisors"), list):
        return None, "the endpoint's answer is not an apsup status snapshot"
    return snap, ""  # type: ignore[return-value]


# --- merge -----------------------------------------------------------------------------------


def _lease_state(row: LeaseRow, now: datetime) -> str:
    if row.holder_id == INVALIDATED:
        return "released"
    if row.expires_at is not None and row.expires_at <= now:
        return "expired"
    return "active"


def _lease_json(row: LeaseRow, now: datetime) -> dict[str, Any]:
    return {
        "key": row.supervisor_key,
        "holder": row.holder_id or None,
        "generation": row.generation,
        "expires_at": _iso(row.expires_at),
        "state": _lease_state(row, now),
    }


def _choose_lease(
    name: str, by_key: dict[str, LeaseRow], now: datetime, host_key: str | None
) -> LeaseRow | None:
    """The Lease governing ``name``: the host's Supervisor key if known, else the active one of
    ``artifact:<name>`` (dedicated) and ``global``, else whichever exists."""
    if host_key is not None and host_key in by_key:
        return by_key[host_key]
    candidates = [by_key[k] for k in (dedicated_key(name), GLOBAL_KEY) if k in by_key]
    for row in candidates:
        if _lease_state(row, now) == "active":
            return row
    return candidates[0] if candidates else None


def host_families(snap: Mapping[str, Any]) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """family -> (its Supervisor, its FamilyStatus); a leader's entry wins over a standby's.

    The snapshot is another process's JSON: every field is read defensively."""
    found: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {}
    supervisors: Any = snap.get("supervisors") or []
    for sup in supervisors:
        if not isinstance(sup, dict):
            continue
        for name, fam in (sup.get("families") or {}).items():
            if not isinstance(fam, dict):
                continue
            if name not in found or (sup.get("leader") and not found[name][0].get("leader")):
                found[name] = (sup, fam)
    return found


def build_view(
    db_url: str,
    db: DbView,
    host_url: str | None,
    snap: StatusSnapshot | None,
    host_error: str,
    others: Sequence[StatusSnapshot] = (),
) -> dict[str, Any]:
    """The JSON document (the text view renders exactly this). ``others``: more hosts'
    snapshots (the cluster view's leaders); a leader's figures win over a standby's."""
    now = db.now
    host: dict[str, Any] = {"url": display_url(host_url) if host_url else None}
    if snap is None:
        host.update(available=False, error=host_error or NO_HOST)
        in_memory: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {}
    else:
        age = snap.get("heartbeat_age")
        ready = evaluate_readiness(snap, heartbeat_age=age, liveness_timeout=LIVENESS_TIMEOUT)
        host.update(
            available=True,
            error=None,
            role=snap.get("role"),
            mode=snap.get("mode"),
            heartbeat_age=age,
            readiness=ready["status"],
            readiness_reason=ready["reason"],
        )
        in_memory = host_families(snap)
    for other in others:
        for name, (o_sup, o_mem) in host_families(other).items():
            mine = in_memory.get(name)
            if mine is None or (o_sup.get("leader") and not mine[0].get("leader")):
                in_memory[name] = (o_sup, o_mem)

    by_key = {row.supervisor_key: row for row in db.leases}
    families: dict[str, Any] = {}
    for name in sorted(set(db.families) | set(in_memory)):
        dbf = db.families.get(name)
        sup: dict[str, Any] | None = None
        mem: dict[str, Any] | None = None
        if name in in_memory:
            sup, mem = in_memory[name]
        lease = _choose_lease(name, by_key, now, sup.get("key") if sup else None)
        status: str | None = None
        reason: str | None = None
        if sup is not None and mem is not None:
            status, reason = mem.get("status"), mem.get("reason")
            if sup.get("lease_error"):
                status, reason = "lease-error", str(sup.get("lease_error"))
            elif not sup.get("leader") and status != "disabled":
                status = "standby"
        if dbf is not None and dbf.paused:  # whatever its schedule says
            status, reason = "paused", f"paused by the operator (apsup families resume {name})"
        policy = mem.get("policy") if mem else None
        if policy is None and status == "disabled":
            policy = "disabled"
        scan = dbf.scan if dbf else None
        families[name] = {
            "binding": dbf.binding if dbf else name,
            "policy": policy,
            "due_at": mem.get("due_at") if mem else None,
            "status": status,
            "reason": reason,
            "budget": mem.get("budget") if mem else None,
            "running": mem.get("running") if mem else None,
            "ready": mem.get("ready") if mem else None,
            "retry_wait": mem.get("retry_wait") if mem else None,
            "next_retry_at": mem.get("next_retry_at") if mem else None,
            "unacknowledged": dbf.unacknowledged if dbf else None,
            "oldest_request_age": mem.get("oldest_request_age") if mem else None,
            "unconfirmed": mem.get("unconfirmed") if mem else None,
            "dirty": dbf.dirty if dbf else None,
            "last_scan": None
            if scan is None
            else {
                "checkpoint": _iso(scan.checkpoint),
                "generation": scan.scan_generation,
                "in_progress": scan.scan_in_progress,
                "upper_pending_sequence": scan.scan_upper_pending_sequence,
            },
            "paused": dbf.paused if dbf else bool(mem and mem.get("paused")),
            "failing_count": dbf.failing_count if dbf else (mem or {}).get("failing_count", 0),
            "parked_count": dbf.parked_count if dbf else 0,
            "failing": [_failing_json(s) for s in dbf.failing]
            if dbf
            else list((mem or {}).get("failing", [])),
            "running_scopes": list(mem.get("running_scopes") or []) if mem else [],
            "history": _history(dbf.history if dbf else (), mem.get("history") if mem else None),
            "supervisor_key": sup.get("key") if sup else None,
            "host_is_leader": bool(sup.get("leader")) if sup else None,
            "leader": None if lease is None else _lease_json(lease, now),
        }
    return {
        "database": redact_url(db_url),
        "database_time": _iso(now),
        "host": host,
        "leases": [_lease_json(row, now) for row in db.leases],
        "families": families,
        "replicas": [],  # the cluster view fills them in (``cluster.replicas``)
        "truncated": db.truncated,
    }


def _history(
    durable: Sequence[Sequence[int]], live: Sequence[Sequence[int]] | None
) -> list[list[int]]:
    """The chart's minutes: the activity table (every leader's counts, across takeovers) and
    the leader's own memory (its last seconds, not written yet; the only source on SQLite),
    the larger count of each minute."""
    merged: dict[int, list[int]] = {}
    for source in (durable, live or ()):
        for minute, ok, bad in source:
            have = merged.setdefault(int(minute), [int(minute), 0, 0])
            have[1], have[2] = max(have[1], int(ok)), max(have[2], int(bad))
    return [merged[m] for m in sorted(merged)]


# --- text ------------------------------------------------------------------------------------

COLUMNS = (
    "FAMILY",
    "POLICY",
    "NEXT DUE",
    "CAPACITY",
    "READY",
    "RETRY-WAIT",
    "UNACKED",
    "DIRTY",
    "LAST SCAN",
    "LEADER",
    "STATUS",
)
_RIGHT = {"CAPACITY", "READY", "UNACKED", "DIRTY"}


def _dash(value: object) -> str:
    return "-" if value is None else str(value)


def _holder(holder: str | None) -> str:
    return "-" if not holder else holder[:8]


def _leader_cell(lease: dict[str, Any] | None) -> str:
    if lease is None:
        return "-"
    text = f"{lease['key']}#{lease['generation']}"
    if lease["state"] == "active":
        return f"{text} {lease.get('replica') or _holder(lease['holder'])}"
    return f"{text} ({lease['state']})"


def _row(name: str, fam: dict[str, Any], now: datetime) -> list[str]:
    scan = fam["last_scan"]
    running = "-" if fam["budget"] is None else f"{_dash(fam['running'])}/{fam['budget']}"
    if fam.get("unconfirmed"):
        running += f" ({fam['unconfirmed']} unconfirmed)"
    retry = _dash(fam["retry_wait"])
    if fam["next_retry_at"]:
        retry += f" ({_until(_parse(fam['next_retry_at']), now)})"
    if scan is None:
        last = "-"
    else:
        last = f"{_ago(_parse(scan['checkpoint']), now)} #{scan['generation']}"
        if scan["in_progress"]:
            last += " scanning"
    return [
        name,
        _dash(fam["policy"]),
        _until(_parse(fam["due_at"]), now) if fam["due_at"] else "-",
        running,
        _dash(fam["ready"]),
        retry,
        _dash(fam["unacknowledged"]),
        _dash(fam["dirty"]),
        last,
        _leader_cell(fam["leader"]),
        _dash(fam["status"]),
    ]


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(col), *(len(r[i]) for r in rows)) for i, col in enumerate(COLUMNS)]
    lines = []
    for cells in [list(COLUMNS), *rows]:
        parts = [
            cell.rjust(w) if COLUMNS[i] in _RIGHT else cell.ljust(w)
            for i, (cell, w) in enumerate(zip(cells, widths, strict=True))
        ]
        lines.append("  ".join(parts).rstrip())
    return lines


def _failing_lines(families: dict[str, Any], now: datetime) -> list[str]:
    """Per family: paused, and its failing or parked Scopes, worst first, with why."""
    lines: list[str] = []
    for name, fam in families.items():
        scopes = fam.get("failing") or []
        if fam.get("paused"):
            lines.append(f"  {name}: paused by the operator (apsup families resume {name})")
        if not scopes:
            continue
        lines.append(f"  {name}: {fam.get('failing_count', 0)} failing Scope(s), worst first:")
        for s in scopes:
            nxt = _parse(s.get("next_attempt_at"))
            when = "parked" if s.get("parked") else (f"next {_until(nxt, now)}" if nxt else "")
            error = f"{s.get('error_type') or '-'}: {s.get('error') or ''}".strip()
            lines.append(
                f"    {str(s.get('scope'))[:40]:<40} {s.get('consecutive_failures', 0):>4}x  "
                f"{when:<14} {error[:100]}"
            )
    return lines


def render_text(view: dict[str, Any], error: str | None = None) -> str:
    now = _parse(view["database_time"]) or datetime.now(UTC).replace(tzinfo=None)
    lines = [f"apsup status  ·  {view['database']}  ·  database time {view['database_time']}"]
    host = view["host"]
    if host["available"]:
        age = host.get("heartbeat_age")
        lines.append(
            f"host {host['url']}  ·  mode {_dash(host.get('mode'))}  ·  "
            f"role {_dash(host.get('role'))}  ·  readiness {host.get('readiness')}"
            + (f" ({host['readiness_reason']})" if host.get("readiness_reason") else "")
            + ("" if age is None else f"  ·  heartbeat {age:.1f}s ago")
        )
    elif host["url"] is None:
        lines.append(
            f"{NO_HOST} (pass --url http://127.0.0.1:PORT of a running host): "
            "in-memory columns show -"
        )
    else:
        lines.append(
            f"{NO_HOST}: {host['url']} unavailable ({host['error']}): in-memory columns show -"
        )
    if view["leases"]:
        lines.append(
            "leases: "
            + "  ·  ".join(
                f"{lease['key']}#{lease['generation']} "
                + (
                    f"holder {_holder(lease['holder'])}"
                    + (
                        f" until {lease['expires_at']}"
                        if lease["expires_at"] and lease["state"] == "active"
                        else ""
                    )
                    if lease["state"] == "active"
                    else lease["state"]
                )
                for lease in view["leases"]
            )
        )
    else:
        lines.append("leases: none (no Supervisor has started on this database)")
    for r in view.get("replicas", []):
        leads = ", ".join(r["leads"]) or "standby"
        procs = r["processes"]
        where = procs[0]["http"] if len(procs) == 1 else f"{len(procs)} processes"
        gone = f" since {r['vanished_at']}" if r.get("vanished_at") else ""
        lines.append(
            f"replica {r['replica']} {r['state']}{gone}  {r['host']} {r['role']}/{r['mode']}  "
            f"{where or '-'}  leads: {leads}  ·  seen {_ago(_parse(r['last_seen']), now)}"
        )
    for e in view.get("events", [])[:5]:
        lines.append(
            f"leadership {e['at']}: {e['key']} {e['from'] or '-'} -> {e['to']} "
            f"(term {e['term']}, {e['why']})"
        )
    summary = view.get("summary")
    if summary is not None:
        items = summary["items"]
        lines.append(
            f"cluster: {summary['status']}"
            + (": " + "; ".join(i["text"] for i in items[:8]) if items else "")
            + (f" (+{len(items) - 8} more)" if len(items) > 8 else "")
        )
    if error:
        lines.append(f"refresh failed: {error}")
    lines.append("")
    families = view["families"]
    if not families:
        lines.append("no families yet: nothing was marked dirty, requested or scanned")
    else:
        lines.extend(_table([_row(name, fam, now) for name, fam in families.items()]))
        notes = [
            f"  {name}: {fam['status']}: {fam['reason']}"
            for name, fam in families.items()
            if fam["reason"] and fam["status"] not in (None, "ok", "disabled", "paused")
        ]
        if notes:
            lines.append("")
            lines.extend(notes)
        failing = _failing_lines(families, now)
        if failing:
            lines.append("")
            lines.extend(failing)
    if view["truncated"]:
        lines.append(f"(only the first {MAX_FAMILIES} families are shown)")
    return "\n".join(lines) + "\n"
