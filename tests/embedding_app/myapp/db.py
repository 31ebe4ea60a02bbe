"""The application's own engine and tables."""

import os

from sqlalchemy import Column, Float, Integer, MetaData, String, Table, create_engine

DATABASE_URL = os.environ["MYAPP_DATABASE_URL"]

metadata = MetaData()
invoices = Table(
    "invoices",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("customer", String(64), nullable=False),
)
runs = Table(
    "myapp_runs",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("family", String(64), nullable=False),
    Column("scope_id", String(64), nullable=False),
    Column("started", Float, nullable=False),
    Column("pid", Integer, nullable=False),
)


def engine():
    return create_engine(DATABASE_URL)
