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
