"""The application's own table: one row per invocation, with its start time (``time.time()``)."""

from __future__ import annotations

from sqlalchemy import Column, Double, Integer, MetaData, String, Table

metadata = MetaData()
runs = Table(
    "wake_runs",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("family", String(64), nullable=False),
    Column("scope_id", String(255), nullable=False),
    Column("started", Double, nullable=False),
    Column("pid", Integer, nullable=False),
)
