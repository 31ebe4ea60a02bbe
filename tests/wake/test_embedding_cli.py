"""The CLI as a user's application meets it: ``--app`` imports from the working directory,
``--version``, the HTTP listener on by default (found by ``apsup status`` without ``--url``),
the demo's closing hint runs as printed, and ``apsup.connect`` / plain engines for publishing.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
from sqlalchemy import create_engine

import apsup
from apsup.errors import ConfigError
from apsup.registry import Registry, family
from tests.wake.support import APSUP, LIMIT, App, Host, make_app, run_cli

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def app(tmp_path: Path) -> App:
    return make_app(tmp_path)


def test_version_from_package_metadata() -> None:
    out = subprocess.run([APSUP, "--version"], capture_output=True, text=True, timeout=LIMIT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"apsup {version('apsup')}"
    assert apsup.__version__ == version("apsup")


def test_app_module_is_imported_from_the_working_directory(app: App) -> None:
    """The console script's own folder, not the working directory, starts sys.path."""
    out = run_cli(app, "check-config", "--app", "wakeapp.families", "--json")
    assert out.returncode == 0, out.stderr
    assert {"wake-manual", "wake-interval"} <= set(json.loads(out.stdout)["families"])


def test_status_finds_the_local_hosts_listener_without_url(app: App) -> None:
    host = Host(app).start().wait_ready()
    try:
        out = run_cli(app, "status", "--json")
    finally:
        assert host.stop() == 0
    assert out.returncode == 0, out.stderr
    view = json.loads(out.stdout)
    assert view["host"]["available"], view["host"]
    assert view["host"]["url"].startswith("http://127.0.0.1:")
    assert view["families"]["wake-manual"]["budget"] == 2, view["families"]  # a live column


def test_the_listener_can_be_turned_off(app: App) -> None:
    host = Host(app, env={"POWERCONTEXT_SERVER_RUNTIME_HTTP_PORT": "off"}).start().wait_ready()
    try:
        out = run_cli(app, "status", "--json")
    finally:
        assert host.stop() == 0
    assert out.returncode == 0, out.stderr
    assert not json.loads(out.stdout)["host"]["available"]


def test_the_demo_hint_works_as_printed(tmp_path: Path) -> None:
    demo = subprocess.run(
        [APSUP, "demo", "--seconds", "2"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=LIMIT * 2,
    )
    assert demo.returncode == 0, demo.stderr[-2000:]
    hint = demo.stdout.strip().splitlines()[-1].strip()
    out = subprocess.run(
        shlex.split(hint), cwd=tmp_path, capture_output=True, text=True, timeout=LIMIT
    )
    assert out.returncode == 0, (hint, out.stderr)
    assert "topic-memory" in out.stdout


def test_publishing_needs_a_database_a_host_can_see(tmp_path: Path) -> None:
    registry = Registry()

    @family("edge-case", registry=registry)
    def proc(scope_id: str, ctx: apsup.ExecutionContext) -> None:  # pragma: no cover
        pass

    with create_engine("sqlite://").begin() as conn, pytest.raises(ConfigError, match="memory"):
        proc.request(conn, "s")
    url = f"sqlite:///{tmp_path / 'x.db'}"
    auto = create_engine(url, isolation_level="AUTOCOMMIT")
    with auto.connect() as conn, pytest.raises(ConfigError, match="AUTOCOMMIT"):
        proc.mark_dirty(conn, "s")
    auto.dispose()


def test_connect_returns_an_immediate_transaction_engine(app: App) -> None:
    """``apsup.connect``: on SQLite every transaction holds the write lock from its start."""
    engine = apsup.connect(app.url)
    other = create_engine(app.url, connect_args={"timeout": 0})
    try:
        with (
            engine.begin(),
            other.connect() as conn,
            pytest.raises(Exception, match="locked"),
        ):
            conn.exec_driver_sql("BEGIN IMMEDIATE")
    finally:
        engine.dispose()
        other.dispose()
    assert sys.modules["apsup"].connect is apsup.connect


@pytest.mark.parametrize(
    ("raw", "port"), [(None, 0), ("", 0), ("0", 0), ("9464", 9464), ("off", None), ("OFF", None)]
)
def test_http_port_setting(raw: str | None, port: int | None) -> None:
    """Unset = on, any free port; ``off`` = no listener; and a dedicated child (MySQL) inherits
    exactly that choice."""
    from apsup.config import DEFAULT_PREFIX, Settings
    from apsup.supervisor.dedicated import child_env

    registry = Registry()

    @family("port-probe", registry=registry)
    def proc(scope_id: str, ctx: apsup.ExecutionContext) -> None:  # pragma: no cover
        pass

    env = {DEFAULT_PREFIX + "DATABASE_URL": "mysql+pymysql://apsup@127.0.0.1:2881/app"}
    if raw is not None:
        env[DEFAULT_PREFIX + "HTTP_PORT"] = raw
    settings = Settings.load(registry, env=env)
    assert settings.http_port == port
    again = Settings.load(registry, env=child_env(settings, 0, base_env={}))
    assert again.http_port == (None if port is None else (port and port + 1))


def test_http_port_rejects_other_words(tmp_path: Path) -> None:
    from apsup.config import DEFAULT_PREFIX, Settings

    env = {
        DEFAULT_PREFIX + "DATABASE_URL": f"sqlite:///{tmp_path / 'p.db'}",
        DEFAULT_PREFIX + "HTTP_PORT": "disabled",
    }
    with pytest.raises(ConfigError, match=r"HTTP_PORT.*or off"):
        Settings.load(Registry(), env=env)
