"""Property: cron admission across daylight-saving transitions matches an independent reference.

The scheduling core is driven the way the IO shell drives it (StartScan, EndScan, request pages),
in zones with DST (New York, London, Lord Howe with its 30-minute shift, Santiago whose clock
changes at midnight), with generated crons, polls at random instants and at every fire, and
restarts with downtime at any point around a transition.

The reference does not use croniter nor ``fold``: it walks every UTC minute of the window, reads
its local wall time with zoneinfo and tests the cron fields as sets, then applies the documented
rules (docs/scheduling-time.md): a cron whose hour field covers all 24 hours fires at every
matching instant; any other cron fires at the first occurrence of a repeated wall time and, for
wall times a spring-forward skips, once at the instant the gap ends.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import cache
from zoneinfo import ZoneInfo

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from apsup.policy import Cron
from apsup.scheduling import (
    BindingState,
    EndScan,
    FamilySpec,
    FetchRequests,
    Scheduler,
    StartScan,
)

pytestmark = pytest.mark.timeout(900)  # a few hundred examples; slow only on a loaded machine

ZONES = ("America/New_York", "Europe/London", "Australia/Lord_Howe", "America/Santiago")
MINUTE = timedelta(minutes=1)


@cache
def transitions(zone: str) -> tuple[datetime, ...]:
    """Every UTC offset change in 2026 (aware UTC), found by scanning hours then minutes."""
    tz = ZoneInfo(zone)
    found = []
    t = datetime(2026, 1, 1, tzinfo=UTC)
    while t.year == 2026:
        nxt = t + timedelta(hours=1)
        if t.astimezone(tz).utcoffset() != nxt.astimezone(tz).utcoffset():
            m = t
            while m.astimezone(tz).utcoffset() == t.astimezone(tz).utcoffset():
                m += MINUTE
            found.append(m)
        t = nxt
    assert len(found) == 2, (zone, found)
    return tuple(found)


@dataclass(frozen=True)
class CronCase:
    text: str
    minutes: frozenset[int]
    hours: frozenset[int]
    weekdays: frozenset[int]  # cron numbering: 0 = Sunday

    def matches(self, wall: datetime) -> bool:
        return (
            wall.minute in self.minutes
            and wall.hour in self.hours
            and (wall.isoweekday() % 7) in self.weekdays
        )


@st.composite
def field(draw: st.DrawFn, low: int, high: int) -> tuple[str, frozenset[int]]:
    kind = draw(st.sampled_from(["star", "step", "list", "range", "rangestep"]))
    if kind == "star":
        return "*", frozenset(range(low, high + 1))
    if kind == "step":
        k = draw(st.integers(1, high))
        return f"*/{k}", frozenset(range(low, high + 1, k))
    if kind == "list":
        values = sorted(draw(st.sets(st.integers(low, high), min_size=1, max_size=4)))
        return ",".join(map(str, values)), frozenset(values)
    a = draw(st.integers(low, high))
    b = draw(st.integers(a, high))
    if kind == "range":
        return f"{a}-{b}", frozenset(range(a, b + 1))
    k = draw(st.integers(1, max(1, b - a)))
    return f"{a}-{b}/{k}", frozenset(range(a, b + 1, k))


@st.composite
def crons(draw: st.DrawFn) -> CronCase:
    minute, minutes = draw(field(0, 59))
    hour, hours = draw(field(0, 23))
    if draw(st.integers(0, 3)):
        dow, weekdays = "*", frozenset(range(7))
    else:
        values = sorted(draw(st.sets(st.integers(0, 6), min_size=1, max_size=6)))
        dow, weekdays = ",".join(map(str, values)), frozenset(values)
    return CronCase(f"{minute} {hour} * * {dow}", minutes, hours, weekdays)


def reference_fires(case: CronCase, zone: str, start: datetime, end: datetime) -> list[datetime]:
    """Fire instants (aware UTC) in [start - margin, end + margin], by walking every minute.

    The margin (two days, or nine when weekdays are restricted) holds a fire on each side.
    """
    margin = timedelta(days=2 if case.weekdays == frozenset(range(7)) else 9)
    start, end = start - margin, end + margin
    tz = ZoneInfo(zone)
    every_hour = case.hours == frozenset(range(24))
    fires: set[datetime] = set()
    seen_walls: set[datetime] = set()
    m = start.replace(second=0, microsecond=0)
    prev_wall = (m - MINUTE).astimezone(tz).replace(tzinfo=None)
    while m <= end:
        wall = m.astimezone(tz).replace(tzinfo=None)
        if wall - prev_wall > MINUTE and not every_hour:
            # Spring-forward at m: the wall times strictly between were skipped.
            skipped = prev_wall + MINUTE
            while skipped < wall:
                if case.matches(skipped):
                    fires.add(m)
                skipped += MINUTE
        if case.matches(wall) and (every_hour or wall not in seen_walls):
            fires.add(m)
        seen_walls.add(wall)
        prev_wall = wall
        m += MINUTE
    return sorted(fires)


class Shell:
    """The part of the IO shell that schedules checks, for one family with no pending work."""

    def __init__(self, policy: Cron) -> None:
        self.spec = FamilySpec("f", policy, max_workers=1)
        self.generation = 0
        self.core: Scheduler | None = None

    def restart(self, checkpoint: datetime | None) -> None:
        self.core = Scheduler([self.spec], rng=random.Random(0))
        self.core.restore("f", BindingState(checkpoint, self.generation, False, None))

    def poll(self, now: datetime) -> list[datetime]:
        """Run every step due at ``now``; returns the checkpoints of the scans started."""
        core = self.core
        assert core is not None
        started: list[datetime] = []
        for _ in range(20):
            d = core.decide(now)
            if d is None:
                return started
            if isinstance(d, StartScan):
                self.generation += 1
                core.on_scan_started("f", self.generation, None, d.checkpoint)
                core.on_notify("f")
                started.append(d.checkpoint)
            elif isinstance(d, EndScan):
                core.on_scan_ended("f", d.scan_generation)
            elif isinstance(d, FetchRequests):
                core.on_request_page("f", [], True)
            else:  # pragma: no cover - nothing else without work
                raise AssertionError(f"unexpected decision {d}")
        raise AssertionError(f"hot loop at {now}: still deciding after 20 steps, {started}")


def naive(t: datetime) -> datetime:
    return t.astimezone(UTC).replace(tzinfo=None)


@settings(
    max_examples=80,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    zone=st.sampled_from(ZONES),
    which=st.integers(0, 1),
    case=crons(),
    offset=st.integers(-5 * 3600, 5 * 3600),
    first_checkpoint=st.sampled_from(["none", "latest", "older"]),
    steps=st.lists(
        st.tuples(
            st.integers(1, 1800),  # seconds to the next poll
            st.booleans(),  # restart before that poll
            st.integers(0, 2 * 3600),  # downtime of that restart
        ),
        min_size=1,
        max_size=8,
    ),
    at_every_fire=st.booleans(),
)
def test_admitted_checkpoints_match_the_reference(
    zone: str,
    which: int,
    case: CronCase,
    offset: int,
    first_checkpoint: str,
    steps: list[tuple[int, bool, int]],
    at_every_fire: bool,
) -> None:
    start = transitions(zone)[which] + timedelta(seconds=offset, microseconds=250_000)
    end = start + sum((timedelta(seconds=g + (d if r else 0)) for g, r, d in steps), MINUTE)
    fires = reference_fires(case, zone, start, end)
    assert fires, "every generated cron fires at least weekly"

    def latest(t: datetime) -> datetime:
        return max(f for f in fires if f <= t)

    def following(t: datetime) -> datetime:
        return min(f for f in fires if f > t)

    checkpoint: datetime | None = None
    if first_checkpoint != "none":
        checkpoint = latest(start)
        if first_checkpoint == "older":
            checkpoint = max([f for f in fires if f < checkpoint] or [checkpoint])

    # Poll instants: the steps, plus every fire while the host is up (when asked).
    polls: list[tuple[datetime, bool]] = []
    t = start
    for gap, restart, downtime in steps:
        nxt = t + timedelta(seconds=gap)
        if at_every_fire:
            polls.extend((f, False) for f in fires if t < f < nxt)
        if restart:
            nxt += timedelta(seconds=downtime)
        polls.append((nxt, restart))
        t = nxt

    shell = Shell(Cron(case.text, zone))
    shell.restart(None if checkpoint is None else naive(checkpoint))
    expected: list[datetime] = []
    admitted: list[datetime] = []
    stored = checkpoint
    for now, restart in [(start, False), *polls]:
        if restart:
            shell.restart(None if stored is None else naive(stored))
        got = [c.replace(tzinfo=UTC) for c in shell.poll(naive(now))]
        want = latest(now)
        if stored is None or want > stored:
            expected.append(want)  # missed fires coalesce into the latest one
            stored = want
        admitted.extend(got)
        assert got == expected[len(admitted) - len(got) :], (case.text, zone, now, got)
        # Never due again before the next fire: the core wakes exactly at it.
        assert shell.core is not None
        wake = shell.core.next_wakeup(naive(now))
        assert wake == naive(following(stored)), (case.text, zone, now, stored, wake)

    assert admitted == expected
    assert all(a < b for a, b in itertools.pairwise(admitted)), admitted
    assert set(admitted) <= set(fires)


@settings(max_examples=80, deadline=None)
@given(
    zone=st.sampled_from(ZONES),
    which=st.integers(0, 1),
    case=crons(),
    offset=st.integers(-6 * 3600, 6 * 3600),
)
def test_fire_enumeration_matches_the_reference_both_ways(
    zone: str, which: int, case: CronCase, offset: int
) -> None:
    """next_fire_after and latest_fire_at_or_before walk the reference set, from any instant."""
    t = transitions(zone)[which] + timedelta(seconds=offset, microseconds=1)
    fires = reference_fires(case, zone, t, t)
    cron = Cron(case.text, zone)
    aware_t = t.astimezone(UTC)
    assert cron.next_fire_after(aware_t) == min(f for f in fires if f > aware_t)
    assert cron.latest_fire_at_or_before(aware_t) == max(f for f in fires if f <= aware_t)
    near = [f for f in fires if abs(f - aware_t) < timedelta(hours=4)]
    for f in random.Random(offset).sample(near, min(len(near), 12)):
        assert cron.latest_fire_at_or_before(f) == f
        assert cron.next_fire_after(f - timedelta(microseconds=1)) == f
        assert cron.next_fire_after(f) == min(g for g in fires if g > f)
