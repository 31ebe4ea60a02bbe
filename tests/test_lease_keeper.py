"""The renew deadline on the host's own monotonic clock (``apsup.supervisor.lease_keeper``).

A term held since a renewal that started at t may act until t + renew deadline; the watchdog
expires it at that instant whatever the loop is doing, and a renewal that succeeds after the
watchdog fired does not revive it (the loop drops it). A clock the test controls drives it.
"""

from __future__ import annotations

import threading
import time

import pytest

from apsup.supervisor.host import LeasePolicy
from apsup.supervisor.lease_keeper import LeaseKeeper


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_term_is_valid_until_its_deadline_and_renewals_move_it() -> None:
    clock = Clock()
    keeper = LeaseKeeper(2.0, lambda key: None, clock=clock)
    try:
        assert not keeper.valid("global")  # nothing held
        keeper.held("global", 100.0)
        assert keeper.valid("global") and keeper.left("global") == pytest.approx(2.0)
        clock.now = 101.5
        keeper.held("global", 101.0)  # renewed: the deadline counts from the attempt's start
        clock.now = 102.9
        assert keeper.valid("global") and not keeper.expired("global")
        clock.now = 103.0
        assert not keeper.valid("global") and keeper.expired("global")
        keeper.dropped("global")
        assert keeper.deadline("global") is None and not keeper.expired("global")
    finally:
        keeper.close()


def test_the_watchdog_steps_down_without_the_loop_and_a_late_renewal_does_not_revive() -> None:
    fired: list[str] = []
    done = threading.Event()

    def on_expire(key: str) -> None:
        fired.append(key)
        done.set()

    keeper = LeaseKeeper(0.2, on_expire)  # the real monotonic clock
    try:
        keeper.held("artifact:a", time.monotonic())
        keeper.held("artifact:b", time.monotonic() + 60)  # renewed far ahead: not due
        assert done.wait(10), "the watchdog never fired"
        assert fired == ["artifact:a"]
        assert not keeper.valid("artifact:a") and keeper.valid("artifact:b")
        keeper.held("artifact:a", time.monotonic())  # a renewal that returned too late
        assert not keeper.valid("artifact:a") and keeper.expired("artifact:a")
        keeper.dropped("artifact:a")  # the loop dropped the term; a new claim starts afresh
        keeper.held("artifact:a", time.monotonic())
        assert keeper.valid("artifact:a")
    finally:
        keeper.close()


def test_a_replaced_term_is_no_longer_valid_though_its_key_is() -> None:
    """Validity names the term: after a drop and a claim of the next generation, the key is
    held again but the old generation is not (``/status`` asks by generation)."""
    clock = Clock()
    keeper = LeaseKeeper(2.0, lambda key: None, clock=clock)
    try:
        keeper.held("global", 100.0, 7)
        assert keeper.valid("global", 7) and keeper.valid("global")
        keeper.dropped("global")
        assert not keeper.valid("global", 7)
        keeper.held("global", 100.5, 8)
        assert keeper.valid("global") and keeper.valid("global", 8)
        assert not keeper.valid("global", 7)
        keeper.held("global", 101.0)  # a renewal that does not name its term keeps the last
        assert keeper.valid("global", 8) and not keeper.valid("global", 7)
    finally:
        keeper.close()


@pytest.mark.parametrize(
    ("lease", "renew", "deadline"),
    [(3.0, 1.0, 1.0), (3.0, 1.0, 3.0), (3.0, 1.0, 0.5), (15.0, 5.0, 16.0)],
)
def test_a_renew_deadline_outside_renew_and_lease_is_refused(
    lease: float, renew: float, deadline: float
) -> None:
    with pytest.raises(ValueError, match="renew deadline"):
        LeasePolicy(lease, renew, 0.5, deadline)


def test_the_default_renew_deadline_is_two_thirds_of_the_lease() -> None:
    assert LeasePolicy(15.0, 5.0, 2.0).deadline == pytest.approx(10.0)
    assert LeasePolicy(3.0, 1.0, 0.5).deadline == pytest.approx(2.0)
