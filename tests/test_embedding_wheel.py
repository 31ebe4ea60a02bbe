"""apsup as a user gets it: the built wheel, installed into a fresh virtual environment, used by
an application with its own package, tables and Alembic history (``tests/embedding_app``).

1. Build the wheel from a clean copy of the sources; install it (no dependencies, no index)
   into a new venv that borrows the already installed dependencies through a ``.pth`` file, so
   the test works offline; ``apsup`` must then come from the wheel.
2. Migrate the application's history (bare ids ``0001``/``0002`` in ``alembic_version``) and
   apsup's (``apsup migrate``), in both orders, on two databases.
3. From the application's folder, ``apsup run --app myapp.digests``: ``mark_dirty`` committed by
   a separate process on the application's own engine is handled within 2 s (the family checks
   every second).
4. ``apsup run --app myapp.families`` (automatic admission disabled): a ``request()`` committed
   by a separate process is handled within 2 s with no further call, and the idle host then
   runs no database statement for 10 s.
"""

from __future__ import annotations

import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import sysconfig
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from apsup.migrations import FRAMEWORK_BRANCH
from apsup.store.revision import branch_head, script_directory

ROOT = Path(__file__).resolve().parents[1]
APP = Path(__file__).resolve().parent / "embedding_app"
PREFIX = "POWERCONTEXT_SERVER_RUNTIME_"
FRAMEWORK_HEAD = branch_head(script_directory(), FRAMEWORK_BRANCH)
HANDLED_WITHIN = 2.0
IDLE_FOR = 10.0

pytestmark = [pytest.mark.timeout(240), pytest.mark.backends("sqlite")]


class NotHandledInTime(AssertionError):
    """A published intent was not handled within ``HANDLED_WITHIN`` seconds."""


