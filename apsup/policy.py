"""Scheduling policies: when a family's automatic check is due.

The interface is database time: naive datetimes in UTC. Inside, cron maths runs on aware UTC
instants; a wall time is turned into instants with ``fold`` set explicitly, never by dropping it,
so the two occurrences of a repeated wall time stay two distinct instants (docs/scheduling-time.md).

Cron daylight-saving rules (Vixie cron's, with "covers every hour" deciding the kind of cron):

* A cron whose hour field covers all 24 hours (``*/15 * * * *``, ``0 * * * *``) follows elapsed
  time: it fires at every real instant whose local wall time matches, so it fires through both
  occurrences of a repeated (fall-back) hour, and wall times skipped by spring-forward do not fire.
* Any other cron names times of day (``30 1 * * *``): a repeated wall time fires once, at its first
  occurrence, and a skipped wall time fires once, at the instant the gap ends (02:30 in a
  02:00→03:00 gap fires at 03:00 new time).

Every fire is therefore one real instant; ``next_fire_after`` and ``latest_fire_at_or_before``
enumerate the same set, so the checkpoint (the latest admitted fire) only moves forward.
"""

from __future__ import annotations

import calendar
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import CroniterBadDateError, CroniterError, croniter

from apsup.errors import ConfigError

MAX_INTERVAL_SECONDS = 366 * 24 * 3600.0
"""Longest accepted interval (a year and a day); longer values overflow datetime maths."""

CLOCK_JUMP_TOLERANCE = timedelta(seconds=60)
"""A checkpoint further than this ahead of database time means the clock went back: the
scheduling core clamps it (see ``apsup.scheduling.core``)."""

_SHIFT_WINDOW = timedelta(hours=3)  # wider than any fall-back in use (Antarctica/Troll: 2 h)
_FIELDS = ("minute", "hour", "day-of-month", "month", "day-of-week")
_ALIASES = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}
_ALLOWED = set("0123456789*,-/") | set("abcdefghijklmnopqrstuvwxyz")
_NAMES = {
    3: {m.lower(): i for i, m in enumerate(calendar.month_abbr) if m},
    4: {"sun": 0, "mon": 1, "tue": 2, "wed": 3, "thu": 4, "fri": 5, "sat": 6},
}


def _normalise(expr: str) -> str:
    """Lower case, single spaces, shortcuts expanded; ``a-a`` ranges become ``a``.

    croniter 7 reads a one-value range such as ``13-13`` as ``*`` (every hour): rewriting it keeps
    the meaning the expression states.
    """
    text = " ".join(expr.split()).lower()
    text = _ALIASES.get(text, text)
    fields = []
    for value in text.split(" "):
        items = []
        for item in value.split(","):
            span, _, _step = item.partition("/")
            low, dash, high = span.partition("-")
            items.append(low if dash and low == high else item)
        fields.append(",".join(items))
    return " ".join(fields)


def cron_problem(expr: str) -> str | None:
    """Why ``expr`` is not an accepted five-field cron that fires, or None if it is.

    Accepted: five fields (minute hour day-of-month month day-of-week) of numbers, ``*``, ranges,
    lists, steps, month and weekday names, and the ``@daily``-style shortcuts. Refused: a sixth
    (seconds or year) field, croniter's extensions (``L``, ``W``, ``#``, ``H``, ``?``) and
    expressions that can never fire (``0 0 31 2 *``).
    """
    text = _normalise(expr)
    fields = text.split(" ") if text else []
    shown = expr.split() if len(expr.split()) == len(fields) else fields
    if len(fields) != 5:
        return (
            f"invalid cron expression {expr!r}: {len(fields)} field(s); use exactly five "
            "(minute hour day-of-month month day-of-week), e.g. '0 2 * * *'"
        )
    for index, value in enumerate(fields):
        bad = sorted(set(value) - _ALLOWED)
        words = [w for w in _split_words(value) if w not in _NAMES.get(index, {})]
        if bad or words:
            what = "".join(bad) or words[0].upper()
            return (
                f"invalid cron expression {expr!r}: {_FIELDS[index]} field {shown[index]!r} "
                f"uses {what!r}; "
                "only numbers, "
                "'*', ranges, lists, steps and month/weekday names are supported "
                "(no L, W, #, H or ?)"
            )
    if not croniter.is_valid(text):
        return f"invalid cron expression {expr!r}; expected e.g. '0 2 * * *'"
    expanded = croniter(text).expanded
    days, months, weekdays = expanded[2], expanded[3], expanded[4]
    if days != ["*"] and weekdays == ["*"]:
        month_set = range(1, 13) if months == ["*"] else [int(m) for m in months]
        longest = {m: 29 if m == 2 else calendar.monthrange(2001, m)[1] for m in month_set}
        if not any(int(d) <= longest[m] for d in days for m in month_set):
            return (
                f"invalid cron expression {expr!r}: it never fires, day-of-month "
                f"{','.join(map(str, days))} does not occur in month "
                f"{','.join(map(str, month_set))}; change the day-of-month or month field"
            )
    try:
        croniter(text, datetime(2000, 1, 1)).get_next(datetime)
    except (CroniterBadDateError, CroniterError):  # pragma: no cover - caught above
        return f"invalid cron expression {expr!r}: it never fires; change its day or month fields"
    return None


