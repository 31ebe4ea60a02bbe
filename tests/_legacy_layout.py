"""Databases made by the earlier migration layout, for the upgrade-in-place tests.

Until the ``apsup_*`` layout, apsup's revisions were bare ``0001``..``0004`` in one history
recorded in Alembic's default ``alembic_version``. These helpers run *those very files*, taken
from the repository's history at ``LEGACY_COMMIT`` (the last commit with that layout), so the
database under test is made by the old code, not by an imitation of it.

Also: a minimal application Alembic environment with its own history, as a user's app has.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import create_engine

REPO = Path(__file__).resolve().parents[1]
LEGACY_COMMIT = "8a0a6a43bfed7bf3078907c2c96d00aa24ce9230"
LEGACY_FILES = (
    "migrations/env.py",
    "migrations/script.py.mako",
    "migrations/versions/0001_framework_tables.py",
    "migrations/versions/0002_family_domain_tables.py",
    "migrations/versions/0003_topic_memory_legacy_upgrade.py",
    "migrations/versions/0004_profile_from_apscheduler.py",
)


def legacy_script_location(where: Path) -> Path:
    """The earlier layout's ``migrations/`` folder, restored from git under ``where``."""
    root = where / "legacy_migrations"
    if root.exists():
        return root
    for name in LEGACY_FILES:
        shown = subprocess.run(
            ["git", "-C", str(REPO), "show", f"{LEGACY_COMMIT}:{name}"],
            check=True,
            capture_output=True,
        )
        target = root / Path(name).relative_to("migrations")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(shown.stdout)
    return root


def make_legacy_database(url: str, revision: str, where: Path) -> None:
    """Migrate ``url`` with the earlier layout's own files up to bare ``revision``."""
    cfg = Config()
    cfg.set_main_option("script_location", str(legacy_script_location(where)))
    engine = create_engine(url)
    try:
        with engine.begin() as conn:
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, revision)
    finally:
        engine.dispose()


APP_ENV = """
from alembic import context
from sqlalchemy import create_engine

config = context.config
engine = create_engine(config.get_main_option("sqlalchemy.url"))
with engine.begin() as connection:
    context.configure(connection=connection)
    with context.begin_transaction():
        context.run_migrations()
engine.dispose()
"""

APP_REVISION = """
import sqlalchemy as sa
from alembic import op

revision = {revision!r}
down_revision = {down!r}
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        {table!r},
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("name", sa.String(64), nullable=False),
    )


def downgrade() -> None:
    op.drop_table({table!r})
"""

#: The app's own history deliberately uses bare ids that collide with the earlier apsup layout.
APP_REVISIONS = (("0001", None, "app_orders"), ("0002", "0001", "app_customers"))


def app_alembic(where: Path, url: str, *extra_version_locations: str) -> Config:
    """An application's own Alembic environment (default ``alembic_version``), optionally
    including more version locations (apsup's, for the embedded-history variant)."""
    root = where / "app_alembic"
    versions = root / "versions"
    versions.mkdir(parents=True, exist_ok=True)
    (root / "env.py").write_text(APP_ENV)
    for revision, down, table in APP_REVISIONS:
        (versions / f"{revision}_{table}.py").write_text(
            APP_REVISION.format(revision=revision, down=down, table=table)
        )
    cfg = Config()
    cfg.set_main_option("script_location", str(root))
    cfg.set_main_option("path_separator", "os")
    import os

    cfg.set_main_option(
        "version_locations", os.pathsep.join([str(versions), *extra_version_locations])
    )
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg
