"""The pressure sweep decides in SQL on stored thresholds and an index of the sessions over them
(PostgreSQL and the embedded SQLite): it reads and locks only those, and follows a changed
configuration or session policy."""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any

import pytest

from compactd.scheduler.client import CompactdClient
from compactd.storage.counters import MESSAGES, TOKENS
from compactd.storage.records import SessionInfo
from compactd.storage.store import Store
from compactd.worker.compaction.policy import parse_policy
from compactd.worker.pressure import over_trigger, sweep_key, sweep_thresholds
from compactd.worker.settings import Settings, build_config
from compactd.worker.sweeps import sweep_pressure
from tests.support.enqueuer import RecordingEnqueuer
from tests.support.scheduler_sessions import make_config, over, user


async def _sessions(db_url: str, store: Store, *, over_ids: tuple[str, ...],
                    under_ids: tuple[str, ...]) -> None:
    config = make_config(db_url)
    async with CompactdClient(config, store=store, enqueuer=RecordingEnqueuer()) as client:
        for sid in over_ids:
            await over(client, sid)
        for sid in under_ids:
            handle = await client.create_session(sid, run_model="gpt-4o")
            await handle.append([user(300)])


async def test_the_sweep_reads_only_sessions_over_their_trigger(db_url: str,
                                                                store: Store) -> None:
    await _sessions(db_url, store, over_ids=("hot-1", "hot-2"),
                    under_ids=tuple(f"cold-{i}" for i in range(20)))
    config = make_config(db_url)
    key = sweep_key(config)
    await store.resolve_sweep_thresholds(key=key,
                                         resolve=lambda info: sweep_thresholds(info, config))
    seen: list[str] = []

    def decide(info: SessionInfo) -> bool:
        seen.append(info.id)
        return over_trigger(info, config)

    chosen, after = await store.select_for_sweep(decide=decide, limit=50)
    assert sorted(seen) == ["hot-1", "hot-2"]  # the twenty cold sessions are never read
    assert sorted(s.id for s in chosen) == ["hot-1", "hot-2"] and after is None
    info = await store.get_session("cold-0")
    assert (info.sweep_key, info.sweep_tokens, info.sweep_messages) == (key, 400, None)


async def test_the_sweep_leaves_rows_under_their_trigger_unlocked(clean_pg: str) -> None:
    """While the sweep holds its batch, another transaction can still lock a session under its
    trigger at once: the runtime's appends to cold sessions never queue behind a sweep."""
    import asyncpg

    store = Store.from_url(clean_pg)
    try:
        await _sessions(clean_pg, store, over_ids=("hot",), under_ids=("cold",))
        config = make_config(clean_pg)
        await store.resolve_sweep_thresholds(
            key=sweep_key(config), resolve=lambda info: sweep_thresholds(info, config))

        async def lock_cold() -> str:
            conn = await asyncpg.connect(clean_pg)
            try:
                async with conn.transaction():
                    await conn.execute("SET LOCAL lock_timeout = '1s'")
                    await conn.execute("SELECT 1 FROM sessions WHERE id = 'cold' FOR UPDATE NOWAIT")
                return "locked"
            except asyncpg.LockNotAvailableError:
                return "held by the sweep"
            finally:
                await conn.close()

        probes: list[str] = []

        def decide(info: SessionInfo) -> bool:
            # Runs inside the sweep's transaction: probe from another connection and thread.
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                probes.append(pool.submit(asyncio.run, lock_cold()).result())
            return True

        chosen, _ = await store.select_for_sweep(decide=decide)
        assert [s.id for s in chosen] == ["hot"] and probes == ["locked"]
    finally:
        await store.close()


async def test_the_sweep_follows_a_changed_trigger_and_a_changed_session_policy(
        db_url: str, store: Store) -> None:
    await _sessions(db_url, store, over_ids=(), under_ids=("a", "b"))
    enqueuer = RecordingEnqueuer()
    assert (await sweep_pressure(store, make_config(db_url), enqueuer)).enqueued == ()
    # A session's own policy lowers its trigger: its thresholds are resolved again.
    await store.create_session("a", run_model="gpt-4o",
                               policy={"trigger": {"type": "tokens", "value": 250}})
    result = await sweep_pressure(store, make_config(db_url), enqueuer)
    assert result.enqueued == ("a",) and result.resolved == 1
    # The configuration lowers everyone's trigger: a new key, every session resolved again.
    lower = make_config(db_url, trigger=200)
    result = await sweep_pressure(store, lower, enqueuer)
    assert result.enqueued == ("b",) and result.resolved == 2
    assert (await sweep_pressure(store, lower, enqueuer)).resolved == 0
    # A change that does not touch the trigger keeps the stored thresholds.
    other_keep = make_config(db_url, trigger=200, keep=7)
    assert (await sweep_pressure(store, other_keep, enqueuer)).resolved == 0


async def test_a_message_trigger_is_swept_on_the_message_count(db_url: str,
                                                                store: Store) -> None:
    trigger = [{"type": "messages", "value": 3}, {"type": "tokens", "value": 10_000}]
    config = build_config({"summarization": {"trigger": trigger,
                                              "keep": {"type": "messages", "value": 1}},
                           "worker": {"metrics_port": 0}},
                          settings=Settings(database_url=db_url, broker_url="memory://"))
    async with CompactdClient(config, store=store, enqueuer=RecordingEnqueuer()) as client:
        many = await client.create_session("many", run_model="gpt-4o")
        await many.append([user(5), user(5), user(5)])
        few = await client.create_session("few", run_model="gpt-4o")
        await few.append([user(5)])
    await store.clear_signal("many")
    result = await sweep_pressure(store, config, RecordingEnqueuer())
    assert result.enqueued == ("many",)
    assert (await store.get_session("few")).sweep_messages == 3


@pytest.mark.parametrize(("trigger", "window", "floors"), [
    ({"type": "fraction", "value": 0.8}, 1000, (800, None)),
    ({"type": "fraction", "value": 0.8}, None, (None, None)),  # dropped: automatic off
    ({"type": "tokens", "value": 400}, None, (400, None)),
    ([{"type": "messages", "value": 50}, {"type": "tokens", "value": 400}], None, (400, 50)),
    ({"tokens": 300, "fraction": 0.5}, 1000, (500, None)),  # AND: the larger
    ({"tokens": 300, "messages": 9}, None, (300, None)),  # mixed AND: tokens select, Python decides
    ([{"tokens": 300, "messages": 9}, {"type": "messages", "value": 40}], None, (300, 40)),
    ({"type": "fraction", "value": 0.3333}, 1000, (334, None)),  # tokens are whole
    ([], None, (None, None)),
])
def test_trigger_floors(trigger: Any, window: int | None,
                        floors: tuple[int | None, int | None]) -> None:
    tokens, messages = floors
    assert parse_policy({"trigger": trigger}).resolve(window).trigger_floors() == {
        TOKENS: tokens, MESSAGES: messages}


def test_a_disabled_policy_is_never_swept() -> None:
    policy = parse_policy({"enabled": False, "trigger": {"type": "tokens", "value": 1}})
    assert policy.resolve(None).trigger_floors() == {TOKENS: None,
                                                     MESSAGES: None}
