"""A session is identified by its tenant and its id together: frontends choose their own ids, and two
tenants may choose the same one.

The messages and the chunk catalog gain the tenant column their foreign key now needs.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

CHILDREN = ("messages", "session_chunks")


def upgrade() -> None:
    # The children first lose their foreign keys: SQLite's batch mode rebuilds `sessions` by dropping it, and
    # with foreign keys on (the store's connections) that drop would cascade to every message.
    for child in CHILDREN:
        with op.batch_alter_table(child) as batch:
            batch.drop_constraint(f"fk_{child}_session_id_sessions", type_="foreignkey")
            batch.add_column(sa.Column("tenant", sa.Text(), nullable=True))
        op.execute(f"UPDATE {child} SET tenant = (SELECT tenant FROM sessions WHERE sessions.id = {child}.session_id)")
    with op.batch_alter_table("sessions") as batch:
        batch.drop_constraint("pk_sessions", type_="primary")
        batch.create_primary_key("pk_sessions", ["tenant", "id"])
    with op.batch_alter_table("messages") as batch:
        batch.alter_column("tenant", existing_type=sa.Text(), nullable=False)
        batch.drop_constraint("uq_messages_session_id_seq", type_="unique")
        batch.create_unique_constraint("uq_messages_tenant_session_id_seq", ["tenant", "session_id", "seq"])
        batch.create_foreign_key("fk_messages_tenant_sessions", "sessions", ["tenant", "session_id"],
                                 ["tenant", "id"], ondelete="CASCADE")
    with op.batch_alter_table("session_chunks") as batch:
        batch.alter_column("tenant", existing_type=sa.Text(), nullable=False)
        batch.drop_constraint("pk_session_chunks", type_="primary")
        batch.create_primary_key("pk_session_chunks", ["tenant", "session_id", "store", "chunk_key"])
        batch.create_foreign_key("fk_session_chunks_tenant_sessions", "sessions", ["tenant", "session_id"],
                                 ["tenant", "id"], ondelete="CASCADE")


def downgrade() -> None:
    # Possible only while every id is one tenant's: an id two tenants chose would need renaming first.
    shared = op.get_bind().execute(sa.text("SELECT id FROM sessions GROUP BY id HAVING count(*) > 1")).scalars().all()
    if shared:
        raise RuntimeError(f"cannot downgrade: session ids used by several tenants: {shared[:10]}")
    with op.batch_alter_table("messages") as batch:
        batch.drop_constraint("fk_messages_tenant_sessions", type_="foreignkey")
        batch.drop_constraint("uq_messages_tenant_session_id_seq", type_="unique")
        batch.create_unique_constraint("uq_messages_session_id_seq", ["session_id", "seq"])
        batch.drop_column("tenant")
    with op.batch_alter_table("session_chunks") as batch:
        batch.drop_constraint("fk_session_chunks_tenant_sessions", type_="foreignkey")
        batch.drop_constraint("pk_session_chunks", type_="primary")
        batch.create_primary_key("pk_session_chunks", ["session_id", "store", "chunk_key"])
        batch.drop_column("tenant")
    with op.batch_alter_table("sessions") as batch:
        batch.drop_constraint("pk_sessions", type_="primary")
        batch.create_primary_key("pk_sessions", ["id"])
    for child in CHILDREN:
        with op.batch_alter_table(child) as batch:
            batch.create_foreign_key(f"fk_{child}_session_id_sessions", "sessions", ["session_id"], ["id"],
                                     ondelete="CASCADE")
