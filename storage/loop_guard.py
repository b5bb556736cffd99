"""Loop-guard flags: a session flagged with a reason and a cool-down, cleared by hand."""

from __future__ import annotations

import datetime as dt
from typing import TYPE_CHECKING

import sqlalchemy as sa

from compactd.storage import schema as t
from compactd.storage.database import connection, transaction
from compactd.storage.records import SessionInfo, utcnow
from compactd.storage.schema import SESSION_COLUMNS, session_from_row

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine


class LoopGuardMixin:
    engine: AsyncEngine


    async def flag_session(self, session_id: str, *, reason: str, cooldown_until: dt.datetime,
                           now: dt.datetime | None = None) -> None:
        async with transaction(self.engine) as conn:
            await conn.execute(t.sessions.update().where(t.sessions.c.id == session_id).values(
                flagged_reason=reason, flagged_at=now or utcnow(),
                cooldown_until=cooldown_until))

    async def clear_flag(self, session_id: str) -> None:
        async with transaction(self.engine) as conn:
            await conn.execute(t.sessions.update().where(t.sessions.c.id == session_id).values(
                flagged_reason=None, flagged_at=None, cooldown_until=None))

    async def flagged_sessions(self) -> list[SessionInfo]:
        c = t.sessions.c
        async with connection(self.engine) as conn:
            return [session_from_row(r) for r in await conn.execute(
                sa.select(*SESSION_COLUMNS).where(c.flagged_reason.is_not(None))
                .order_by(c.flagged_at.desc()))]
