"""The CLI as a subprocess: check-config (aliases reported, no password), configuration errors
with exit code 2, and the demo (the README's first command) completing work on SQLite."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

PREFIX = "POWERCONTEXT_SERVER_RUNTIME_"
APPS = ["--app", "apsup.families.topic_memory", "--app", "apsup.families.profile"]


def apsup(
    *args: str, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(PREFIX)}
    base.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "apsup.cli", *args],
        capture_output=True,
        text=True,
        env=base,
        timeout=timeout,
    )


def test_check_config_reports_aliases_and_never_the_password() -> None:
    env = {
        PREFIX + "DATABASE_URL": "mysql+pymysql://svc:Sup3rSecret@db.internal:2881/apsup",
        PREFIX + "ARTIFACT_PROCESSING_ROLE": "background",
        PREFIX + "ARTIFACT_PROCESSING_MAX_WORKERS": "7",
        PREFIX + "PROFILE_MAX_CONCURRENCY": "3",
    }
    out = apsup("check-config", *APPS, env=env)
    assert out.returncode == 0, out.stderr
    text = out.stdout + out.stderr
    assert "Sup3rSecret" not in text and "svc:" not in text
    assert re.search(r"topic-memory\.max_workers = 7", text), text
    assert re.search(r"profile\.max_workers = 3", text), text
    assert "ARTIFACT_PROCESSING_MAX_WORKERS" in text and "PROFILE_MAX_CONCURRENCY" in text


def test_bad_configuration_exits_2_naming_the_variable() -> None:
    env = {PREFIX + "TOPIC_MEMORY_MAX_WORKERS": "many"}
    out = apsup("check-config", *APPS, env=env)
    assert out.returncode == 2
    assert "TOPIC_MEMORY_MAX_WORKERS" in out.stderr
    out = apsup("check-config", *APPS, env={PREFIX + "EXPERIENCE_SCHEDULE_SECONDS": "60"})
    assert out.returncode == 2 and "EXPERIENCE_SCHEDULE_SECONDS" in out.stderr
    out = apsup("check-config", "--app", "no_such_module_anywhere")
    assert out.returncode == 2 and "no_such_module_anywhere" in out.stderr


def test_demo_runs_the_reference_families_on_sqlite(tmp_path: Path) -> None:
    db = tmp_path / "demo.db"
    out = apsup("demo", "--seconds", "6", "--db-path", str(db))
    assert out.returncode == 0, out.stderr[-2000:]
    finished = re.search(r"demo finished: (.*)", out.stdout)
    assert finished, out.stdout[-2000:]
    counts = {
        m.group(1): int(m.group(2))
        for m in re.finditer(r"([\w-]+) (\d+) completed", finished.group(1))
    }
    assert counts.get("topic-memory", 0) > 0 and counts.get("handoff", 0) > 0, counts
    assert oct(db.stat().st_mode & 0o777) == "0o600"
    # The status it hints at names the failing Scope's real error, not just an exit code.
    status = apsup("status", "--db", f"sqlite:///{db}", "--once")
    assert status.returncode == 0, status.stderr
    assert "cannot process source position" in status.stdout, status.stdout[-2000:]
    assert "exited with code" not in status.stdout


def test_a_package_of_families_is_answered_with_its_modules() -> None:
    """``--app apsup.families`` (the package, whose import registers nothing) names the modules
    to pass instead of saying that no family is registered."""
    out = apsup("check-config", "--app", "apsup.families")
    assert out.returncode == 2, out.stdout + out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert "--app apsup.families.topic_memory" in lines[0], lines[0]
    assert "no family is registered" not in lines[0]
    both = apsup("check-config", "--app", "apsup.families", "--app", "apsup.families.profile")
    assert both.returncode == 0, both.stderr  # with a module that registers one: fine


@pytest.mark.backends("mysql")
def test_trigger_on_mysql_does_not_claim_that_no_host_was_told(db_url: str) -> None:
    """On MySQL the request's commit nudges the leaders (their poll is the safety net): the
    SQLite-only "no local host notified" was wrong there."""
    from apsup.store import migrate

    migrate(db_url, reference_families=True)
    out = apsup("trigger", "topic-memory", "t-1", *APPS, "--db", db_url)
    assert out.returncode == 0, out.stderr
    assert "accepted: topic-memory scope 't-1'" in out.stdout
    assert "no local host notified" not in out.stdout
    assert "the leader is woken at once" in out.stdout
