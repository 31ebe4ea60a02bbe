"""``apsup run`` refuses a database whose apsup schema is behind or ahead of the code (exit 2,
one line naming ``apsup migrate``), instead of starting and failing in every processor.

Behind: a database of the earlier layout at ``0001`` or ``0002`` (made by that code's own
revision files), and the reference families' branch stopped at ``apsup_0002``. Ahead: a revision
this code does not know (``apsup_0099``). Both backends; every role runs the check.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import text

from apsup.migrations import FAMILIES_BRANCH, VERSION_TABLE
from apsup.store import migrate, open_backend
from apsup.store.revision import branch_head, script_directory
from tests._legacy_layout import make_legacy_database

pytestmark = pytest.mark.timeout(240)

PREFIX = "POWERCONTEXT_SERVER_RUNTIME_"
APP = "tests.replicas.cli_app"


def run(url: str, role: str = "all") -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(PREFIX)}
    env[PREFIX + "ARTIFACT_PROCESSING_ROLE"] = role
    try:
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "apsup.cli",
                "run",
                "--app",
                "tests.replicas.cli_app",
                "--db",
                url,
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,  # a host that starts never exits by itself: the check did not refuse
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"apsup run started on a mismatched schema: {exc.stderr!r}")


def assert_refused(out: subprocess.CompletedProcess[str], *words: str) -> None:
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("apsup:")]
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert "apsup migrate" in lines[0], lines[0]
    for word in words:
        assert word in lines[0], lines[0]


@pytest.mark.parametrize("legacy", ["0001", "0002"])
def test_run_refuses_a_database_of_the_earlier_layout(
    db_url: str, tmp_path: Path, legacy: str
) -> None:
    make_legacy_database(db_url, legacy, tmp_path)
    assert_refused(run(db_url), "earlier layout", legacy)


def test_run_refuses_a_branch_behind_the_code(db_url: str) -> None:
    migrate(db_url, "apsup_0002")
    # The message names the revision the families branch needs: its newest one.
    assert_refused(run(db_url), "behind", branch_head(script_directory(), FAMILIES_BRANCH))


def ahead(db_url: str) -> None:
    migrate(db_url)
    backend = open_backend(db_url)
    try:
        with backend.transaction() as conn:
            conn.execute(text(f"UPDATE {VERSION_TABLE} SET version_num = 'apsup_0099'"))
    finally:
        backend.dispose()


def test_run_refuses_a_revision_it_does_not_know(db_url: str) -> None:
    ahead(db_url)
    assert_refused(run(db_url), "apsup_0099", "ahead")


@pytest.mark.mysql_only  # the api role needs a shared database
def test_an_api_replica_checks_the_revision_too(db_url: str) -> None:
    ahead(db_url)
    assert_refused(run(db_url, "api"), "apsup_0099")


def test_run_refuses_a_database_never_migrated_by_apsup(db_url: str) -> None:
    migrate(db_url)
    backend = open_backend(db_url)
    try:
        with backend.transaction() as conn:
            conn.execute(text(f"DROP TABLE {VERSION_TABLE}"))
    finally:
        backend.dispose()
    assert_refused(run(db_url), "no apsup schema revision")


def _cli(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(PREFIX)}
    try:
        return subprocess.run(
            [sys.executable, "-m", "apsup.cli", *args, "--db", url],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"apsup {args[0]} started without the families' tables: {exc.stderr!r}")


@pytest.mark.parametrize("command", ["run", "check-config"])
def test_reference_families_without_their_tables_are_refused(db_url: str, command: str) -> None:
    """The default app of deploy/ is a reference family: migrated without
    --with-reference-families, the host used to start and stay degraded
    (``reconcile: ProgrammingError``) for ever."""
    migrate(db_url)  # the framework only
    out = _cli(db_url, command, "--app", "apsup.families.topic_memory")
    assert_refused(out, "--with-reference-families")
    migrate(db_url, reference_families=True)
    ok = _cli(db_url, "check-config", "--app", "apsup.families.topic_memory")
    assert ok.returncode == 0, ok.stderr
