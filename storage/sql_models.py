"""SQL schema of the chat-session store: sessions, their messages, pins, and the chunk catalog.

The migrations in `kvtierd.migrations` create these tables; this module is the
ORM view of them (and the target of `alembic revision --autogenerate`).
"""

from __future__ import annotations

from datetime import UTC, datetime

import sqlalchemy as sa
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

# Named constraints, so SQLite batch migrations can find and alter them later.
NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

# Mirror the CHECK constraints on messages, so callers can validate before writing.
MESSAGE_ROLES = ("user", "assistant")
MESSAGE_STATUSES = ("complete", "interrupted", "superseded")


class UTCDateTime(sa.TypeDecorator[datetime]):
    """Timezone-aware UTC in, timezone-aware UTC out.

    SQLite stores no offset, so naive values read back are UTC by construction;
    PostgreSQL's timestamptz comes back in the server's zone and is normalised.
    """

    impl = sa.DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given to a UTC column")
        return value.astimezone(UTC)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)


class Base(DeclarativeBase):
    metadata = sa.MetaData(naming_convention=NAMING_CONVENTION)


class SessionRow(Base):
    """A session is its tenant's: (tenant, id) is its identity, so two tenants' frontends may pick the same id."""

    __tablename__ = "sessions"
    # One index serves both "this tenant's sessions" and "most recently used first".
    __table_args__ = (sa.Index("ix_sessions_tenant_last_used_at", "tenant", "last_used_at"),)

    tenant: Mapped[str] = mapped_column(sa.Text, primary_key=True)
    id: Mapped[str] = mapped_column(sa.Text, primary_key=True)
    qos_class: Mapped[str] = mapped_column(sa.Text, default="normal", server_default="normal")
    title: Mapped[str | None] = mapped_column(sa.Text)
    system_prompt: Mapped[str | None] = mapped_column(sa.Text)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    last_used_at: Mapped[datetime] = mapped_column(UTCDateTime)
    token_count: Mapped[int] = mapped_column(sa.Integer, default=0, server_default="0")
    pinned: Mapped[bool] = mapped_column(sa.Boolean, default=False, server_default=sa.false())


class MessageRow(Base):
    __tablename__ = "messages"
    # The unique (tenant, session_id, seq) index also serves lookups and cascades by session.
    __table_args__ = (
        sa.UniqueConstraint("tenant", "session_id", "seq"),
        sa.ForeignKeyConstraint(["tenant", "session_id"], ["sessions.tenant", "sessions.id"], ondelete="CASCADE",
                                name="fk_messages_tenant_sessions"),
        sa.CheckConstraint("role IN ('user', 'assistant')", name="role"),
        sa.CheckConstraint("status IN ('complete', 'interrupted', 'superseded')", name="status"),
    )

    id: Mapped[int] = mapped_column(sa.Integer, primary_key=True, autoincrement=True)
    tenant: Mapped[str] = mapped_column(sa.Text)
    session_id: Mapped[str] = mapped_column(sa.Text)
    seq: Mapped[int] = mapped_column(sa.Integer)
    role: Mapped[str] = mapped_column(sa.Text)
    content: Mapped[str] = mapped_column(sa.Text)
    status: Mapped[str] = mapped_column(sa.Text)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    prompt_tokens: Mapped[int | None] = mapped_column(sa.Integer)
    completion_tokens: Mapped[int | None] = mapped_column(sa.Integer)


class PinRow(Base):
    """A pinned prefix (its token ids) or session, kept in its tier and restored at startup."""

    __tablename__ = "pins"
    __table_args__ = (sa.CheckConstraint("kind IN ('prefix', 'session')", name="kind"),)

    id: Mapped[str] = mapped_column(sa.Text, primary_key=True)
    tenant: Mapped[str] = mapped_column(sa.Text)
    kind: Mapped[str] = mapped_column(sa.Text)
    session_id: Mapped[str | None] = mapped_column(sa.Text)
    token_ids: Mapped[str | None] = mapped_column(sa.Text)  # comma-separated
    tier: Mapped[str] = mapped_column(sa.Text, default="device", server_default="device")
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime)


class SessionChunkRow(Base):
    """A disk-tier chunk that holds part of a session's KV: the catalog the startup reconciles with LMDB.

    `store` names the disk store (host name and an id kept beside it), so daemons sharing one database each
    reconcile their own rows; the row goes with its session (ON DELETE CASCADE)."""

    __tablename__ = "session_chunks"
    __table_args__ = (
        sa.Index(None, "store", "chunk_key"),
        sa.ForeignKeyConstraint(["tenant", "session_id"], ["sessions.tenant", "sessions.id"], ondelete="CASCADE",
                                name="fk_session_chunks_tenant_sessions"),
    )

    tenant: Mapped[str] = mapped_column(sa.Text, primary_key=True)
    session_id: Mapped[str] = mapped_column(sa.Text, primary_key=True)
    store: Mapped[str] = mapped_column(sa.Text, primary_key=True)
    chunk_key: Mapped[bytes] = mapped_column(sa.LargeBinary, primary_key=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
