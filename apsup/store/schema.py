"""SQLAlchemy Core tables of the framework (RFC §3, §4, §8; DESIGN §3).

Alembic (``migrations/``) creates them; this module is the reference that a test diffs the
migrated database against. Discovery of ``dirty > clean`` and ``requested > handled`` is
index-backed through two stored generated flag columns, so a page query never scans the table.
"""

from __future__ import annotations

from typing import Any

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
    TypeDecorator,
    false,
    text,
)
from sqlalchemy.dialects import mysql
from sqlalchemy.engine import Dialect
from sqlalchemy.types import TypeEngine

from apsup.store.compat import aiomysql_bytes

metadata = MetaData()

#: Microsecond precision on MySQL/OceanBase (plain DATETIME truncates to seconds there).
Timestamp = DateTime().with_variant(mysql.DATETIME(fsp=6), "mysql")

BINDING_LENGTH = 128
SCOPE_LENGTH = 255
LEASE_KEY_LENGTH = 160


class Identifier(TypeDecorator[str]):
    """Text that compares byte for byte on every backend (Scope ids, binding names, lease keys).

    MySQL/OceanBase text collations are either case-insensitive (the ``utf8mb4_general_ci``
    default, under which ``CaseX`` and ``casex`` are one primary key) or pad trailing spaces
    (``utf8mb4_bin``: ``'a'`` and ``'a '`` are one key on seekdb). Only ``VARBINARY`` compares
    exact bytes there, so identifiers are stored as UTF-8 in ``VARBINARY(4 * length)`` and
    decoded on read; SQLite's default ``BINARY`` collation is byte-exact already.
    """

    impl = String
    cache_ok = True

    def __init__(self, length: int) -> None:
        super().__init__(length)
        self.max_chars = length

    def load_dialect_impl(self, dialect: Dialect) -> TypeEngine[Any]:
        if dialect.name == "mysql":
            return dialect.type_descriptor(mysql.VARBINARY(4 * self.max_chars))
        return dialect.type_descriptor(String(self.max_chars))

    def process_bind_param(self, value: object, dialect: Dialect) -> object:
        if dialect.name == "mysql" and isinstance(value, str):
            if dialect.driver == "aiomysql":
                aiomysql_bytes()
            return value.encode("utf-8")
        return value

    def process_result_value(self, value: object, dialect: Dialect) -> str | None:
        if isinstance(value, bytes | bytearray | memoryview):
            return bytes(value).decode("utf-8")
        return value  # type: ignore[return-value]


intents = Table(
    "pc_artifact_processing_intents",
    metadata,
    Column("binding_name", Identifier(BINDING_LENGTH), primary_key=True),
    Column("scope_id", Identifier(SCOPE_LENGTH), primary_key=True),
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
    Column("binding_name", Identifier(BINDING_LENGTH), primary_key=True),
    Column("last_schedule_checkpoint_at", Timestamp, nullable=True),
    Column("scan_generation", BigInteger, nullable=False, server_default=text("0")),
    Column("scan_in_progress", Boolean, nullable=False, server_default=false()),
    Column("scan_upper_pending_sequence", BigInteger, nullable=True),
)

leases = Table(
    "pc_artifact_processing_leases",
    metadata,
    Column("supervisor_key", Identifier(LEASE_KEY_LENGTH), primary_key=True),
    Column("holder_id", String(64), nullable=False),
    Column("supervisor_generation", BigInteger, nullable=False, server_default=text("0")),
    Column("expires_at", Timestamp, nullable=True),
)

#: Operator and failure state of a Scope (beside the RFC's tables; revision apsup_0007): a row
#: exists while the Scope fails, is parked, or has an operator's retry/stop pending.
scope_states = Table(
    "pc_artifact_processing_scope_states",
    metadata,
    Column("binding_name", Identifier(BINDING_LENGTH), primary_key=True),
    Column("scope_id", Identifier(SCOPE_LENGTH), primary_key=True),
    Column("consecutive_failures", BigInteger, nullable=False, server_default=text("0")),
    Column("last_error_type", String(200), nullable=True),
    Column("last_error", String(400), nullable=True),
    Column("last_failure_at", Timestamp, nullable=True),
    Column("next_attempt_at", Timestamp, nullable=True),
    Column("parked", Boolean, nullable=False, server_default=false()),
    Column("parked_at", Timestamp, nullable=True),
    Column("retry_requested", Boolean, nullable=False, server_default=false()),
    Column("stop_requested", Boolean, nullable=False, server_default=false()),
    Index("ix_scope_states_failing", "binding_name", "consecutive_failures"),
)

#: A family's pause flag, and a version every operator action on the family advances.
family_controls = Table(
    "pc_artifact_processing_family_controls",
    metadata,
    Column("binding_name", Identifier(BINDING_LENGTH), primary_key=True),
    Column("paused", Boolean, nullable=False, server_default=false()),
    Column("paused_at", Timestamp, nullable=True),
    Column("control_version", BigInteger, nullable=False, server_default=text("0")),
)

#: One row per running host process (keyed by its holder id), refreshed four times per Lease
#: in database time; a row older than two Leases belongs to a dead process (``membership``).
replicas = Table(
    "pc_artifact_processing_replicas",
    metadata,
    Column("holder_id", String(64), primary_key=True),
    Column("replica_id", String(64), nullable=False),
    Column("host_name", String(255), nullable=False),
    Column("pid", Integer, nullable=False),
    Column("version", String(64), nullable=False),
    Column("role", String(16), nullable=False),
    Column("mode", String(16), nullable=False),
    Column("http_address", String(300), nullable=True),
    Column("started_at", Timestamp, nullable=False),
    Column("last_seen", Timestamp, nullable=False),
)

#: Invocations per family and minute (succeeded, failed), added by whichever leader saw them
#: (revision apsup_0008): the console's chart of the last hour survives a takeover.
family_minutes = Table(
    "pc_artifact_processing_family_minutes",
    metadata,
    Column("binding_name", Identifier(BINDING_LENGTH), primary_key=True),
    Column("minute", BigInteger, primary_key=True),  # minutes since the epoch, database time
    Column("succeeded", BigInteger, nullable=False, server_default=text("0")),
    Column("failed", BigInteger, nullable=False, server_default=text("0")),
)

PENDING_SEQUENCE_COUNTER = "pending_sequence"
