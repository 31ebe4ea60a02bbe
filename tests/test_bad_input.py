"""Bad input at the boundaries: exit 2, one line naming what to change, nothing created.

The CLI runs as a real subprocess. Before: a mistyped SQLite path for ``run``/``trigger``
created its directory and an empty database; a directory, a /proc path, an unmigrated database
or a non-UTF-8 Scope id ended in a traceback; ``MAX_WORKERS=99999999999999999999`` and a
fullwidth digit were accepted; binding names took NUL, newline and spaces.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import select

from apsup import Registry, family
from apsup.errors import ConfigError
from apsup.store import migrate, open_backend
from apsup.store.schema import intents as intents_table

pytestmark = [pytest.mark.backends("sqlite"), pytest.mark.timeout(300)]

PREFIX = "POWERCONTEXT_SERVER_RUNTIME_"
APP = ["--app", "apsup.families.topic_memory"]
FAMILY = "topic-memory"


def apsup(*args: str | bytes, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith(PREFIX)}
    base.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "apsup.cli", *args], capture_output=True, env=base, timeout=120
    )


def _refused(out: subprocess.CompletedProcess, *names: str) -> str:
    """Exit 2, no traceback, exactly one ``apsup:`` line, naming each of ``names``."""
    err = out.stderr.decode("utf-8", "replace")
    assert "Traceback" not in err, err
    assert out.returncode == 2, (out.returncode, err)
    lines = [line for line in err.splitlines() if line.startswith("apsup:")]
    assert len(lines) == 1, err
    for name in names:
        assert name in lines[0], (name, lines[0])
    return lines[0]


@pytest.fixture(scope="module")
def migrated(tmp_path_factory: pytest.TempPathFactory) -> str:
    url = f"sqlite:///{tmp_path_factory.mktemp('db') / 'apsup.db'}"
    migrate(url)
    return url


@pytest.mark.parametrize("command", ["run", "trigger"])
def test_a_missing_directory_is_refused_and_not_created(tmp_path: Path, command: str) -> None:
    url = f"sqlite:///{tmp_path / 'nonexistent' / 'dir' / 'x.db'}"
    args = [command, *APP, "--db", url] + ([FAMILY, "s"] if command == "trigger" else [])
    _refused(apsup(*args), "does not exist", "database URL")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("path", "says"),
    [
        ("{tmp}", "is a directory"),
        ("/proc/self/status", "not a regular database file"),
        ("{tmp}/notes.txt", "not a SQLite database"),
    ],
)
def test_a_path_that_is_no_database_file_is_refused(tmp_path: Path, path: str, says: str) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text("not a database\n")
    url = "sqlite:///" + path.format(tmp=tmp_path)
    for args in (["trigger", *APP, "--db", url, FAMILY, "s"], ["run", *APP, "--db", url]):
        _refused(apsup(*args), says)
    assert list(tmp_path.iterdir()) == [notes]
    assert notes.read_text() == "not a database\n"


def test_trigger_on_an_unmigrated_database_names_migrate(tmp_path: Path) -> None:
    empty = tmp_path / "empty.db"
    empty.touch()
    _refused(apsup("trigger", *APP, "--db", f"sqlite:///{empty}", FAMILY, "s"), "apsup migrate")
    assert empty.stat().st_size == 0  # nothing created in it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.db"]


def test_a_non_utf8_scope_is_refused_and_nothing_is_written(migrated: str) -> None:
    _refused(apsup("trigger", *APP, "--db", migrated, FAMILY, b"caf\xe9"), "SCOPE")
    backend = open_backend(migrated)
    try:
        with backend.read() as conn:
            assert conn.execute(select(intents_table.c.scope_id)).all() == []
    finally:
        backend.dispose()


@pytest.mark.parametrize("value", ["99999999999999999999", "\uff13", "1_000", "0x10", "1025"])
def test_max_workers_out_of_bounds_or_not_ascii_is_refused(value: str) -> None:
    var = PREFIX + "TOPIC_MEMORY_MAX_WORKERS"
    _refused(apsup("check-config", *APP, env={var: value}), var)


@pytest.mark.parametrize("binding", ["a b", "a\nb", "a\x00b", " ab", "ab ", "Ab", ""])
def test_binding_names_are_as_strict_as_family_names(binding: str) -> None:
    with pytest.raises(ConfigError, match="binding"):
        family("strict", binding=binding, registry=Registry())


# --- property: every input works or is refused cleanly ------------------------------------------

NUMERIC = [
    "TOPIC_MEMORY_MAX_WORKERS",
    "TOPIC_MEMORY_WORKER_TIMEOUT_SECONDS",
    "TOPIC_MEMORY_SCHEDULE_SECONDS",
    "LEASE_SECONDS",
    "RENEW_SECONDS",
    "POLL_SECONDS",
    "SHUTDOWN_GRACE_SECONDS",
    "HTTP_PORT",
]
_ENV_TEXT = st.characters(exclude_categories=("Cs",), exclude_characters="\x00")
values = st.one_of(
    st.integers(-(10**25), 10**25).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(
        ["\uff13", "\u0663", "1_000", "0x10", "1e12", "1e400", " 5 ", "+3", "-0", "1.", ".5"]
    ),
    st.text(_ENV_TEXT, max_size=12),
)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(NUMERIC), value=values)
def test_every_environment_value_works_or_is_refused_naming_it(name: str, value: str) -> None:
    var = PREFIX + name
    # The database named by the environment: check-config reads settings only (with --db it
    # would also check that database's schema).
    env = {var: value, PREFIX + "DATABASE_URL": "sqlite:////nonexistent-apsup/x.db"}
    out = apsup("check-config", *APP, env=env)
    err = out.stderr.decode("utf-8", "replace")
    assert "Traceback" not in err, err
    if out.returncode != 0:
        _refused(out, var)


scopes = st.one_of(
    st.text(st.characters(exclude_characters="\x00", exclude_categories=("Cs",)), max_size=300),
    st.binary(max_size=40).filter(lambda b: b"\x00" not in b),
)


@settings(
    max_examples=20,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(scope=scopes)
def test_every_scope_id_is_accepted_exactly_or_refused(migrated: str, scope: str | bytes) -> None:
    out = apsup("trigger", *APP, "--db", migrated, FAMILY, "--", scope)
    err = out.stderr.decode("utf-8", "replace")
    assert "Traceback" not in err, err
    if out.returncode != 0:
        _refused(out, "SCOPE")
        return
    text = scope if isinstance(scope, str) else os.fsdecode(scope)
    backend = open_backend(migrated)
    try:
        with backend.read() as conn:
            found = conn.execute(
                select(intents_table.c.scope_id).where(intents_table.c.scope_id == text)
            ).all()
        assert [r[0] for r in found] == [text]  # stored byte for byte, as one Scope
    finally:
        backend.dispose()
