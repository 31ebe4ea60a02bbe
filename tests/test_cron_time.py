"""Cron across daylight-saving changes and clock jumps (docs/scheduling-time.md).

The scheduling core is driven by hand the way the IO shell drives it, with the issue's repros:
a sub-hourly cron started or restarted inside the repeated fall-back hour must neither hot-loop
nor move its checkpoint backwards nor go silent for that hour; time-of-day crons fire once per
day across both transitions; a backward clock jump is clamped instead of stalling the family.
The store half runs on both backends.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from datetime import datetime, timedelta
from typing import Any

import pytest

from apsup.errors import ConfigError
from apsup.policy import CLOCK_JUMP_TOLERANCE, Cron, Interval, Policy
from apsup.registry import Registry, family
from apsup.scheduling import (
    BindingState,
    EndScan,
    FamilySpec,
    FetchRequests,
    Scheduler,
    StartScan,
)
from apsup.store import scans

NY, LONDON, LORD_HOWE, SANTIAGO = (
    "America/New_York",
    "Europe/London",
    "Australia/Lord_Howe",
    "America/Santiago",
)
PREFIX = "POWERCONTEXT_SERVER_RUNTIME_"


def utc(*args: int) -> datetime:
    """Naive UTC, as database time is."""
    return datetime(*args)


def fires(cron: Cron, start: datetime, end: datetime) -> list[datetime]:
    out, t = [], start
    while (t := cron.next_fire_after(t)) <= end:
        out.append(t)
    return out


class Driver:
    """One family with no pending work, polled at given instants; records every scan start."""

    def __init__(self, policy: Policy, checkpoint: datetime | None = None) -> None:
        self.spec = FamilySpec("f", policy, max_workers=1)
        self.generation = 0
        self.decisions = 0
        self.started: list[StartScan] = []
        self.stored = checkpoint
        self.restart()

    def restart(self) -> None:
        self.core = Scheduler([self.spec], rng=random.Random(0))
        self.core.restore("f", BindingState(self.stored, self.generation, False, None))

    def poll(self, now: datetime) -> None:
        for _ in range(50):
            d = self.core.decide(now)
            if d is None:
                return
            self.decisions += 1
            if isinstance(d, StartScan):
                self.generation += 1
                self.started.append(d)
                self.stored = d.checkpoint
                self.core.on_scan_started("f", self.generation, None, d.checkpoint)
                self.core.on_notify("f")
            elif isinstance(d, EndScan):
                self.core.on_scan_ended("f", d.scan_generation)
            elif isinstance(d, FetchRequests):
                self.core.on_request_page("f", [], True)
            else:  # pragma: no cover
                raise AssertionError(d)
        raise AssertionError(f"hot loop at {now}: {self.started[-5:]}")

    def run(self, start: datetime, end: datetime, step: timedelta) -> None:
        now = start
        while now <= end:
            self.poll(now)
            wake = self.core.next_wakeup(now)
            assert wake is None or wake > now, f"due again at once at {now}: wake {wake}"
            now += step

    @property
    def checkpoints(self) -> list[datetime]:
        return [d.checkpoint for d in self.started]


# -- fall-back: the repeated hour --------------------------------------------------------------


@pytest.mark.parametrize(
    ("zone", "start", "expr"),
    [
        (NY, utc(2026, 11, 1, 6, 5, 30), "*/15 * * * *"),  # 01:05:30 EST, the second 01:05
        (NY, utc(2026, 11, 1, 6, 5, 30), "*/1 * * * *"),
        (LONDON, utc(2026, 10, 25, 1, 10, 30), "*/15 * * * *"),  # 01:10:30 GMT, second pass
    ],
)
def test_fresh_start_inside_the_repeated_hour_runs_once_per_fire(
    zone: str, start: datetime, expr: str
) -> None:
    cron = Cron(expr, zone)
    d = Driver(cron)
    end = start + timedelta(hours=2)
    d.run(start, end, timedelta(seconds=5))
    # One immediate catch-up (the latest fire), then every fire exactly once, in order.
    assert d.checkpoints[0] == cron.latest_fire_at_or_before(start)
    assert d.checkpoints[1:] == fires(cron, d.checkpoints[0], end)
    assert d.decisions < 4 * len(d.checkpoints) + 4  # no scan storm


def test_restart_inside_the_repeated_hour_never_moves_the_checkpoint_back() -> None:
    cron = Cron("*/15 * * * *", NY)
    d = Driver(cron)
    d.run(utc(2026, 11, 1, 5, 20), utc(2026, 11, 1, 5, 31), timedelta(seconds=30))  # first 01:xx
    assert d.stored == utc(2026, 11, 1, 5, 30)
    d.restart()  # the host comes back 50 minutes later, at 01:20 EST (the second 01:20)
    d.run(utc(2026, 11, 1, 6, 20), utc(2026, 11, 1, 7, 40), timedelta(seconds=30))
    assert d.checkpoints == sorted(set(d.checkpoints))
    assert d.checkpoints[:3] == [
        utc(2026, 11, 1, 5, 15),
        utc(2026, 11, 1, 5, 30),
        utc(2026, 11, 1, 6, 15),
    ]
    assert d.checkpoints[3:] == fires(cron, utc(2026, 11, 1, 6, 15), utc(2026, 11, 1, 7, 40))


def test_sub_hourly_cron_fires_through_the_repeated_hour() -> None:
    cron = Cron("* * * * *", NY)
    d = Driver(cron, checkpoint=utc(2026, 11, 1, 4, 50))
    d.run(utc(2026, 11, 1, 4, 50, 30), utc(2026, 11, 1, 7, 10), timedelta(seconds=20))
    expected = [utc(2026, 11, 1, 4, 51) + timedelta(minutes=i) for i in range(139)]
    assert d.checkpoints == expected  # 05:57, 05:58, 05:59, 06:00 ... no hour missing


@pytest.mark.parametrize(
    ("zone", "expr", "day", "once"),
    [
        (NY, "30 1 * * *", utc(2026, 11, 1), utc(2026, 11, 1, 5, 30)),  # 01:30 EDT
        (LONDON, "30 1 * * *", utc(2026, 10, 25), utc(2026, 10, 25, 0, 30)),  # 01:30 BST
        (LORD_HOWE, "45 1 * * *", utc(2026, 4, 4, 12), utc(2026, 4, 4, 14, 45)),  # 01:45 +11:00
        (SANTIAGO, "30 23 * * *", utc(2026, 4, 4, 12), utc(2026, 4, 5, 2, 30)),  # 23:30 -03
    ],
)
def test_time_of_day_cron_fires_once_on_the_fall_back_day(
    zone: str, expr: str, day: datetime, once: datetime
) -> None:
    cron = Cron(expr, zone)
    got = fires(cron, day, day + timedelta(hours=24))
    assert got == [once]


def test_hourly_cron_fires_at_both_occurrences_of_the_repeated_hour() -> None:
    got = fires(Cron("0 * * * *", NY), utc(2026, 11, 1, 3), utc(2026, 11, 1, 8))
    assert got == [utc(2026, 11, 1, h) for h in (4, 5, 6, 7, 8)]  # 00, 01 EDT, 01, 02, 03 EST


# -- spring-forward: the skipped hour ----------------------------------------------------------


@pytest.mark.parametrize(
    ("zone", "expr", "day", "fire"),
    [
        (NY, "30 2 * * *", utc(2026, 3, 8), utc(2026, 3, 8, 7, 0)),  # 03:00 EDT, gap end
        (LONDON, "30 1 * * *", utc(2026, 3, 29), utc(2026, 3, 29, 1, 0)),  # 02:00 BST
        (LORD_HOWE, "15 2 * * *", utc(2026, 10, 3, 12), utc(2026, 10, 3, 15, 30)),  # 02:30 +11
        (SANTIAGO, "30 0 * * *", utc(2026, 9, 6), utc(2026, 9, 6, 4, 0)),  # 01:00 -03
    ],
)
def test_a_skipped_wall_time_fires_when_the_gap_ends(
    zone: str, expr: str, day: datetime, fire: datetime
) -> None:
    got = fires(Cron(expr, zone), day, day + timedelta(hours=24))
    assert got == [fire]


def test_sub_hourly_cron_skips_the_missing_hour_without_a_late_fire() -> None:
    got = fires(Cron("*/15 * * * *", NY), utc(2026, 3, 8, 6, 30), utc(2026, 3, 8, 7, 30))
    minutes = [0, 15, 30]
    assert got == [utc(2026, 3, 8, 6, m) for m in (45,)] + [utc(2026, 3, 8, 7, m) for m in minutes]


def test_downtime_across_a_transition_coalesces_into_one_catch_up() -> None:
    cron = Cron("*/15 * * * *", NY)
    d = Driver(cron, checkpoint=utc(2026, 11, 1, 4, 0))
    d.poll(utc(2026, 11, 1, 7, 7))  # down from 00:00 EDT to 02:07 EST
    assert d.checkpoints == [utc(2026, 11, 1, 7, 0)]
    assert d.core.next_wakeup(utc(2026, 11, 1, 7, 7)) == utc(2026, 11, 1, 7, 15)


# -- clock jumps -------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", [Interval(300), Cron("*/5 * * * *", "UTC")])
def test_backward_clock_jump_is_clamped_counted_and_scheduled_from_now(policy: Policy) -> None:
    t = utc(2026, 6, 1, 10, 0)
    d = Driver(policy, checkpoint=t)
    jumped = t - timedelta(hours=1)  # database time went back an hour
    d.poll(jumped)
    assert d.started == []
    snap = d.core.snapshot(jumped)["f"]
    assert snap.clock_rewinds == 1 and snap.checkpoint == jumped
    assert d.core.next_wakeup(jumped) == jumped + timedelta(minutes=5)  # not 10:05
    d.poll(jumped + timedelta(minutes=5))
    assert d.checkpoints == [jumped + timedelta(minutes=5)]
    assert d.started[0].rewound_from == t  # the store may replace the future checkpoint
    assert d.core.snapshot()["f"].checkpoint == jumped + timedelta(minutes=5)


def test_small_backward_step_within_tolerance_is_not_clamped() -> None:
    t = utc(2026, 6, 1, 10, 0)
    d = Driver(Interval(300), checkpoint=t)
    d.poll(t - CLOCK_JUMP_TOLERANCE)
    assert d.core.snapshot()["f"].clock_rewinds == 0
    assert d.core.next_wakeup(t) == t + timedelta(minutes=5)


def test_forward_clock_jump_coalesces_like_downtime() -> None:
    cron = Cron("*/5 * * * *", "UTC")
    d = Driver(cron, checkpoint=utc(2026, 6, 1, 10, 0))
    d.poll(utc(2026, 6, 1, 13, 2))
    assert d.checkpoints == [utc(2026, 6, 1, 13, 0)]


def test_store_checkpoint_only_moves_forward_except_over_a_clamp(backend: Any) -> None:
    term = backend.claim_term("global", "cron-test", 600)
    assert term is not None
    t = utc(2026, 6, 1, 10, 0)

    def start(checkpoint: datetime, rewound_from: datetime | None = None) -> datetime | None:
        state = backend.run_fenced(
            term, lambda c: scans.start_scan(c, "b", checkpoint, rewound_from)
        )
        return state.checkpoint

    assert start(t) == t
    assert start(t - timedelta(minutes=5)) == t  # an earlier one keeps the stored value
    assert start(t + timedelta(minutes=5)) == t + timedelta(minutes=5)
    later = t + timedelta(minutes=5)
    assert start(t - timedelta(hours=1), rewound_from=later) == t - timedelta(hours=1)
    assert start(t - timedelta(hours=2), rewound_from=t - timedelta(hours=3)) == t - timedelta(
        hours=1
    )  # a stale clamp does not rewind a checkpoint it did not see


# -- refused at registration and check-config --------------------------------------------------


@pytest.mark.parametrize(
    ("expr", "says"),
    [
        ("0 */5 * * * *", "6 field(s); use exactly five"),
        ("0 2 * *", "4 field(s)"),
        ("0 0 31 2 *", "never fires, day-of-month 31 does not occur in month 2"),
        ("0 2 30 2 *", "never fires, day-of-month 30 does not occur in month 2"),
        ("0 0 31 4,6,9,11 *", "never fires"),
        ("0 0 L * *", "day-of-month field 'L' uses 'L'"),
        ("0 0 15W * *", "uses 'W'"),
        ("0 0 * * 1#2", "uses '#'"),
        ("H * * * *", "uses 'H'"),
        ("@reboot", "1 field(s)"),
    ],
)
def test_refused_crons_name_the_family_and_field(expr: str, says: str) -> None:
    reg = Registry()
    with pytest.raises(ConfigError, match="'alpha': invalid cron expression") as info:

        @family("alpha", cron=expr, timezone="UTC", registry=reg)
        def alpha(scope_id: str, ctx: object) -> None:
            """Test processor."""

    assert says in str(info.value)


@pytest.mark.parametrize("expr", ["0 2 29 2 *", "0 0 31 2 1", "@daily", "0 9 * jan-mar mon-fri"])
def test_accepted_crons(expr: str) -> None:
    Cron(expr, "Asia/Shanghai")


def test_interval_longer_than_a_year_is_refused() -> None:
    with pytest.raises(ConfigError, match="'alpha': field 'interval'"):

        @family("alpha", interval=1e12, registry=Registry())
        def alpha(scope_id: str, ctx: object) -> None:
            """Test processor."""


def check_config(**variables: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(PREFIX)}
    env.update({PREFIX + k: v for k, v in variables.items()})
    return subprocess.run(
        [sys.executable, "-m", "apsup.cli", "check-config", "--app", "apsup.families.profile"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


@pytest.mark.parametrize(
    ("variables", "variable", "says"),
    [
        ({"PROFILE_CRON": "0 */5 * * * *"}, "PROFILE_CRON", "use exactly five"),
        ({"PROFILE_CRON": "0 0 31 2 *"}, "PROFILE_CRON", "never fires"),
        ({"PROFILE_CRON": "0 2 30 2 *"}, "PROFILE_CRON", "never fires"),
        ({"PROFILE_SCHEDULE_SECONDS": "1e12"}, "PROFILE_SCHEDULE_SECONDS", "(a year)"),
        ({"PROFILE_TIMEZONE": "Mars/Olympus"}, "PROFILE_TIMEZONE", "unknown IANA timezone"),
    ],
)
def test_check_config_refuses_bad_schedules_in_one_line(
    variables: dict[str, str], variable: str, says: str
) -> None:
    out = check_config(**variables)
    assert out.returncode == 2, out.stdout + out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert PREFIX + variable in lines[0] and says in lines[0]
    assert "Traceback" not in out.stderr


def test_check_config_accepts_the_profile_cron() -> None:
    out = check_config(PROFILE_CRON="0 2 * * *", PROFILE_TIMEZONE="Asia/Shanghai")
    assert out.returncode == 0, out.stderr
