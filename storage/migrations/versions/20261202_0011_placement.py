"""placement: a replace may go before the node preceding its run, or into a free position

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-02

The ``recallable`` layout commits its index checkpoints left to right in front of the state
checkpoint, and inserts a new state after the last of them; a replace's node could only take
the first position of its run. ``compactd_commit`` takes two more arguments, ``p_before`` and
``p_after`` (``storage.surface`` says what they do), so the fourteen-argument function is dropped:
a worker of an earlier revision fails its commits until it is upgraded (the error says to run
``compactd migrate``).

The state checkpoint names everything the layout absorbed, most of which index checkpoints
replaced, so a recall node's span is now the one its ``meta.recall`` states (``first``, ``last``)
when it states one, else the union of the spans it replaced as before: ``compactd_recall_index``
on PostgreSQL, the ``recall_index_node`` step of SQLite's trigger. Every node written before
this revision states the span its union gives, so nothing is indexed again.
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

from compactd.storage import sql

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_COMMIT_0009 = ("compactd_commit(text, text, bigint, timestamptz, bigint[], int[], text[],"
                " json[], int[], text[], json[], bigint[], bigint[], json)")


def _sqlite_trigger() -> str:
    """SQLite's recall trigger (revision 0010's), its node step as storage/sql has it."""
    return f"""CREATE TRIGGER compactd_recall AFTER INSERT ON events
    WHEN NEW.kind IN ('checkpoint', 'pruned') BEGIN
    {sql.as_trigger_body("recall_index_originals")};
    {sql.as_trigger_body("recall_index_node")};
    END"""


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(f"DROP FUNCTION IF EXISTS {_COMMIT_0009}")
        op.execute(sql.function_definition("compactd_commit"))
        op.execute(sql.function_definition("compactd_recall_index"))
    else:
        op.execute("DROP TRIGGER IF EXISTS compactd_recall")
        op.execute(_sqlite_trigger())


def downgrade() -> None:
    """Nothing to undo: revisions 0009 and 0010 create the functions and the trigger as
    storage/sql has them, these included (no store runs below the head revision)."""
