"""Which replica should lead each family in ``dedicated`` mode (several background replicas).

Every replica runs a Supervisor process per family and each family has one Lease; this module
only decides *which* candidate should hold it, so that the families spread over the replicas.
Nothing here grants a term: claims and releases still go through the Lease, fenced as always.

The rule (``assign``) is a function of the family names and the set of live replica ids alone,
so every replica that reads the same membership computes the same answer:

* **balanced**: with K families and R replicas, every replica gets floor(K/R) or ceil(K/R);
* **stable** (rendezvous hashing with bounded loads): every (family, replica) pair has a fixed
  hash score; pairs are served best score first, each family going to the first replica of its
  pairs that still has room. A join or a leave changes no other pair's score, so only about
  K/R families move (measured over random names: 1.1-1.4x the ideal on average), and a restart
  of the same set (same replica ids) moves none.

``Balancer`` keeps one host's view of the membership (``apsup.store.membership``) and answers
the host's two questions: should this replica claim a free Lease now, and should it hand over a
Lease it holds. It hands a family over at most once until the membership changes again, so a
successor that does not take its family cannot make it ping-pong.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime

from apsup.store.membership import Member


def _score(family: str, replica: str) -> int:
    digest = hashlib.blake2b(f"{family}\0{replica}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def assign(families: Iterable[str], replicas: Iterable[str]) -> dict[str, str]:
    """family -> replica id: balanced (floor/ceil by count) rendezvous placement; {} if no
    replica. Deterministic in the *sets* given (their order does not matter)."""
    names = sorted(set(families))
    reps = sorted(set(replicas))
    if not reps:
        return {}
    base, extra = divmod(len(names), len(reps))
    load = dict.fromkeys(reps, 0)
    full = 0  # replicas that reached base + 1 (at most ``extra`` may)
    out: dict[str, str] = {}
    # Strongest (family, replica) affinities are served first: a pair's score never depends on
    # the other members, so a join or a leave disturbs only the pairs it outranks or frees.
    pairs = sorted(((_score(n, r), n, r) for n in names for r in reps), reverse=True)
    for _, name, rep in pairs:
        if name in out:
            continue
        if load[rep] < base or (load[rep] == base and full < extra):
            if load[rep] == base:
                full += 1
            load[rep] += 1
            out[name] = rep
    return out


@dataclass(frozen=True)
class View:
    """Live dedicated replicas as read at one instant (database time)."""

    replicas: frozenset[str]
    #: holder id -> replica id, for every row read (live or not): who holds a Lease.
    holders: Mapping[str, str]
    read_at: float  # monotonic


@dataclass
class Balancer:
    """One host's placement state (dedicated mode, elected backends)."""

    replica_id: str
    families: Sequence[str]
    lease_seconds: float
    #: How long the view is trusted before the host reads membership again.
    refresh_seconds: float
    view: View | None = None
    #: key -> the replica set under which this host handed that key over: not again until the
    #: set changes (a successor that does not take the key cannot make it ping-pong).
    handed_over: dict[str, frozenset[str]] = field(default_factory=dict)
    #: replica id -> the newest ``last_seen`` of its rows when a Lease of it was found run out
    #: unrenewed (it was killed or cut off): no candidate until a row of it is seen newer. Its
    #: rows stay live for ``membership.gone_after`` (two Leases); counting it that long would
    #: make the survivor that took its family hand the family back to it.
    lapsed: dict[str, datetime] = field(default_factory=dict)
    #: replica id -> the newest ``last_seen`` of its rows in the last view read.
    last_seen: dict[str, datetime] = field(default_factory=dict)

    def due(self, now: float) -> bool:
        return self.view is None or now - self.view.read_at >= self.refresh_seconds

    def update(self, rows: Collection[Member], db_now: datetime, now: float) -> View:
        """Build the view from membership rows: a replica is a candidate once every one of its
        per-family processes keeps a live row (all its Supervisors run), so a family is never
        handed to a replica whose process for it is not up yet."""
        live: dict[str, int] = {}
        seen: dict[str, datetime] = {}
        for m in rows:
            if m.mode == "dedicated" and m.role != "api" and m.alive(db_now, self.lease_seconds):
                live[m.replica_id] = live.get(m.replica_id, 0) + 1
            seen[m.replica_id] = max(m.last_seen, seen.get(m.replica_id, m.last_seen))
        self.last_seen = seen
        for rep, at in list(self.lapsed.items()):
            if rep not in seen or seen[rep] > at:  # gone for good, or refreshing again: back
                del self.lapsed[rep]
        need = len(set(self.families))
        reps = frozenset(r for r, n in live.items() if n >= need and r not in self.lapsed)
        if self.view is not None and reps != self.view.replicas:
            self.handed_over.clear()  # a new membership: each key may move (once) again
        self.view = View(reps, {m.holder_id: m.replica_id for m in rows}, now)
        return self.view

    def preferred(self, key: str, *, without: Collection[str] = ()) -> str | None:
        """The replica that should lead ``key`` (``artifact:<family>``) in the current view,
        leaving out ``without`` (e.g. a replica whose Lease ran out unrenewed: it is gone)."""
        if self.view is None:
            return None
        reps = set(self.view.replicas) - set(without)
        if self.replica_id not in self.view.replicas and self.replica_id not in without:
            reps.add(self.replica_id)  # this host runs: it is a candidate whatever it read
        family = key.partition(":")[2] or key
        return assign(self.families, reps).get(family)

    def should_claim_now(self, key: str, last_holder: str | None = None) -> bool:
        """Whether this replica may take a free Lease of ``key`` at once (it is the preferred
        one); the others wait a grace period first. ``last_holder``: the holder id of a Lease
        that ran out without a release: its replica is no candidate for this decision."""
        without: set[str] = set()
        if last_holder and self.view is not None:
            gone = self.view.holders.get(last_holder)
            if gone is not None and gone != self.replica_id:
                without.add(gone)
        return self.preferred(key, without=without) in (None, self.replica_id)

    def hand_over_to(self, key: str, now: float) -> str | None:
        """The replica this host should hand ``key`` to, or None (keep it): the preferred one,
        if it is another live replica and this host did not hand ``key`` over already under
        the same membership. Only on a fresh view (``now``: monotonic): a host that cannot read
        the membership hands nothing over."""
        if self.view is None or now - self.view.read_at > 2 * self.refresh_seconds:
            return None
        target = self.preferred(key)
        if target is None or target == self.replica_id or target not in self.view.replicas:
            return None
        if self.handed_over.get(key) == self.view.replicas:
            return None
        return target

    def ran_out(self, holder_id: str) -> None:
        """A Lease of ``holder_id`` was found run out unrenewed (and this host took it): its
        replica is no candidate until one of its rows is refreshed after what this view saw."""
        view = self.view
        rep = None if view is None else view.holders.get(holder_id)
        if view is None or rep is None or rep == self.replica_id:
            return
        self.lapsed[rep] = self.last_seen.get(rep, datetime.min)
        if rep in view.replicas:
            self.handed_over.clear()  # a new membership, as ``update`` would see it
            self.view = View(view.replicas - {rep}, view.holders, view.read_at)

    def handed(self, key: str) -> None:
        if self.view is not None:
            self.handed_over[key] = self.view.replicas


__all__ = ["Balancer", "View", "assign"]
