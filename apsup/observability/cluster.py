"""The cluster view: what every replica's console, ``/cluster`` and ``apsup status`` show.

A replica's own ``/status`` knows only what its process leads. The cluster view is the same
document whoever builds it, because it is read from what every replica shares:

- **durable state**, one read transaction: per family its intents' counts, failure and operator
  state (failing and parked Scopes, paused), its scan state; the Leases; the membership rows;
- **each leader's live figures**: every live member that holds a Lease is asked for its
  ``/status`` through the address its membership row advertises (in parallel, each bounded by
  ``FETCH_TIMEOUT``); a leader that does not answer is named in ``sources`` and its families
  keep their durable columns.

On top of the merge (``status_view.build_view``): one row per replica (its processes inside,
state live / late / gone, what it leads), each family's leader by replica name, the leadership
changes seen by this process (``Events``), and a summary of what needs attention. Two replicas
building it within one refresh agree on everything but the live figures' age.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from typing import Any

from apsup.observability.status import StatusSnapshot
from apsup.observability.status_view import (
    DbView,
    build_view,
    fetch_host_status,
    host_families,
    read_database,
)
from apsup.registry import Family
from apsup.store import membership
from apsup.store.leases import INVALIDATED, LeaseRow

#: Seconds a leader's ``/status`` may take before the view goes on without its live figures.
FETCH_TIMEOUT = 1.5
#: Seconds a vanished replica stays listed (as gone, with when it vanished; then pruned).
GONE_KEPT_SECONDS = membership.GONE_KEPT_SECONDS
#: Leadership changes kept in memory (the newest first on the page).
EVENTS_KEPT = 50
#: A request unacknowledged this long (by its leader's clock) is listed as needing attention;
#: the shipped alert rule (ApsupRequestWaiting) uses the same bound.
OLD_REQUEST_SECONDS = 600.0

#: Which membership rows are the caller's own processes (their figures are in its snapshot).
Own = Callable[[membership.Member], bool] | None


def own_processes(*, holder: str | None = None, replica: str | None = None) -> Own:
    """``Own`` for a host (its holder id) or a dedicated launcher (its replica id)."""
    if holder is None and replica is None:
        return None
    return lambda m: m.holder_id == holder or (replica is not None and m.replica_id == replica)


def _iso(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat() + "Z"


def _live_holders(leases: Iterable[LeaseRow], now: datetime) -> dict[str, list[str]]:
    held: dict[str, list[str]] = {}
    for r in leases:
        if r.holder_id and r.holder_id != INVALIDATED and r.expires_at and r.expires_at > now:
            held.setdefault(r.holder_id, []).append(r.supervisor_key)
    return held


def replica_state(age: float, lease_seconds: float) -> str:
    """live: refreshed within two refresh intervals; late: not since, but within the
    membership margin (others still count on it); gone: past the margin."""
    if age <= 2 * membership.refresh_interval(lease_seconds):
        return "live"
    if age <= membership.gone_after(lease_seconds):
        return "late"
    return "gone"


def replicas(db: DbView, lease_seconds: float) -> list[dict[str, Any]]:
    """One row per replica id: its processes (each a membership row), its state (its freshest
    process's), and the Lease keys its processes hold."""
    held = _live_holders(db.leases, db.now)
    groups: dict[str, list[membership.Member]] = {}
    for m in db.members:
        groups.setdefault(m.replica_id, []).append(m)
    rows = []
    for replica_id, members in sorted(groups.items()):
        last = max(m.last_seen for m in members)
        age = max(0.0, (db.now - last).total_seconds())
        if age > GONE_KEPT_SECONDS:
            continue
        state = replica_state(age, lease_seconds)
        leads = sorted(k for m in members for k in held.get(m.holder_id, []))
        rows.append(
            {
                "replica": replica_id,
                "state": state,
                "host": members[0].host_name,
                "role": members[0].role,
                "mode": members[0].mode,
                "leads": leads,
                "last_seen": _iso(last),
                "age": round(age, 1),
                "vanished_at": _iso(last) if state == "gone" else None,
                "processes": [
                    {
                        "holder": m.holder_id,
                        "pid": m.pid,
                        "http": m.http_address,
                        "version": m.version,
                        "last_seen": _iso(m.last_seen),
                        "leads": sorted(held.get(m.holder_id, [])),
                    }
                    for m in members
                ],
            }
        )
    return rows


def leader_addresses(db: DbView, lease_seconds: float, own: Own = None) -> list[str]:
    """The listeners of the live members holding a Lease now (whose live figures count),
    but for ``own``'s processes: the caller has their figures already."""
    held = _live_holders(db.leases, db.now)
    found = {
        m.http_address
        for m in db.members
        if m.holder_id in held
        and m.http_address
        and not (own is not None and own(m))
        and m.alive(db.now, lease_seconds)
    }
    return sorted(found)


def fetch_all(
    urls: Sequence[str], timeout: float = FETCH_TIMEOUT
) -> list[tuple[str, StatusSnapshot | None, str]]:
    """(url, snapshot or None, why not) per url, fetched in parallel."""
    if not urls:
        return []
    with ThreadPoolExecutor(max_workers=min(8, len(urls))) as pool:
        answers = list(pool.map(lambda u: fetch_host_status(u, timeout), urls))
    return [(u, snap, err) for u, (snap, err) in zip(urls, answers, strict=True)]


class Events:
    """Leadership changes seen between two reads of the Lease table, newest first, bounded.

    Why: a **handoff** (the holder released the Lease: placement moved the family, or a clean
    shutdown), a **takeover** (it ran out and its holder's membership row had gone stale: the
    process was killed, frozen or cut off), a **step-down** (it ran out while its holder was
    still refreshing its row: the holder gave its term up on its renew deadline). Holders are
    named by replica, remembered here, so a replica gone since keeps its name in the events."""

    def __init__(self, kept: int = EVENTS_KEPT) -> None:
        self._gen: dict[str, int] = {}  # Lease key -> generation last seen
        self._holder: dict[str, str] = {}  # Lease key -> the last real holder seen
        self._released: dict[str, bool] = {}  # ... and whether it released the Lease since
        self._names: dict[str, str] = {}  # holder id -> replica name, as last seen
        self._events: deque[dict[str, Any]] = deque(maxlen=kept)
        self._lock = threading.Lock()

    def observe(
        self, db: DbView, names: dict[str, str], lease_seconds: float
    ) -> list[dict[str, Any]]:
        """Record the changes since the last call; ``names``: holder id -> replica name."""
        fresh = {
            m.holder_id
            for m in db.members
            if replica_state((db.now - m.last_seen).total_seconds(), lease_seconds) == "live"
        }
        with self._lock:
            self._names.update(names)
            for row in db.leases:
                key, holder = row.supervisor_key, row.holder_id
                if not holder or holder == INVALIDATED:
                    if key in self._holder:
                        self._released[key] = True
                    continue
                known, before = self._gen.get(key), self._holder.get(key)
                self._gen[key] = row.generation
                self._holder[key] = holder
                released = self._released.pop(key, False)
                if known is None or known == row.generation:
                    continue
                if released:
                    why = "handoff"
                elif before == holder:
                    why = "re-elected"
                elif before in fresh:
                    why = "step-down"
                else:
                    why = "takeover"
                self._events.appendleft(
                    {
                        "key": key,
                        "from": self._names.get(before, before[:8]) if before else None,
                        "to": self._names.get(holder, holder[:8]),
                        "term": row.generation,
                        "at": _iso(db.now),
                        "why": why,
                    }
                )
            return list(self._events)


def _holder_names(db: DbView) -> dict[str, str]:
    """Holder id -> the replica's name (a process of replica r in dedicated mode is r too)."""
    return {m.holder_id: m.replica_id for m in db.members}


def summary(view: dict[str, Any]) -> dict[str, Any]:
    """What needs attention, most urgent first; ``status`` ok / attention / degraded."""
    items: list[dict[str, Any]] = []
    fams = view["families"]
    for name, fam in fams.items():
        leader = fam.get("leader")
        # A family nobody runs any more (rows left behind, nothing pending) needs nobody.
        wanted = fam.get("unacknowledged") or fam.get("dirty") or fam.get("budget") is not None
        if (leader is None or leader.get("state") != "active") and wanted:
            items.append({"family": name, "kind": "no-leader", "text": f"{name}: no leader"})
    for r in view.get("replicas", []):
        if r["state"] in ("gone", "late") and r["role"] == "background":
            items.append(
                {
                    "family": None,
                    "kind": f"replica-{r['state']}",
                    "text": f"replica {r['replica']} is {r['state']} (last seen {r['last_seen']})",
                }
            )
    for name, fam in fams.items():
        failing = int(fam.get("failing_count") or 0)
        parked = int(fam.get("parked_count") or 0)
        if failing:
            items.append(
                {"family": name, "kind": "failing", "text": f"{name}: {failing} failing Scope(s)"}
            )
        if parked:
            items.append(
                {"family": name, "kind": "parked", "text": f"{name}: {parked} parked Scope(s)"}
            )
        if fam.get("paused"):
            items.append(
                {"family": name, "kind": "paused", "text": f"{name}: paused by the operator"}
            )
        age = fam.get("oldest_request_age")
        if (
            isinstance(age, int | float)
            and age >= OLD_REQUEST_SECONDS
            and fam.get("unacknowledged")
        ):
            items.append(
                {
                    "family": name,
                    "kind": "old-request",
                    "text": f"{name}: a request has waited {age / 60:.0f} min",
                }
            )
    for src in view.get("sources", []):
        if not src["available"]:
            items.append(
                {
                    "family": None,
                    "kind": "unreachable",
                    "text": f"leader at {src['url']} did not answer: {src['error']}",
                }
            )
    degraded = any(i["kind"] in ("no-leader", "replica-gone") for i in items)
    status = "degraded" if degraded else ("attention" if items else "ok")
    return {"status": status, "items": items}


def collect(
    backend: Any,
    db_url: str,
    *,
    lease_seconds: float,
    local: StatusSnapshot | None = None,
    local_url: str | None = None,
    local_error: str = "",
    own: Own = None,
    events: Events | None = None,
    timeout: float = FETCH_TIMEOUT,
) -> dict[str, Any]:
    """The cluster view document. ``local``: this process's own snapshot (its processes,
    ``own``, are not asked again)."""
    db = read_database(backend)
    fetched = fetch_all(leader_addresses(db, lease_seconds, own), timeout)
    snaps = ([local] if local is not None else []) + [s for _, s, _ in fetched if s is not None]
    extra = sorted({name for s in snaps for name in host_families(s)} - set(db.families))
    if extra:
        db = read_database(backend, extra)
    others = snaps[1:] if local is not None else snaps
    view = build_view(db_url, db, local_url, local, local_error, others=others)
    names = _holder_names(db)
    for fam in view["families"].values():
        lease = fam.get("leader")
        if lease is not None:
            holder = lease.get("holder")
            lease["replica"] = names.get(holder) if holder else None
    view["replicas"] = replicas(db, lease_seconds)
    view["sources"] = [
        {"url": u, "available": s is not None, "error": err or None} for u, s, err in fetched
    ]
    view["events"] = events.observe(db, names, lease_seconds) if events is not None else []
    view["summary"] = summary(view)
    return view


class ClusterProvider:
    """The cluster view for a listener, built at most once per ``ttl`` seconds (a console open
    in several tabs, and ``apsup status`` of every operator, cost one build)."""

    def __init__(
        self,
        backend: Any,
        db_url: str,
        *,
        lease_seconds: float,
        local: Callable[[], StatusSnapshot] | None = None,
        own: Own = None,
        ttl: float = 1.0,
        families: Mapping[str, Family] | None = None,
    ) -> None:
        self.backend, self.db_url, self.lease_seconds = backend, db_url, lease_seconds
        self.local, self.own, self.ttl = local, own, ttl
        self.families = dict(families or {})  # the ones this process can act on
        self.events = Events()
        self._cached: tuple[float, dict[str, Any]] | None = None
        self._lock = threading.Lock()

    def __call__(self) -> dict[str, Any]:
        with self._lock:
            now = time.monotonic()
            if self._cached is not None and now - self._cached[0] < self.ttl:
                return self._cached[1]
            view = collect(
                self.backend,
                self.db_url,
                lease_seconds=self.lease_seconds,
                local=self.local() if self.local is not None else None,
                own=self.own,
                events=self.events,
            )
            self._cached = (time.monotonic(), view)
            return view

    def act(self, action: str, family: str, scope: str) -> str:
        """An operator action from the console (``console_actions.perform``); the next view
        is built afresh, so the page shows its effect."""
        from apsup.observability.console_actions import perform

        message = perform(self.backend, self.db_url, self.families, action, family, scope)
        with self._lock:
            self._cached = None
        return message

    def recent(self, within: float = 30.0) -> dict[str, Any] | None:
        """The last view if built within ``within`` seconds (never builds one: for probes)."""
        cached = self._cached
        return cached[1] if cached is not None and time.monotonic() - cached[0] < within else None

    def search(self, family: str, text: str) -> tuple[dict[str, Any], list[str] | None]:
        """(the view, the Scope ids of ``family`` matching ``text``; None: no such family)."""
        from apsup.observability import scope_view

        view = self()
        binding = scope_view.binding_of(view, family)
        found = None if binding is None else scope_view.search(self.backend, binding, text)
        return view, found

    def scope(self, family: str, scope_id: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
        from apsup.observability import scope_view

        view = self()
        return view, scope_view.scope_detail(self.backend, view, family, scope_id)
