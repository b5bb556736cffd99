"""Migration 0010 records the replaces committed before it as commits record new ones (the
originals pending), and the indexer then indexes them as it indexes a commit's."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa

from compactd.storage.database import create_engine
from compactd.storage.migrate import upgrade
from compactd.storage.store import Store
from tests.support.services import create_database_sync, drop_database_sync, with_database

BEFORE_RECALL = "0008"
BODY1 = "deploy failed: ERR-42 in /etc/app.conf"
EVENTS = [  # seq, kind, payload
    (1, "message", {"role": "user", "content": BODY1}),
    (2, "message", {"role": "assistant", "content": None,
                    "tool_calls": [["c1", "bash", "{\"cmd\": \"cat log\"}"]]}),
    (3, "message", {"role": "tool", "tool_call_id": "c1",
                    "content": [{"type": "text", "text": "boom"}, {"type": "image"}]}),
    (4, "pruned", {"replaces": [3], "message": {"role": "tool", "tool_call_id": "c1",
                                                "content": "b...", "meta": {"pruned": True}}}),
    # a checkpoint written before footers (no meta.recall): named from its span
    (5, "checkpoint", {"replaces": [1, 2, 4],
                       "message": {"role": "user", "content": "summary",
                                   "meta": {"checkpoint": True}}}),
]


@pytest.fixture(params=["sqlite", "postgres"])
def url(request: pytest.FixtureRequest, tmp_path: Path):  # type: ignore[no-untyped-def]
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'r.sqlite3'}"
        return
    pg = with_database(request.getfixturevalue("pg_url"), f"compactd_rc_{uuid.uuid4().hex[:8]}")
    create_database_sync(pg)
    yield pg
    drop_database_sync(pg)


async def _fill(url: str) -> None:
    engine = create_engine(url)
    try:
        async with engine.begin() as conn:
            await conn.execute(sa.text(
                "INSERT INTO sessions (id, tenant, envelope_tokens, surface_version,"
                " surface_tokens, surface_messages, last_seq, last_position, lease_fence,"
                " created_at) VALUES ('s1', 't', 0, 1, 0, 0, 5, 3, 0, CURRENT_TIMESTAMP)"))
            insert = sa.text(
                "INSERT INTO events (session_id, seq, kind, payload, created_at)"
                " VALUES ('s1', :seq, :kind, :payload, CURRENT_TIMESTAMP)"
            ).bindparams(sa.bindparam("payload", type_=sa.JSON))
            for seq, kind, payload in EVENTS:
                await conn.execute(insert, {"seq": seq, "kind": kind, "payload": payload})
    finally:
        await engine.dispose()


async def _read(url: str) -> tuple[list[tuple[object, ...]], list[tuple[object, ...]]]:
    engine = create_engine(url)
    try:
        async with engine.connect() as conn:
            nodes = [tuple(r) for r in await conn.execute(sa.text(
                "SELECT seq, ref, first_seq, last_seq, messages, bytes FROM recall_nodes"
                " ORDER BY seq"))]
            originals = [tuple(r) for r in await conn.execute(sa.text(
                "SELECT seq, node_seq, body, bytes FROM recall_originals ORDER BY seq"))]
    finally:
        await engine.dispose()
    return nodes, originals


async def _index(url: str) -> int:
    store = Store.from_url(url)
    try:
        return await store.index_recall()
    finally:
        await store.close()


def test_replaces_before_the_migration_are_indexed(url: str) -> None:
    upgrade(url, BEFORE_RECALL)
    if url.startswith("postgresql"):
        pytest.importorskip("asyncpg")
    asyncio.run(_fill(url))
    upgrade(url)
    nodes, originals = asyncio.run(_read(url))
    assert nodes == [(4, "r3", 3, 3, 1, 0), (5, "c1-3", 1, 3, 2, 0)]
    assert originals == [(1, 5, None, 0), (2, 5, None, 0), (3, 4, None, 0)]
    assert asyncio.run(_index(url)) == 3
    nodes, originals = asyncio.run(_read(url))
    assert nodes == [(4, "r3", 3, 3, 1, 4), (5, "c1-3", 1, 3, 2, len(BODY1) + 23)]
    assert originals == [(1, 5, BODY1, len(BODY1)),
                         (2, 5, 'bash {"cmd": "cat log"}', 23),
                         (3, 4, "boom", 4)]
