"""Pins: prefixes and sessions kept on the device, restored at startup.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-06
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "pins",
        sa.Column("id", sa.Text(), nullable=False),
        sa.Column("tenant", sa.Text(), nullable=False),
        sa.Column("kind", sa.Text(), nullable=False),
        sa.Column("session_id", sa.Text(), nullable=True),
        sa.Column("token_ids", sa.Text(), nullable=True),  # a prefix's token ids, comma-separated
        sa.Column("tier", sa.Text(), server_default="device", nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_pins"),
        sa.CheckConstraint("kind IN ('prefix', 'session')", name="ck_pins_kind"),
    )


def downgrade() -> None:
    op.drop_table("pins")
