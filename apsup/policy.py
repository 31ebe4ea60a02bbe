"""Scheduling policies: when a family's automatic check is due (RFC §4).

All datetimes are naive UTC (database time). Cron expressions are evaluated in the family's IANA
timezone on wall-clock time, then mapped to UTC with ``fold=0``: a wall time that DST skips fires
once just after the gap, and a wall time that DST repeats fires once (its first occurrence).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import croniter

from apsup.errors import ConfigError


@dataclass(frozen=True)
class Disabled:
    """Automatic admission off; explicit requests and recovery still run."""

    def next_due(self, checkpoint: datetime | None, now: datetime) -> datetime | None:
        return None

    def checkpoint_for(self, now: datetime) -> datetime:
        return now

    def describe(self) -> str:
        return "disabled"


@dataclass(frozen=True)
class Interval:
    """A check may start when database time reaches ``checkpoint + seconds``."""

    seconds: float

    def __post_init__(self) -> None:
        if not self.seconds > 0:
            raise ConfigError(f"interval must be > 0 seconds, got {self.seconds!r}")

    def next_due(self, checkpoint: datetime | None, now: datetime) -> datetime | None:
        if checkpoint is None:
            return now  # no check has started: pending work permits an immediate first check
        return checkpoint + timedelta(seconds=self.seconds)

    def checkpoint_for(self, now: datetime) -> datetime:
        return now  # intervals are measured between check starts

    def describe(self) -> str:
        return f"interval {self.seconds:g}s"


@dataclass(frozen=True)
class Cron:
    """Cron fires in an IANA timezone; missed fires coalesce into one catch-up."""

    expr: str
    timezone: str

    def __post_init__(self) -> None:
        try:
            ZoneInfo(self.timezone)
        except (ZoneInfoNotFoundError, ValueError) as exc:
            raise ConfigError(
                f"unknown IANA timezone {self.timezone!r}; use a name such as 'Asia/Shanghai'"
            ) from exc
        if not croniter.is_valid(self.expr):
            raise ConfigError(f"invalid cron expression {self.expr!r}; expected e.g. '0 2 * * *'")

    @property
    def _tz(self) -> ZoneInfo:
        return ZoneInfo(self.timezone)

    def _to_wall(self, utc: datetime) -> datetime:
        return utc.replace(tzinfo=UTC).astimezone(self._tz).replace(tzinfo=None)

    def _to_utc(self, wall: datetime) -> datetime:
        aware = wall.replace(tzinfo=self._tz, fold=0)
        return aware.astimezone(UTC).replace(tzinfo=None)

    def next_fire_after(self, instant: datetime) -> datetime:
        """First fire strictly after ``instant`` (UTC)."""
        it = croniter(self.expr, self._to_wall(instant))
        while True:
            fire = self._to_utc(it.get_next(datetime))
            if fire > instant:
                return fire

    def latest_fire_at_or_before(self, instant: datetime) -> datetime | None:
        """Latest fire <= ``instant`` (UTC), or None if none within a year."""
        start = self._to_wall(instant) + timedelta(microseconds=1)
        it = croniter(self.expr, start)
        limit = instant - timedelta(days=366)
        while True:
            fire = self._to_utc(it.get_prev(datetime))
            if fire <= instant:
                return fire
            if fire < limit:  # pragma: no cover - defensive, cron always fires within a year
                return None

    def next_due(self, checkpoint: datetime | None, now: datetime) -> datetime | None:
        if checkpoint is None:
            return now  # immediate catch-up on first enablement (Profile's contract)
        return self.next_fire_after(checkpoint)

    def checkpoint_for(self, now: datetime) -> datetime:
        """The admitted fire: the latest one <= now, so missed fires coalesce into one."""
        return self.latest_fire_at_or_before(now) or now

    def describe(self) -> str:
        return f"cron {self.expr!r} {self.timezone}"


Policy = Disabled | Interval | Cron


def is_due(policy: Policy, checkpoint: datetime | None, now: datetime) -> bool:
    due = policy.next_due(checkpoint, now)
    return due is not None and due <= now
