"""Packaging: the wheel installs only the ``apsup`` namespace (workers/, families/ and
migrations/ mapped under it, DESIGN §1) and carries the Alembic versions ``apsup migrate`` needs."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_maps_folders_under_the_apsup_namespace(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(ROOT)],
        check=True,
        capture_output=True,
        cwd=tmp_path,
    )
    (wheel,) = tmp_path.glob("apsup-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/", 1)[0] for n in names}
    assert tops == {"apsup", next(t for t in tops if t.endswith(".dist-info"))}
    for required in (
        "apsup/workers/pool.py",
        "apsup/workers/invoke.py",
        "apsup/families/topic_memory.py",
        "apsup/migrations/env.py",
        "apsup/migrations/script.py.mako",
        "apsup/migrations/versions/0001_framework_tables.py",
        "apsup/migrations/families/0002_family_domain_tables.py",
        "apsup/migrations/families/0004_profile_from_apscheduler.py",
        "apsup/py.typed",
    ):
        assert required in names, required
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "apsup = apsup.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()

    # Metadata a package index shows; MySQL drivers only with the `mysql` extra.
    meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
    text = zipfile.ZipFile(wheel).read(meta).decode()
    assert "Classifier: Typing :: Typed" in text and "Classifier: License ::" in text
    assert "License: Proprietary" in text or "License-Expression:" in text
    requires = [ln for ln in text.splitlines() if ln.startswith("Requires-Dist:")]
    drivers = [ln for ln in requires if ln.split()[1].lower().startswith(("pymysql", "aiomysql"))]
    assert drivers and all('extra == "mysql"' in ln or 'extra == "test"' in ln for ln in drivers)
    assert any(ln.startswith("Requires-Dist: SQLAlchemy") and "extra" not in ln for ln in requires)


def test_a_mysql_url_without_the_driver_names_the_extra(tmp_path: Path) -> None:
    """The SQLite path needs no MySQL driver; a mysql URL without one says what to install."""
    import os

    code = (
        "import sys; sys.modules['pymysql'] = None\n"
        "from apsup.cli import main\n"
        "sys.exit(main(['migrate', '--db', 'mysql+pymysql://u@127.0.0.1:1/x']))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ)
    )
    assert out.returncode == 2, out.stderr
    assert "apsup[mysql]" in out.stderr and "Traceback" not in out.stderr
