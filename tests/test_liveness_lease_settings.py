"""Lease timing that would churn leadership is refused at configuration time.

The host gives up a term at its renew deadline (two thirds of the lease by default), so a
renewal interval close to the lease (e.g. lease 1 s, renew 0.9 s) would lose leadership every
few seconds and SIGTERM every Worker each time. ``RENEW_SECONDS`` must be at most a third of
``LEASE_SECONDS`` (a failed renewal still leaves time for the next one); the default is exactly
a third. The renew deadline itself must lie strictly between the renewal interval and the
lease.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PREFIX = "POWERCONTEXT_SERVER_RUNTIME_"
APP = ["--app", "apsup.families.topic_memory"]


def check_config(**values: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(PREFIX)}
    env.update({PREFIX + k: v for k, v in values.items()})
    return subprocess.run(
        [sys.executable, "-m", "apsup.cli", "check-config", *APP],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


@pytest.mark.parametrize(
    ("lease", "renew"), [("1", "0.9"), ("1", "0.5"), ("10", "4"), ("15", "10"), ("3", "3")]
)
def test_renewal_too_close_to_the_lease_is_refused(lease: str, renew: str) -> None:
    out = check_config(LEASE_SECONDS=lease, RENEW_SECONDS=renew)
    assert out.returncode == 2, out.stdout + out.stderr
    lines = [line for line in out.stderr.splitlines() if "RENEW_SECONDS" in line]
    assert len(lines) == 1, out.stderr
    assert f"{PREFIX}RENEW_SECONDS" in lines[0] and "LEASE_SECONDS" in lines[0]
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize(
    ("lease", "renew", "effective"), [("1", "0.3", "0.3"), ("3", "1", "1"), ("9", None, "3")]
)
def test_safe_lease_timing_is_accepted(lease: str, renew: str | None, effective: str) -> None:
    values = {"LEASE_SECONDS": lease}
    if renew is not None:
        values["RENEW_SECONDS"] = renew
    out = check_config(**values)
    assert out.returncode == 0, out.stderr
    assert f"renew_seconds = {effective}" in out.stdout + out.stderr, out.stdout


@pytest.mark.parametrize(("deadline"), ["1", "3", "0.5", "4", "nan"])
def test_a_renew_deadline_outside_renewal_and_lease_is_refused(deadline: str) -> None:
    out = check_config(LEASE_SECONDS="3", RENEW_SECONDS="1", RENEW_DEADLINE_SECONDS=deadline)
    assert out.returncode == 2, out.stdout + out.stderr
    lines = [line for line in out.stderr.splitlines() if "RENEW_DEADLINE_SECONDS" in line]
    assert len(lines) == 1, out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize(("deadline", "effective"), [(None, "6"), ("4", "4"), ("8.5", "8.5")])
def test_a_renew_deadline_between_renewal_and_lease_is_accepted(
    deadline: str | None, effective: str
) -> None:
    values = {"LEASE_SECONDS": "9"}
    if deadline is not None:
        values["RENEW_DEADLINE_SECONDS"] = deadline
    out = check_config(**values)
    assert out.returncode == 0, out.stderr
    assert f"renew_deadline_seconds = {effective}" in out.stdout + out.stderr, out.stdout
