"""Cron across daylight-saving changes and clock jumps, black-box: a real host on SQLite whose
clock (and its Workers') is moved by libfaketime (docs/scheduling-time.md).

The host runs as a subprocess with ``LD_PRELOAD=libfaketime`` and a relative offset read from a
file (``FAKETIME_TIMESTAMP_FILE``), so a test can put database time just before a transition, or
move it back while the host runs. The test process keeps the real clock.

libfaketime 0.9.10 (Debian) breaks ``clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME)`` when the
monotonic clock is left alone (EINVAL), and hangs condition waits when it is faked; the faked
processes therefore get a ``sitecustomize`` that makes ``time.sleep`` a ``select`` wait. Nothing
of apsup is replaced.

Each scenario reproduces one report of the cron issue: a fresh start and a restart inside the
repeated fall-back hour (no scan storm, the checkpoint never goes back), a running host crossing
fall-back (the repeated hour is not silent), spring-forward (a skipped 02:30 fires when the gap
ends, not an hour late), and a backward clock jump (clamped and logged, not a stall).
"""

from __future__ import annotations

import glob
import itertools
import os
import signal
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from apsup.store import SqlBackend
from tests.acceptance.families import configure
from tests.acceptance.harness import events, mark_dirty, scan_state, wait_for

pytestmark = [pytest.mark.timeout(300), pytest.mark.backends("sqlite")]

NY = "America/New_York"
SHIM = """import select
import time


def _sleep(seconds):
    if seconds < 0:
        raise ValueError("sleep length must be non-negative")
    select.select([], [], [], seconds)


time.sleep = _sleep
"""


def utc(*args: int) -> datetime:
    return datetime(*args)  # naive UTC, as the store returns it


class FakeClock:
    """Database time of the hosts started from now on (and of running ones within ~1 s)."""

    def __init__(self, tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        libs = sorted(glob.glob("/usr/lib/*/faketime/libfaketime.so.1"))
        if not libs:
            message = "libfaketime is missing: apt-get install faketime"
            if os.environ.get("CI") == "true":
                pytest.fail(message)
            pytest.skip(message)
        shim = tmp / "faketime_shim"
        shim.mkdir()
        (shim / "sitecustomize.py").write_text(SHIM)
        self.rc = tmp / "faketime.rc"
        self.set_offset(0)
        monkeypatch.delenv("FAKETIME", raising=False)
        monkeypatch.setenv("LD_PRELOAD", libs[0])
        monkeypatch.setenv("FAKETIME_TIMESTAMP_FILE", str(self.rc))
        monkeypatch.setenv("FAKETIME_CACHE_DURATION", "1")
        monkeypatch.setenv("FAKETIME_DONT_FAKE_MONOTONIC", "1")
        path = os.environ.get("PYTHONPATH")
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(shim), path) if p))

    def set_offset(self, seconds: int) -> None:
        self.rc.write_text(f"{seconds:+d}\n")

    def set(self, target: datetime) -> None:
        real = datetime.now(UTC).replace(tzinfo=None)
        self.set_offset(round((target - real).total_seconds()))


@pytest.fixture
def clock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    return FakeClock(tmp_path, monkeypatch)


