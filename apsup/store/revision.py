"""apsup's schema revision: migrate (``apsup migrate``) and check (``apsup run``).

apsup's Alembic revisions (``apsup.migrations``) form two branches, ``apsup`` (framework) and
``apsup_families`` (reference families, only on request), recorded in ``apsup_alembic_version``
so that the application's own ``alembic_version`` and history stay untouched. An application may
instead include the revisions in its own environment; its ``alembic_version`` then holds the
``apsup_*`` rows and the check reads them there.

Databases made by the earlier layout (bare ``0001``..``0004`` in ``alembic_version``) are moved
to the new version table by ``migrate`` before it upgrades (``LEGACY_REVISIONS``).
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import sqlalchemy as sa

from apsup.errors import SchemaRevisionError as SchemaRevisionError
from apsup.migrations import FAMILIES_BRANCH, FRAMEWORK_BRANCH, VERSION_TABLE, version_locations

if TYPE_CHECKING:
    from alembic.config import Config
    from alembic.script import ScriptDirectory

#: Revision ids of the earlier layout (one Alembic history in ``alembic_version``) and the
#: ``apsup_*`` revision each stands for. Only these four ever existed in that layout.
LEGACY_REVISIONS = {
    "0001": "apsup_0001",
    "0002": "apsup_0002",
    "0003": "apsup_0003",
    "0004": "apsup_0004",
}
APP_VERSION_TABLE = "alembic_version"
_INTENTS = "pc_artifact_processing_intents"


@dataclass(frozen=True)
class DatabaseRevision:
    """Where and what apsup's revisions are recorded in one database."""

    table: str | None  # VERSION_TABLE, APP_VERSION_TABLE (own Alembic env), or None
    revisions: frozenset[str]
    legacy: frozenset[str] = frozenset()  # bare ids of the earlier layout in alembic_version

    def describe(self) -> str:
        revs = sorted(self.revisions or self.legacy)
        return ", ".join(revs) if revs else "no apsup revision"


def migrations_dir() -> Path:
    import apsup.migrations

    return Path(apsup.migrations.__file__).resolve().parent


def alembic_config(url: str | None = None) -> Config:
    """An Alembic Config for apsup's own environment, knowing both branches' revisions."""
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(migrations_dir()))
    cfg.set_main_option("path_separator", "os")
    cfg.set_main_option(
        "version_locations", os.pathsep.join(version_locations(reference_families=True))
    )
    if url is not None:
        cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def script_directory() -> ScriptDirectory:
    import logging

    from alembic.script import ScriptDirectory

    # Alembic announces each of its plugins at INFO: noise in `apsup run`'s startup log.
    logging.getLogger("alembic.runtime.plugins").setLevel(logging.WARNING)

    return ScriptDirectory.from_config(alembic_config())


def branch_head(script: ScriptDirectory, branch: str) -> str:
    head = script.get_revision(f"{branch}@head")
    assert head is not None
    return str(head.revision)


def _tables(conn: sa.Connection) -> set[str]:
    return {t.lower() for t in sa.inspect(conn).get_table_names()}


def _versions(conn: sa.Connection, table: str) -> set[str]:
    rows = conn.execute(sa.text(f"SELECT version_num FROM {table}")).all()
    return {str(r[0]) for r in rows}


def read(conn: sa.Connection) -> DatabaseRevision:
    """The apsup revisions recorded in the database ``conn`` is on."""
    tables = _tables(conn)
    if VERSION_TABLE in tables:
        found = _versions(conn, VERSION_TABLE)
        if found:
            return DatabaseRevision(VERSION_TABLE, frozenset(found))
    if APP_VERSION_TABLE in tables:
        found = _versions(conn, APP_VERSION_TABLE)
        ours = {r for r in found if r.startswith("apsup_")}
        if ours:
            return DatabaseRevision(APP_VERSION_TABLE, frozenset(ours))
        legacy = found & set(LEGACY_REVISIONS)
        if legacy and _INTENTS in tables:  # apsup's tables exist: these bare ids are ours
            return DatabaseRevision(None, frozenset(), frozenset(legacy))
    return DatabaseRevision(None, frozenset())


def _applied(script: ScriptDirectory, revisions: Iterable[str]) -> set[str]:
    """Every revision implied by ``revisions`` (ancestors and dependencies included)."""
    out: set[str] = set()
    todo = list(revisions)
    while todo:
        rev = todo.pop()
        if rev in out:
            continue
        out.add(rev)
        script_rev = script.get_revision(rev)
        assert script_rev is not None
        todo.extend(script_rev._all_down_revisions)
    return out


def _families_applied(script: ScriptDirectory, applied: set[str]) -> bool:
    """Whether the reference families' branch was migrated (its first revision is applied)."""
    return any(
        FAMILIES_BRANCH in (rev.branch_labels or ())
        for rev in (script.get_revision(r) for r in applied)
        if rev is not None
    )


def _unknown(script: ScriptDirectory, revisions: Iterable[str]) -> list[str]:
    from alembic.util import CommandError

    unknown = []
    for rev in sorted(revisions):
        try:
            if script.get_revision(rev) is None:
                unknown.append(rev)
        except CommandError:
            unknown.append(rev)
    return unknown


