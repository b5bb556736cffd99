"""append keys: an append retried with the client's idempotency key is stored once

Revision ID: 0021
Revises: 0020
Create Date: 2026-12-06

A runtime whose append timed out (a dropped connection, a server restarting mid-response) and
that appends again stored the step twice. An append may now carry a key; the first append with
it records what it returned here, and one made again with the key is answered from the row.
Expand only: a new table and its index, created empty, so no existing row is rewritten and no
function changes (the keyed append is the unchanged ``compactd_append_v2`` and two statements
beside it, in one transaction). The foreign key takes a brief lock on ``sessions`` (a catalog
write, as revision 0006's table took). The release at 0020 neither reads nor writes the table.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import compactd.storage.schema

revision: str = "0021"
down_revision: str | None = "0020"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "append_keys",
        sa.Column("session_id", sa.String(length=255), nullable=False),
        sa.Column("key", sa.String(length=255), nullable=False),
        sa.Column("request_sha256", sa.String(length=64), nullable=False),
        sa.Column("first_seq", sa.BigInteger(), nullable=False),
        sa.Column("last_seq", sa.BigInteger(), nullable=False),
        sa.Column("surface_version", sa.BigInteger(), nullable=False),
        sa.Column("surface_tokens", sa.BigInteger(), nullable=False),
        sa.Column("surface_messages", sa.Integer(), nullable=False),
        sa.Column("created_at", compactd.storage.schema.UTCDateTime(timezone=True),
                  nullable=False),
        sa.ForeignKeyConstraint(["session_id"], ["sessions.id"],
                                name=op.f("fk_append_keys_session_id_sessions"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("session_id", "key", name=op.f("pk_append_keys")),
    )
    # The table is new and empty: a plain CREATE INDEX holds nothing anyone else waits on.
    op.create_index(op.f("ix_append_keys_created_at"), "append_keys", ["created_at"])


def downgrade() -> None:
    op.drop_index(op.f("ix_append_keys_created_at"), table_name="append_keys")
    op.drop_table("append_keys")
