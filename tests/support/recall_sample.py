"""A session whose compaction replaced a fact the local summary drops (the needle), on the test's
database: what the recall tests of the store, the clients, the HTTP routes and the CLI search for.

    store, sample = compacted          # the fixture: sessions s1 (acme) and s2 (globex)
    await store.history_search("s1", NEEDLE, tenant="acme")
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from compactd.scheduler.samples import coding_session
from compactd.storage.messages import parse_openai
from compactd.storage.store import Store
from compactd.worker.orchestration import compact
from compactd.worker.runtime import open_deps
from compactd.worker.settings import Settings, build_config

POLICY = {"trigger": [{"type": "tokens", "value": 20_000}],
          "keep": {"type": "messages", "value": 12}}
NEEDLE = "ERR-7f3a9c: checksum mismatch in /srv/data/part-00017.parquet"


def needle_messages(needle_at: int = 10) -> list[dict[str, Any]]:
    sample = coding_session(steps=40).messages
    # A fact the local summary drops: inside a long, ordinary tool result.
    for i, m in enumerate(sample):
        if i >= needle_at and m["role"] == "tool":
            m["content"] = m["content"] + "\n" + NEEDLE + "\n"
            break
    return sample


@pytest.fixture
async def compacted(db_url: str) -> AsyncIterator[tuple[Store, list[dict[str, Any]]]]:
    config = build_config({}, settings=Settings(database_url=db_url, broker_url="memory://"))
    sample = needle_messages()
    async with open_deps(config, owner="recall-test") as deps:
        for session_id, tenant in (("s1", "acme"), ("s2", "globex")):
            await deps.store.create_session(session_id, tenant=tenant, context_window=128_000,
                                            policy=POLICY)
            await deps.store.append(session_id, [parse_openai(m) for m in sample])
            outcome = await compact(deps, session_id, trigger="pressure")
            assert outcome.outcome == "committed", outcome.to_json()
            assert (await deps.store.verify(session_id)).ok
    store = Store.from_url(db_url)
    try:
        yield store, sample
    finally:
        await store.close()
