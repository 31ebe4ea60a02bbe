"""apsup's Alembic revisions, kept apart from the application's own.

Two branches, one directory each, recorded in their own version table
(``apsup_alembic_version``) so that an application's ``alembic_version`` is never touched:

- ``apsup`` (``versions/``): the framework tables every deployment needs.
- ``apsup_families`` (``families/``): the reference families' domain tables (``topic_*``,
  ``experience_*``, ``profile_*``, ``handoff_*``) and their legacy upgrades; created only when
  asked for (``apsup migrate --with-reference-families``).

Adding a revision
-----------------
- File ``<branch dir>/NNNN_what_it_does.py`` with ``revision = "apsup_NNNN"``: the next free
  number across both branches (ids are global: ``apsup_0005`` may live in either directory).
- ``down_revision``: the current head of *its own* branch (``apsup_0001`` for the framework
  today, ``apsup_0004`` for the families); ``branch_labels = None``. A families revision that
  needs a newer framework table adds ``depends_on = "apsup_NNNN"``.
- A change to framework tables goes on ``apsup``; a change to family tables goes on
  ``apsup_families`` (a change touching both is two revisions, one per branch).
- Never import application code; ``apsup run`` refuses a database behind or ahead of the newest
  revision of each branch it uses, so shipping a revision means shipping ``apsup migrate``.
- Databases made before this layout (bare ``0001``..``0004`` in ``alembic_version``) are moved
  by ``apsup.store.revision.LEGACY_REVISIONS``; a new revision needs no entry there.

Using the revisions from your own Alembic environment: see ``version_locations``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: Alembic version table that ``apsup migrate`` records apsup's revisions in.
VERSION_TABLE = "apsup_alembic_version"
#: Branch label of the framework revisions (``apsup@head``).
FRAMEWORK_BRANCH = "apsup"
#: Branch label of the reference families' revisions (``apsup_families@head``).
FAMILIES_BRANCH = "apsup_families"

_HERE = Path(__file__).resolve().parent

#: Tables of the ``apsup`` branch, and the version table of ``apsup migrate``.
FRAMEWORK_TABLES = frozenset(
    {
        "pc_artifact_processing_intents",
        "pc_artifact_processing_counters",
        "pc_artifact_processing_binding_states",
        "pc_artifact_processing_leases",
        VERSION_TABLE,
    }
)
#: Tables of the ``apsup_families`` branch (revision apsup_0002; a test keeps this in step).
FAMILY_TABLES = frozenset(
    {
        "topic_sources", "topic_cursors", "topic_revisions", "topic_poison",
        "experience_items", "experience_progress", "experience_records",
        "profile_sources", "profile_cursors", "profile_policies", "profile_candidates",
        "profile_published", "profile_access",
        "handoff_requests", "handoff_reports", "handoff_access",
    }
)  # fmt: skip


def version_locations(*, reference_families: bool = False) -> list[str]:
    """Directories holding apsup's revisions, for an application's own Alembic environment.

    ``Config.set_main_option("version_locations", os.pathsep.join(yours + version_locations()))``
    (or, in ``alembic.ini`` with ``path_separator = space``, the package form
    ``apsup.migrations:versions``). Then ``alembic upgrade heads`` applies the application's
    revisions and apsup's framework branch, recorded in the application's ``alembic_version``.
    """
    dirs = [_HERE / "versions"]
    if reference_families:
        dirs.append(_HERE / "families")
    return [str(d) for d in dirs]


def include_name(name: str | None, type_: str, parent_names: Any = None) -> bool:
    """Alembic ``include_name`` hook: hide apsup's tables from the application's autogenerate
    (otherwise ``alembic revision --autogenerate`` proposes to drop them)."""
    if type_ != "table" or name is None:
        return True
    return name not in FRAMEWORK_TABLES and name not in FAMILY_TABLES


__all__ = [
    "FAMILIES_BRANCH",
    "FAMILY_TABLES",
    "FRAMEWORK_BRANCH",
    "FRAMEWORK_TABLES",
    "VERSION_TABLE",
    "include_name",
    "version_locations",
]
