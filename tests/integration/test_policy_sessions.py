"""Creating and reopening sessions through the client, on both backends: a keep that the
session's window would make fire the trigger again is refused before anything is written, and a
session whose stored overrides fix it can always be reopened."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from compactd.scheduler.client import CompactdClient
from compactd.storage.errors import ConfigError, SessionNotFound
from compactd.storage.store import Store
from compactd.worker.settings import Settings, build_config
from tests.support.enqueuer import RecordingEnqueuer

# Trigger at 4000 tokens with the default keep: 16% of a 128k window (20480 tokens) refires it.
RAW = {"summarization": {"trigger": [["tokens", 4000]]}, "worker": {"metrics_port": 0}}


@pytest.fixture
async def client(db_url: str, store: Store) -> AsyncIterator[CompactdClient]:
    config = build_config(RAW, settings=Settings(database_url=db_url, broker_url="memory://"))
    async with CompactdClient(config, store=store, enqueuer=RecordingEnqueuer()) as c:
        yield c


async def test_the_window_decides_and_stored_overrides_count_on_reopen(
        client: CompactdClient, store: Store) -> None:
    with pytest.raises(ConfigError) as err:
        await client.create_session("s1", run_model="gpt-4o")
    assert str(err.value).startswith(
        "summarization.retain_ratio: keep fraction>=0.16 (retain_ratio) is not below trigger "
        "tokens>=4000 of a 128000-token window"), str(err.value)
    with pytest.raises(SessionNotFound):
        await store.get_session("s1")

    await client.create_session("s1", run_model="gpt-4o", policy={"keep": ["messages", 10]})
    # A runtime restarting opens its session without repeating the overrides.
    reopened = await client.create_session("s1", run_model="gpt-4o")
    assert reopened.info.policy == {"keep": ["messages", 10]}
    # A window with room for the default keep is fine without overrides.
    await client.create_session("s2", run_model="gpt-4o", context_window=20_000)
