"""Moving a session to another run model (``set_run_model``) over HTTP in process (ASGI) and
through the LangChain middleware, on real SQLite and PostgreSQL: a window the session does not
fit queues a compaction at once, one it fits queues nothing, bad input changes nothing."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import create_async_engine

from compactd.client import CompactdClient
from compactd.scheduler.langchain import CompactdMiddleware
from compactd.storage.errors import ConfigError
from compactd.storage.store import Store
from tests.support.asgi import A, Served, api_config, marked_cpu_processes, serve_app
from tests.support.langchain_agents import make_config

MESSAGES = [{"role": "user" if i % 2 == 0 else "assistant",
             "content": f"message {i} " + "words " * 200} for i in range(30)]
# A kept tail a 100-token window's trigger is under: that window is refused by name.
KEEP = {"trigger": [{"type": "fraction", "value": 0.8}],
        "keep": {"type": "tokens", "value": 1000}}


@pytest.fixture
async def api(db_url: str, tmp_path: Path, request: pytest.FixtureRequest
              ) -> AsyncIterator[Served]:
    config = api_config(db_url, tmp_path, cpu_processes=marked_cpu_processes(request))
    async for served in serve_app(config):
        yield served


async def _stored(db_url: str) -> tuple[str | None, int | None, int]:
    store = Store.from_url(db_url)
    try:
        info = await store.get_session("s1")
        runs = await store.recent_runs(session_id="s1")
        return info.run_model, info.context_window, len(runs)
    finally:
        await store.close()


@pytest.mark.cpu_processes(1)
async def test_over_http_a_smaller_window_queues_a_compaction_and_a_larger_one_nothing(
        api: Served, db_url: str) -> None:
    await api.create("s1", A, run_model="gpt-4o", policy=KEEP)
    appended = await api.append("s1", A, *MESSAGES)
    assert appended.status_code == 200
    tokens = appended.json()["tokens"]  # no envelope: the session's pressure

    larger = await api.http.put("/v1/sessions/s1/run_model", headers=A,
                                json={"run_model": "gpt-4.1"})
    assert larger.status_code == 200, larger.text
    assert larger.json()["context_window"] == 1_047_576  # the published window
    assert larger.json()["fit"]["fits"] and larger.json()["compacting"] is False

    smaller = await api.http.put("/v1/sessions/s1/run_model", headers=A,
                                 json={"run_model": "small-model", "context_window": tokens})
    assert smaller.status_code == 200, smaller.text
    body = smaller.json()
    assert body["compacting"] is True and body["task_id"]
    assert body["fit"] == {"window": tokens, "tokens": body["fit"]["tokens"],
                           "reserve": tokens - int(tokens * 0.8), "fits": False}
    assert await _stored(db_url) == ("small-model", tokens, 0)

    for bad, field in [({"run_model": ""}, "body.run_model"),
                       ({"run_model": "m", "context_window": 0}, "body.context_window"),
                       ({"context_window": 10}, "body.run_model")]:
        refused = await api.http.put("/v1/sessions/s1/run_model", headers=A, json=bad)
        assert refused.status_code == 422 and refused.json()["field"] == field, refused.text
    # A window the session's keep does not fit under its trigger: named, nothing changed.
    policy = await api.http.put("/v1/sessions/s1/run_model", headers=A,
                                json={"run_model": "tiny", "context_window": 100})
    assert policy.status_code == 422, policy.text
    assert "keep" in policy.json()["message"]
    assert await _stored(db_url) == ("small-model", tokens, 0)


async def test_the_middleware_moves_its_session_and_opens_with_the_new_model(
        db_url: str, tmp_path: Path) -> None:
    config = make_config(db_url, tmp_path)
    async with CompactdClient(config) as client:
        session = await client.create_session("s1", run_model="gpt-4o", policy=KEEP)
        await session.append(MESSAGES)
        with pytest.raises(ConfigError):
            await session.set_run_model("tiny", 100)
    middleware = CompactdMiddleware("s1", config=config)
    try:
        moved = await middleware.aset_run_model("small-model", 2000)
    finally:
        middleware.close()
    assert moved["compacting"] is True and moved["task_id"]
    assert middleware.run_model == "small-model" and middleware.context_window == 2000
    assert await _stored(db_url) == ("small-model", 2000, 0)


@pytest.mark.timed
async def test_moving_to_a_model_whose_tokenizer_is_not_loaded_locks_the_session_briefly(
        clean_pg: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The new model's tokenizer is loaded (a BPE file parsed, which is slow) in a thread
    before the session's row is locked, not on the client's loop under the lock, where every
    append of the session, and every other call on that loop, would wait for it. The load is
    made slow here by a sleep, which unlike the parse leaves the GIL to the loop: polled with
    NOWAIT from the same loop while the model moves, the row is free, and found locked for the
    update's own moment at most."""
    from compactd.storage import tokens
    from compactd.worker.settings import Settings, build_config
    from tests.support.enqueuer import RecordingEnqueuer

    loaded: set[str] = set()
    real = tokens.encoding

    def slow_first_load(name: str) -> Any:
        if name not in loaded:
            time.sleep(0.5)
            loaded.add(name)
        return real(name)

    monkeypatch.setattr(tokens, "encoding", slow_first_load)
    config = build_config({}, settings=Settings(database_url=clean_pg, home=str(tmp_path),
                                                broker_url="memory://"), home=tmp_path)
    engine = create_async_engine(clean_pg.replace("postgresql://", "postgresql+asyncpg://"))
    free = locked = 0
    try:
        async with CompactdClient(config, enqueuer=RecordingEnqueuer()) as client:
            # A model counted without a BPE file, and an envelope the new one must count.
            await client.create_session(
                "s1", run_model="claude-sonnet-4-5", context_window=200_000,
                envelope={"system": "You are a careful assistant. " * 200})
            handle = await client.get_session("s1")
            tokens.counter_for.cache_clear()
            moving = asyncio.create_task(handle.set_run_model("gpt-4o", 128_000))
            async with engine.connect() as conn:
                while not moving.done():
                    try:
                        await conn.execute(sa.text(
                            "SELECT 1 FROM sessions WHERE id = 's1' FOR UPDATE NOWAIT"))
                        free += 1
                    except DBAPIError:
                        locked += 1
                    await conn.rollback()
                    await asyncio.sleep(0.005)
            assert (await moving)["run_model"] == "gpt-4o"
    finally:
        tokens.counter_for.cache_clear()
        await engine.dispose()
    assert free >= 5, f"the loop was held: {free} polls answered during the load"
    assert locked <= 1, f"the row was found locked {locked} times of {locked + free}"