class Watch:
    """Samples the binding's durable check state from the test process."""

    def __init__(self, store: SqlBackend, fam: Any) -> None:
        self.store = store
        self.fam = fam
        self.checkpoints: list[datetime] = []
        self.generation = 0

    def sample(self) -> tuple[int, datetime | None]:
        st = scan_state(self.store, self.fam)
        if st is None:
            return 0, None
        if st.checkpoint is not None and (
            not self.checkpoints or self.checkpoints[-1] != st.checkpoint
        ):
            self.checkpoints.append(st.checkpoint)
        self.generation = st.scan_generation
        return st.scan_generation, st.checkpoint

    def until_checkpoint(self, expected: datetime, limit: float = 60) -> None:
        wait_for(lambda: self.sample()[1] == expected, f"checkpoint {expected}", limit)

    def hold(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.sample()
            time.sleep(0.1)

    def runs(self, scope: str) -> int:
        return sum(1 for e in events(self.store, self.fam) if e["scope_id"] == scope)


def start(hosts: Any, spec: dict[str, Any]) -> Any:
    host = hosts.process({"acc-a": spec})
    host.wait_ready()
    return host


def stop(host: Any) -> None:
    host.signal(signal.SIGTERM)
    assert host.wait() == 0, host.errors()[-2000:]


def test_start_and_restart_inside_the_repeated_hour_run_once_per_fire(
    hosts: Any, store: SqlBackend, clock: FakeClock
) -> None:
    spec = {"cron": "*/15 * * * *", "timezone": NY, "max_workers": 1}
    fam = configure("acc-a", cron=spec["cron"], timezone=NY)
    mark_dirty(store, fam, "keep.1", tell=False)  # stays dirty: every check admits it once
    watch = Watch(store, fam)

    clock.set(utc(2026, 11, 1, 6, 5, 30))  # 01:05:30 EST, the second 01:05 of the day
    host = start(hosts, spec)
    watch.until_checkpoint(utc(2026, 11, 1, 6, 0))  # 01:00 EST: the latest fire, once
    wait_for(lambda: watch.runs("keep.1") >= 1, "the catch-up run")
    watch.hold(8)
    assert (watch.generation, watch.runs("keep.1")) == (1, 1), watch.checkpoints
    stop(host)

    clock.set(utc(2026, 11, 1, 6, 20, 30))  # restart at 01:20:30 EST
    host = start(hosts, spec)
    watch.until_checkpoint(utc(2026, 11, 1, 6, 15))
    wait_for(lambda: watch.runs("keep.1") >= 2, "the second catch-up run")
    watch.hold(8)
    assert (watch.generation, watch.runs("keep.1")) == (2, 2), watch.checkpoints
    assert watch.checkpoints == [utc(2026, 11, 1, 6, 0), utc(2026, 11, 1, 6, 15)]
    stop(host)


def test_a_running_host_crosses_fall_back_without_a_silent_hour(
    hosts: Any, store: SqlBackend, clock: FakeClock
) -> None:
    spec = {"cron": "* * * * *", "timezone": NY, "max_workers": 1}
    fam = configure("acc-a", cron=spec["cron"], timezone=NY)
    watch = Watch(store, fam)
    clock.set(utc(2026, 11, 1, 5, 59, 48))  # 01:59:48 EDT; at 06:00 it is 01:00 EST
    host = start(hosts, spec)
    watch.until_checkpoint(utc(2026, 11, 1, 6, 0), limit=60)
    watch.hold(3)
    assert watch.checkpoints == [utc(2026, 11, 1, 5, 59), utc(2026, 11, 1, 6, 0)]
    assert watch.generation == 2
    stop(host)


def test_spring_forward_fires_a_skipped_time_when_the_gap_ends(
    hosts: Any, store: SqlBackend, clock: FakeClock
) -> None:
    spec = {"cron": "30 2 * * *", "timezone": NY, "max_workers": 1}
    fam = configure("acc-a", cron=spec["cron"], timezone=NY)
    watch = Watch(store, fam)
    clock.set(utc(2026, 3, 8, 6, 59, 50))  # 01:59:50 EST; 02:30 does not exist that day
    host = start(hosts, spec)
    watch.until_checkpoint(utc(2026, 3, 8, 7, 0), limit=60)  # 03:00 EDT, not 03:30
    watch.hold(3)
    assert watch.checkpoints == [utc(2026, 3, 7, 7, 30), utc(2026, 3, 8, 7, 0)]
    stop(host)


def test_backward_clock_jump_is_clamped_and_logged_not_a_stall(
    hosts: Any, store: SqlBackend, clock: FakeClock
) -> None:
    spec = {"interval": 3, "max_workers": 1}
    fam = configure("acc-a", interval=3)
    watch = Watch(store, fam)
    host = start(hosts, spec)
    wait_for(lambda: watch.sample()[0] >= 2, "two checks at the real time")
    before = watch.sample()[1]
    assert before is not None
    clock.set_offset(-3600)  # database time goes back an hour
    wait_for(
        lambda: (watch.sample()[1] or before) < before,
        "a check after the jump (not an hour later)",
        limit=45,
    )
    generation = watch.generation
    wait_for(lambda: watch.sample()[0] >= generation + 1, "the interval resumes", limit=30)
    drops = [i for i, (a, b) in enumerate(itertools.pairwise(watch.checkpoints)) if b <= a]
    assert len(drops) == 1, watch.checkpoints  # the one clamp; strictly forward otherwise
    stop(host)
    assert "clamped" in host.errors()