def _split_words(value: str) -> list[str]:
    word, words = "", []
    for ch in value + ",":
        if ch.isalpha():
            word += ch
        elif word:
            words.append(word)
            word = ""
    return words


def _aware(instant: datetime) -> datetime:
    """Naive datetimes are database time (UTC)."""
    if instant.tzinfo is None:
        return instant.replace(tzinfo=UTC)
    return instant.astimezone(UTC)


def _like(result: datetime, template: datetime) -> datetime:
    """Return ``result`` (aware UTC) in the kind of ``template``: naive stays naive."""
    return result.replace(tzinfo=None) if template.tzinfo is None else result


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
        if not self.seconds > 0 or not self.seconds <= MAX_INTERVAL_SECONDS:
            raise ConfigError(
                f"interval must be > 0 and <= {MAX_INTERVAL_SECONDS:g} seconds (a year), "
                f"got {self.seconds!r}"
            )

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
    _zone: ZoneInfo = field(init=False, repr=False, compare=False)
    _text: str = field(init=False, repr=False, compare=False)
    _every_hour: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        try:
            zone = ZoneInfo(self.timezone)
        except (ZoneInfoNotFoundError, ValueError) as exc:
            raise ConfigError(
                f"unknown IANA timezone {self.timezone!r}; use a name such as 'Asia/Shanghai'"
            ) from exc
        problem = cron_problem(self.expr)
        if problem is not None:
            raise ConfigError(problem)
        text = _normalise(self.expr)
        object.__setattr__(self, "_zone", zone)
        object.__setattr__(self, "_text", text)
        object.__setattr__(self, "_every_hour", croniter(text).expanded[1] == ["*"])

    # -- wall time <-> instants ----------------------------------------------------------------

    def _wall(self, instant: datetime) -> datetime:
        return instant.astimezone(self._zone).replace(tzinfo=None)

    def _fallback_near(self, instant: datetime) -> timedelta:
        """How far the zone's clock goes back around ``instant`` (0 unless a fall-back is near).

        Only a fall-back reorders wall times and instants, by at most its own size: that bounds
        how far around a wall time the enumeration below must look.
        """
        before = (instant - _SHIFT_WINDOW).astimezone(self._zone).utcoffset()
        after = (instant + _SHIFT_WINDOW).astimezone(self._zone).utcoffset()
        assert before is not None and after is not None
        return max(before - after, timedelta(0))

    def _instants(self, wall: datetime) -> tuple[datetime, ...]:
        """The instants (aware UTC) at which the matching wall time ``wall`` fires."""
        first = wall.replace(tzinfo=self._zone, fold=0).astimezone(UTC)
        second = wall.replace(tzinfo=self._zone, fold=1).astimezone(UTC)
        if first == second:
            return (first,)
        if first < second:  # repeated by a fall-back: two real instants
            return (first, second) if self._every_hour else (first,)
        # Skipped by spring-forward: fold=1 reads it with the old offset (before the gap),
        # fold=0 with the new one (after it); the gap ends between the two.
        if self._every_hour:
            return ()
        return (self._transition(second, first),)

    def _transition(self, low: datetime, high: datetime) -> datetime:
        """The first instant in (low, high] whose offset is the one at ``high``."""
        target = high.astimezone(self._zone).utcoffset()
        while high - low > timedelta(seconds=1):
            mid = low + (high - low) / 2
            if mid.astimezone(self._zone).utcoffset() == target:
                high = mid
            else:
                low = mid
        return high.replace(microsecond=0)

    def _walls(self, start: datetime, forward: bool) -> Iterator[datetime]:
        it = croniter(self._text, start)
        while True:
            yield it.get_next(datetime) if forward else it.get_prev(datetime)

    # -- fires ---------------------------------------------------------------------------------

    def next_fire_after(self, instant: datetime) -> datetime:
        """First fire strictly after ``instant`` (naive = UTC; returned in the same kind)."""
        t = _aware(instant)
        best: datetime | None = None
        limit: datetime | None = None
        for wall in self._walls(self._wall(t) - self._fallback_near(t), forward=True):
            if limit is not None and wall > limit:
                break
            for fire in self._instants(wall):
                if fire > t and (best is None or fire < best):
                    best = fire
                    limit = self._wall(best) + self._fallback_near(best)
        assert best is not None
        return _like(best, instant)

    def latest_fire_at_or_before(self, instant: datetime) -> datetime | None:
        """Latest fire <= ``instant`` (naive = UTC; returned in the same kind)."""
        t = _aware(instant)
        best: datetime | None = None
        limit: datetime | None = None
        start = self._wall(t) + self._fallback_near(t) + timedelta(minutes=1)
        for wall in self._walls(start.replace(second=0, microsecond=0), forward=False):
            if limit is not None and wall < limit:
                break
            for fire in self._instants(wall):
                if fire <= t and (best is None or fire > best):
                    best = fire
                    limit = self._wall(best) - self._fallback_near(best)
        return None if best is None else _like(best, instant)

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
