"""Alembic environment of ``apsup migrate``: runs on the connection apsup hands over, offline
(``apsup migrate --sql``) on ``sqlalchemy.url``'s dialect, or on ``sqlalchemy.url`` when invoked
through the alembic CLI. apsup's revisions are recorded in ``apsup_alembic_version`` so that the
application's own ``alembic_version`` (and history) stays its own."""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine

from apsup.migrations import VERSION_TABLE
from apsup.store.schema import metadata

config = context.config
target_metadata = metadata
version_table = config.attributes.get("version_table", VERSION_TABLE)


def run() -> None:
    if context.is_offline_mode():
        context.configure(
            url=config.get_main_option("sqlalchemy.url"),
            target_metadata=target_metadata,
            literal_binds=True,
            version_table=version_table,
        )
        with context.begin_transaction():
            context.run_migrations()
        return
    conn = config.attributes.get("connection")
    if conn is not None:
        context.configure(
            connection=conn, target_metadata=target_metadata, version_table=version_table
        )
        with context.begin_transaction():
            context.run_migrations()
        return
    engine = create_engine(config.get_main_option("sqlalchemy.url") or "")
    with engine.begin() as connection:
        context.configure(
            connection=connection, target_metadata=target_metadata, version_table=version_table
        )
        with context.begin_transaction():
            context.run_migrations()


run()