def check(conn: sa.Connection, *, reference_families: bool = False) -> None:
    """Raise ``SchemaRevisionError`` unless the database is at the newest revision of the
    framework branch (and of the families branch, when it was migrated or when
    ``reference_families`` says the registered families need its tables): code and schema that
    disagree make processors and reconcilers fail forever instead of failing once, here."""
    state = read(conn)
    if state.legacy:
        raise SchemaRevisionError(
            f"the database's apsup schema uses the earlier layout (revision "
            f"{state.describe()} in alembic_version): run `apsup migrate` (during maintenance)"
        )
    if not state.revisions:
        raise SchemaRevisionError(
            "the database records no apsup schema revision: run `apsup migrate` "
            "(during maintenance) before starting"
        )
    script = script_directory()
    unknown = _unknown(script, state.revisions)
    if unknown:
        raise SchemaRevisionError(
            f"the database is at apsup schema revision {', '.join(unknown)}, ahead of this "
            "code (`apsup migrate` of a newer apsup ran on it): run that apsup version or newer"
        )
    applied = _applied(script, state.revisions)
    expected = [branch_head(script, FRAMEWORK_BRANCH)]
    if _families_applied(script, applied):
        expected.append(branch_head(script, FAMILIES_BRANCH))
    elif reference_families:
        raise SchemaRevisionError(
            "the reference families' tables are missing (apsup's families branch was never "
            "migrated): run `apsup migrate --with-reference-families` during maintenance, then "
            "start again"
        )
    missing = [rev for rev in expected if rev not in applied]
    if missing:
        how = "`apsup migrate`"
        if state.table == APP_VERSION_TABLE:
            how = "your own `alembic upgrade heads` (apsup's revisions are in your history)"
        raise SchemaRevisionError(
            f"the database's apsup schema is behind this code (at {state.describe()}, "
            f"needs {', '.join(missing)}): run {how} during maintenance, then start again"
        )


def _adopt_legacy(conn: sa.Connection, cfg: Config) -> None:
    """Move an earlier-layout database (bare ids in ``alembic_version``) to ``VERSION_TABLE``,
    leaving ``alembic_version`` to the application (dropped when nothing else is in it)."""
    from alembic import command

    state = read(conn)
    if not state.legacy:
        return
    command.stamp(cfg, sorted(LEGACY_REVISIONS[r] for r in state.legacy))
    placeholders = ", ".join(f":r{i}" for i in range(len(state.legacy)))
    conn.execute(
        sa.text(f"DELETE FROM {APP_VERSION_TABLE} WHERE version_num IN ({placeholders})"),
        {f"r{i}": r for i, r in enumerate(sorted(state.legacy))},
    )
    if not _versions(conn, APP_VERSION_TABLE):
        conn.execute(sa.text(f"DROP TABLE {APP_VERSION_TABLE}"))


@contextlib.contextmanager
def _revision_errors() -> Iterator[None]:
    """Alembic's revision errors as one-line ConfigErrors (exit 2), never a traceback."""
    from alembic.script.revision import RevisionError
    from alembic.util import CommandError

    try:
        yield
    except (CommandError, RevisionError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise SchemaRevisionError(
            f"{first} (apsup's revisions are apsup_0001.. in {VERSION_TABLE}; "
            "`apsup migrate` without --revision upgrades to the newest)"
        ) from None


def targets(revision: str | None, *, reference_families: bool, families_present: bool) -> list[str]:
    """The Alembic upgrade targets of one ``apsup migrate``."""
    if revision is not None:
        return [revision]
    out = [f"{FRAMEWORK_BRANCH}@head"]
    if reference_families or families_present:
        out.append(f"{FAMILIES_BRANCH}@head")
    return out


def migrate(
    url: str,
    revision: str | None = None,
    *,
    reference_families: bool = False,
    sql: bool = False,
    output: TextIO | None = None,
) -> None:
    """Upgrade apsup's schema on ``url``: the framework branch, and the reference families'
    branch when asked for or already present; ``revision`` picks one target instead.

    ``sql=True`` writes the DDL for a new database to ``output`` (stdout) without connecting.
    """
    from alembic import command

    cfg = alembic_config(url)
    cfg.attributes["version_table"] = VERSION_TABLE
    if revision is not None and ":" not in revision:
        with _revision_errors():  # an unknown target fails before anything is created
            script_directory().get_revisions(revision)
    if sql:
        cfg.output_buffer = output if output is not None else _stdout()
        target = revision or ("heads" if reference_families else f"{FRAMEWORK_BRANCH}@head")
        with _revision_errors():
            command.upgrade(cfg, target, sql=True)
        return

    from apsup.store.backends import open_backend

    backend = open_backend(url, create=True)
    try:
        with backend.engine.begin() as conn, _revision_errors():
            cfg.attributes["connection"] = conn
            _adopt_legacy(conn, cfg)
            state = read(conn)
            if state.table == APP_VERSION_TABLE:
                raise SchemaRevisionError(
                    f"apsup's revisions ({state.describe()}) are in this database's "
                    "alembic_version: they are part of your own Alembic history, so upgrade with "
                    "your `alembic upgrade heads`, not `apsup migrate`"
                )
            script = script_directory()
            unknown = _unknown(script, state.revisions)
            if unknown:
                raise SchemaRevisionError(
                    f"{VERSION_TABLE} holds revision {', '.join(unknown)}, which this apsup "
                    "does not know (migrated by a newer apsup?): migrate with that apsup"
                )
            present = _families_applied(script, _applied(script, state.revisions))
            for target in targets(
                revision, reference_families=reference_families, families_present=present
            ):
                command.upgrade(cfg, target)
    finally:
        backend.dispose()


def _stdout() -> Any:
    import sys

    return sys.stdout if sys.stdout is not None else io.StringIO()
