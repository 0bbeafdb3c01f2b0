"""Messages may be superseded: a client that edits a session's history replaces
its messages from the edit on; the old ones stay, marked, instead of being deleted.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Batch mode: SQLite rebuilds the table to change a CHECK constraint.
    with op.batch_alter_table("messages") as batch:
        batch.drop_constraint("ck_messages_status", type_="check")
        batch.create_check_constraint("ck_messages_status", "status IN ('complete', 'interrupted', 'superseded')")


def downgrade() -> None:
    op.execute("DELETE FROM messages WHERE status = 'superseded'")
    with op.batch_alter_table("messages") as batch:
        batch.drop_constraint("ck_messages_status", type_="check")
        batch.create_check_constraint("ck_messages_status", "status IN ('complete', 'interrupted')")
