"""keyed append function: an append made with an idempotency key is one call, as one without is

Revision ID: 0023
Revises: 0022
Create Date: 2026-12-06

From revision 0021 an append with a key was five statements in one transaction (BEGIN, the
key's row read, ``compactd_append_v3``, the key's row written, COMMIT), five round trips on the
runtime's critical path for every step a client keys (the LangChain middleware keys each one).
``compactd_append_v4`` takes the key and the batch's digest and does the check, the replay and
the record with the append in the one call; without a key it is ``compactd_append_v3``. Expand
only: a new function beside the old ones, no table or row changes; the release at 0022 goes on
calling ``compactd_append_v3`` and the two key statements (the release at 0021
``compactd_append_v2`` and them), whose rows this function reads and writes the same way (a
live key's row answers at once, without a lock; else it locks the session's row and reads the
key's again before it appends, so an append of any of them racing with it on one key is stored
once).
"""

from __future__ import annotations

from collections.abc import Sequence

from compactd.storage import online_migrations as online

revision: str = "0023"
down_revision: str | None = "0022"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_CREATED = ("compactd_append_v4",)


def upgrade() -> None:
    online.create_functions(_CREATED)


def downgrade() -> None:
    online.drop_functions(_CREATED)
