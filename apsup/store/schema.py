"""SQLAlchemy Core tables of the framework (RFC §3, §4, §8; DESIGN §3).

Alembic (``migrations/``) creates them; this module is the reference that a test diffs the
migrated database against. Discovery of ``dirty > clean`` and ``requested > handled`` is
index-backed through two stored generated flag columns, so a page query never scans the table.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    Computed,
    DateTime,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    text,
)
from sqlalchemy.dialects import mysql

metadata = MetaData()

#: Microsecond precision on MySQL/OceanBase (plain DATETIME truncates to seconds there).
Timestamp = DateTime().with_variant(mysql.DATETIME(fsp=6), "mysql")

BINDING_LENGTH = 128
SCOPE_LENGTH = 255

intents = Table(
    "pc_artifact_processing_intents",
    metadata,
    Column("binding_name", String(BINDING_LENGTH), primary_key=True),
    Column("scope_id", String(SCOPE_LENGTH), primary_key=True),
    Column("pending_sequence", BigInteger, nullable=False, unique=True),
    Column("dirty_generation", BigInteger, nullable=False, server_default=text("0")),
    Column("clean_generation", BigInteger, nullable=False, server_default=text("0")),
    Column("requested_generation", BigInteger, nullable=False, server_default=text("0")),
    Column("handled_generation", BigInteger, nullable=False, server_default=text("0")),
    Column("last_auto_scan_generation", BigInteger, nullable=False, server_default=text("0")),
    Column(
        "dirty_pending",
        Integer,
        Computed("CASE WHEN dirty_generation > clean_generation THEN 1 ELSE 0 END", persisted=True),
    ),
    Column(
        "request_pending",
        Integer,
        Computed(
            "CASE WHEN requested_generation > handled_generation THEN 1 ELSE 0 END",
            persisted=True,
        ),
    ),
    CheckConstraint(
        "clean_generation >= 0 AND clean_generation <= dirty_generation",
        name="ck_intents_clean_le_dirty",
    ),
    CheckConstraint(
        "handled_generation >= 0 AND handled_generation <= requested_generation",
        name="ck_intents_handled_le_requested",
    ),
    Index("ix_intents_dirty", "binding_name", "dirty_pending", "pending_sequence"),
    Index("ix_intents_request", "binding_name", "request_pending", "pending_sequence"),
)

#: Monotonic counters that must never be reused (pending_sequence survives row deletion).
counters = Table(
    "pc_artifact_processing_counters",
    metadata,
    Column("name", String(64), primary_key=True),
    Column("value", BigInteger, nullable=False, server_default=text("0")),
)

binding_states = Table(
    "pc_artifact_processing_binding_states",
    metadata,
    Column("binding_name", String(BINDING_LENGTH), primary_key=True),
    Column("last_schedule_checkpoint_at", Timestamp, nullable=True),
    Column("scan_generation", BigInteger, nullable=False, server_default=text("0")),
    Column("scan_in_progress", Boolean, nullable=False, server_default=text("0")),
    Column("scan_upper_pending_sequence", BigInteger, nullable=True),
)

leases = Table(
    "pc_artifact_processing_leases",
    metadata,
    Column("supervisor_key", String(160), primary_key=True),
    Column("holder_id", String(64), nullable=False),
    Column("supervisor_generation", BigInteger, nullable=False, server_default=text("0")),
    Column("expires_at", Timestamp, nullable=True),
)

PENDING_SEQUENCE_COUNTER = "pending_sequence"
