"""A user's application in a temporary folder, its ``apsup run`` host and its publishers, all as
real separate processes (see ``wakeapp``).

The host's own SQLAlchemy activity is observed through ``WAKEAPP_PROBE``: every transaction
start and statement of the host process is a line ``<pid> <time> <what>`` in a file, so a test
can prove the host idle (no line) and time its first reaction to a commit.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, select

from apsup.store import migrate

HERE = Path(__file__).resolve().parent
PREFIX = "POWERCONTEXT_SERVER_RUNTIME_"
APSUP = str(Path(sys.executable).with_name("apsup"))
LIMIT = 60.0  # bound for anything that must happen; never a performance assertion


@dataclass
class App:
    root: Path
    url: str
    probe: Path

    @property
    def db(self) -> Path:
        return Path(self.url.removeprefix("sqlite:///"))

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(PREFIX)}
        env.pop("PYTHONPATH", None)  # the app is importable only from its own folder
        env[PREFIX + "DATABASE_URL"] = self.url
        env[PREFIX + "LOG_FORMAT"] = "json"
        env["WAKEAPP_PROBE"] = str(self.probe)
        env.update(extra)
        return env

    def publish(
        self, action: str, which: str, scope: str, engine: str = "plain"
    ) -> dict[str, float]:
        """Commit one intent from a separate process; returns its ``before``/``committed`` times."""
        env = self.env()
        env.pop("WAKEAPP_PROBE")
        out = subprocess.run(
            [sys.executable, "publish.py", self.url, action, which, scope, engine],
            cwd=self.root,
            env=env,
            capture_output=True,
            text=True,
            timeout=LIMIT,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
        return result

    def runs(self, family: str) -> dict[str, float]:
        """scope -> start time of its first invocation, from the application's table."""
        from wakeapp_tables import runs  # type: ignore[import-not-found]

        engine = create_engine(self.url)
        try:
            with engine.connect() as conn:
                rows = conn.execute(
                    select(runs.c.scope_id, runs.c.started)
                    .where(runs.c.family == family)
                    .order_by(runs.c.id)
                ).all()
        finally:
            engine.dispose()
        out: dict[str, float] = {}
        for scope, started in rows:
            out.setdefault(scope, started)
        return out

    def wait_run(self, family: str, scope: str, limit: float = LIMIT) -> float:
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            started = self.runs(family).get(scope)
            if started is not None:
                return started
            time.sleep(0.02)
        raise AssertionError(f"{family} {scope!r} was not processed within {limit}s")


def make_app(base: Path, url: str | None = None) -> App:
    """Copy the application into ``base`` and migrate apsup's and the application's tables."""
    root = base / "app"
    root.mkdir(parents=True)
    shutil.copytree(HERE / "wakeapp", root / "wakeapp")
    shutil.copy(HERE / "publish.py", root / "publish.py")
    if url is None:
        (root / "var").mkdir()
        url = f"sqlite:///{root / 'var' / 'app.db'}"
    migrate(url)
    _tables_module()
    from wakeapp_tables import metadata

    engine = create_engine(url)
    try:
        metadata.create_all(engine)
    finally:
        engine.dispose()
    return App(root=root, url=url, probe=base / "probe.log")


def _tables_module() -> None:
    """The application's table definitions, importable in this test process under another name
    (``wakeapp`` itself must only be importable from the application's folder)."""
    if "wakeapp_tables" in sys.modules:
        return
    import importlib.util

    spec = importlib.util.spec_from_file_location("wakeapp_tables", HERE / "wakeapp" / "tables.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["wakeapp_tables"] = module
    spec.loader.exec_module(module)


@dataclass
class Host:
    """``apsup run --app wakeapp.families`` started from the application's folder."""

    app: App
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Host:
        self.log = self.app.root / f"host-{time.monotonic_ns()}.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [APSUP, "run", "--app", "wakeapp.families", *self.args],
                cwd=self.app.root,
                env=self.app.env(**self.env),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_ready(self) -> Host:
        deadline = time.monotonic() + LIMIT
        while '"startup"' not in self.output():
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"host exited {self.proc.returncode}:\n{self.output()}")
            assert time.monotonic() < deadline, f"host not ready:\n{self.output()}"
            time.sleep(0.05)
        return self

    def activity(self, after: float = 0.0) -> list[tuple[float, str]]:
        """The host process's transaction starts and statements after ``after`` (wall clock)."""
        try:
            text = self.app.probe.read_text()
        except FileNotFoundError:
            return []
        out: list[tuple[float, str]] = []
        mine = str(self.pid)
        for line in text.splitlines():
            parts = line.split(" ", 2)
            if len(parts) == 3 and parts[0] == mine and float(parts[1]) > after:
                out.append((float(parts[1]), parts[2]))
        return out

    def wait_quiet(self, quiet: float = 2.0) -> None:
        """Until the host made no statement for ``quiet`` seconds."""
        deadline = time.monotonic() + LIMIT
        while time.monotonic() < deadline:
            now = time.time()
            if not self.activity(after=now - quiet):
                return
            time.sleep(0.2)
        raise AssertionError("the host never became idle")

    def cpu_seconds(self) -> float:
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self, sig: int = signal.SIGTERM) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=LIMIT)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def run_cli(app: App, *args: str, env: dict[str, str] | None = None) -> Any:
    return subprocess.run(
        [APSUP, *args],
        cwd=app.root,
        env=app.env(**(env or {})),
        capture_output=True,
        text=True,
        timeout=LIMIT,
    )
