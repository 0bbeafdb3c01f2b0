"""The chunk catalog: which disk-tier chunks hold each session's KV, reconciled with LMDB at startup.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "session_chunks",
        sa.Column("session_id", sa.Text(), nullable=False),
        sa.Column("store", sa.Text(), nullable=False),  # the disk store holding it: host name and store id
        sa.Column("chunk_key", sa.LargeBinary(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["session_id"], ["sessions.id"], name="fk_session_chunks_session_id_sessions",
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("session_id", "store", "chunk_key", name="pk_session_chunks"),
    )
    op.create_index("ix_session_chunks_store_chunk_key", "session_chunks", ["store", "chunk_key"])


def downgrade() -> None:
    op.drop_index("ix_session_chunks_store_chunk_key", table_name="session_chunks")
    op.drop_table("session_chunks")
