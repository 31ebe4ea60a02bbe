"""Alembic environment: runs on the connection apsup hands over (``apsup migrate``), or on
``sqlalchemy.url`` when invoked through the alembic CLI."""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine

from apsup.store.schema import metadata

config = context.config
target_metadata = metadata


def run() -> None:
    conn = config.attributes.get("connection")
    if conn is not None:
        context.configure(connection=conn, target_metadata=target_metadata)
        with context.begin_transaction():
            context.run_migrations()
        return
    engine = create_engine(config.get_main_option("sqlalchemy.url") or "")
    with engine.begin() as connection:
        context.configure(connection=connection, target_metadata=target_metadata)
        with context.begin_transaction():
            context.run_migrations()


run()