def run(*args: str | Path, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(
        [str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, f"{args}:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}"
    return out


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A new venv with apsup installed from the wheel built from this checkout."""
    work = tmp_path_factory.mktemp("wheel")
    src = work / "src"
    shutil.copytree(
        ROOT,
        src,
        ignore=shutil.ignore_patterns(
            ".git", ".venv", "build", "dist", "var", "*.egg-info", "__pycache__", ".*_cache"
        ),
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # (conftest adds the repo)
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", work, src, cwd=work, env=env)
    (wheel,) = work.glob("apsup-*.whl")
    venv = work / "venv"
    run(sys.executable, "-m", "venv", "--without-pip", venv, cwd=work, env=env)
    python = venv / "bin" / "python"
    purelib = run(
        python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=work, env=env
    ).stdout.strip()
    # Dependencies come from this environment's site-packages, appended *after* the venv's own
    # (a plain path line: that directory's .pth files, e.g. the editable apsup, are not run).
    Path(purelib, "borrowed-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    run(
        sys.executable,
        "-m",
        "pip",
        "--python",
        python,
        "install",
        "-q",
        "--no-deps",
        "--no-index",
        "--ignore-installed",
        wheel,
        cwd=work,
        env=env,
    )
    where = run(python, "-c", "import apsup; print(apsup.__file__)", cwd=work, env=env)
    assert where.stdout.strip().startswith(purelib), where.stdout
    assert (venv / "bin" / "apsup").exists()
    return venv


class App:
    def __init__(self, root: Path, venv: Path, name: str) -> None:
        self.root = root
        self.bin = venv / "bin"
        self.db = root / f"{name}.db"
        self.url = f"sqlite:///{self.db}"
        self.probe = root / f"{name}.probe"

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(PREFIX)}
        env.pop("PYTHONPATH", None)  # the app is importable from its own folder only
        env["MYAPP_DATABASE_URL"] = self.url
        env[PREFIX + "DATABASE_URL"] = self.url
        return env

    def alembic_upgrade(self) -> None:
        run(self.bin / "python", "-m", "alembic", "upgrade", "head", cwd=self.root, env=self.env())

    def apsup_migrate(self) -> None:
        run(self.bin / "apsup", "migrate", cwd=self.root, env=self.env())

    def versions(self, table: str) -> set[str]:
        with sqlite3.connect(self.db) as conn:
            return {r[0] for r in conn.execute(f"SELECT version_num FROM {table}")}

    def publish(self, action: str, scope: str) -> float:
        out = run(self.bin / "python", "publish.py", action, scope, cwd=self.root, env=self.env())
        return float(out.stdout.split()[0])

    def wait_handled(self, family: str, scope: str, committed: float) -> float:
        deadline = committed + HANDLED_WITHIN
        while time.time() < deadline:
            with sqlite3.connect(self.db) as conn:
                row = conn.execute(
                    "SELECT started FROM myapp_runs WHERE family = ? AND scope_id = ?",
                    (family, scope),
                ).fetchone()
            if row is not None:
                return time.time() - committed
            time.sleep(0.05)
        raise NotHandledInTime(f"{family} {scope!r} not handled {HANDLED_WITHIN} s after commit")

    @contextmanager
    def host(self, module: str) -> Iterator[subprocess.Popen[str]]:
        env = self.env()
        env["MYAPP_PROBE"] = str(self.probe)
        env[PREFIX + "LOG_FORMAT"] = "json"
        log = (self.root / f"host-{module}.log").open("w")
        proc = subprocess.Popen(
            [str(self.bin / "apsup"), "run", "--app", module],
            cwd=self.root,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            yield proc
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            log.close()

    def host_log(self, module: str) -> str:
        path = self.root / f"host-{module}.log"
        return path.read_text()[-3000:] if path.exists() else ""

    def statements(self, pid: int, since: float) -> list[str]:
        if not self.probe.exists():
            return []
        lines = [ln.split() for ln in self.probe.read_text().splitlines()]
        return [" ".join(p) for p in lines if int(p[0]) == pid and float(p[1]) >= since]

    def wait_started(self, proc: subprocess.Popen[str], module: str, *, quiet: bool) -> None:
        """Until the host logged its startup (term established, recovery done) and, if
        ``quiet``, has run no statement for a second: a request published before that would be
        found by recovery, not by a wake-up."""
        deadline = time.time() + 90
        while time.time() < deadline:
            assert proc.poll() is None, self.host_log(module)
            started = '"event":"startup"' in self.host_log(module)
            mine = self.statements(proc.pid, 0)
            if started and (not quiet or (mine and time.time() - float(mine[-1].split()[1]) > 1)):
                return
            time.sleep(0.1)
        raise AssertionError(f"host did not settle: {self.host_log(module)}")


def make_app(tmp_path: Path, venv: Path, name: str) -> App:
    root = tmp_path / "myapp-project"
    if not root.exists():
        shutil.copytree(APP, root, ignore=shutil.ignore_patterns("__pycache__", "README.txt"))
    return App(root, venv, name)


def test_the_wheel_embedded_in_an_application(tmp_path: Path, venv: Path) -> None:
    # Both histories on one database, in either order.
    first = make_app(tmp_path, venv, "app_first")
    first.alembic_upgrade()
    first.apsup_migrate()
    second = make_app(tmp_path, venv, "apsup_first")
    second.apsup_migrate()
    second.alembic_upgrade()
    for app in (first, second):
        assert app.versions("alembic_version") == {"0002"}
        assert app.versions("apsup_alembic_version") == {FRAMEWORK_HEAD}

    # An interval family: a dirty mark from another process is handled by its next check.
    with second.host("myapp.digests") as proc:
        second.wait_started(proc, "myapp.digests", quiet=False)  # it checks every second
        committed = second.publish("mark_dirty", "weekly")
        took = second.wait_handled("digest", "weekly", committed)
        print(f"\n[mark_dirty, interval 1 s] handled {took * 1000:.0f} ms after the commit")

    # Automatic admission disabled: only the commit's wake-up can get this request handled.
    with first.host("myapp.families") as proc:
        first.wait_started(proc, "myapp.families", quiet=True)
        committed = first.publish("request", "invoice-1")
        try:
            took = first.wait_handled("report", "invoice-1", committed)
        except NotHandledInTime:
            raise AssertionError(first.host_log("myapp.families")) from None
        print(f"\n[request, admission disabled] handled {took * 1000:.0f} ms after the commit")
        time.sleep(1.0)  # the Worker's exit and its bookkeeping
        quiet_from = time.time()
        time.sleep(IDLE_FOR)
        assert proc.poll() is None, first.host_log("myapp.families")
        assert first.statements(proc.pid, quiet_from) == []
