"""An append made with an idempotency key, on PostgreSQL and SQLite: made again with the key it
answers with what the first returned and stores nothing; the key with other messages is
refused naming it; a key expires after ``retention.append_keys_hours``, retention's purge and
a session's deletion remove it. The client retries an append whose answer a cut connection
lost only when it has a key (PostgreSQL, through a proxy that loses the COMMIT's answer)."""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import re
from collections.abc import AsyncIterator

import pytest
import sqlalchemy as sa

from compactd.scheduler.client import CompactdClient, SessionHandle
from compactd.storage import schema as t
from compactd.storage.database import transaction
from compactd.storage.errors import (
    DatabaseMissing,
    DatabaseUnavailable,
    IdempotencyKeyReused,
    InvalidMessage,
    SessionNotFound,
)
from compactd.storage.kinds import NodeKind
from compactd.storage.messages import Message
from compactd.storage.records import utcnow
from compactd.storage.store import Store
from compactd.worker.retention import purge_expired
from compactd.worker.settings import RetentionConfig, Settings, build_config
from tests.support.cut_proxy import CutProxy
from tests.support.enqueuer import RecordingEnqueuer
from tests.support.surfaces import user

HOUR = dt.timedelta(hours=1)


async def _messages(store: Store, session_id: str) -> list[str]:
    return [e.payload["content"] for e in
            await store.read_events(session_id, kinds=[NodeKind.MESSAGE])]


async def _keys(store: Store) -> list[tuple[str, str]]:
    async with transaction(store.engine) as conn:
        return [tuple(r) for r in await conn.execute(
            sa.select(t.append_keys.c.session_id, t.append_keys.c.key)
            .order_by(t.append_keys.c.session_id, t.append_keys.c.key))]


async def _age_keys(store: Store, by: dt.timedelta) -> None:
    """Make every stored key ``by`` older, as time passing would."""
    c = t.append_keys.c
    async with transaction(store.engine) as conn:
        rows = (await conn.execute(sa.select(c.session_id, c.key, c.created_at))).all()
        for session_id, key, created_at in rows:
            await conn.execute(t.append_keys.update()
                               .where(c.session_id == session_id, c.key == key)
                               .values(created_at=created_at - by))


# ------------------------------------------------------------------------------------------
# the store


async def test_an_append_made_again_with_its_key_answers_the_first_and_stores_nothing(
        store: Store) -> None:
    await store.create_session("s")
    await store.append("s", [user("before")])
    first = await store.append("s", [user("step"), user("two")], idempotency_key="k-1")
    again = await store.append("s", [user("step"), user("two")], idempotency_key="k-1")
    assert not first.replayed and again.replayed
    assert (again.first_seq, again.last_seq, again.version) == (
        first.first_seq, first.last_seq, first.version) == (2, 3, first.version)
    assert (again.session.surface_tokens, again.session.surface_messages) == (
        first.session.surface_tokens, first.session.surface_messages)
    assert await _messages(store, "s") == ["before", "step", "two"]
    assert (await store.get_session("s")).surface_version == first.version
    # The same key on another session is another key.
    await store.create_session("other")
    elsewhere = await store.append("other", [user("step"), user("two")], idempotency_key="k-1")
    assert not elsewhere.replayed and await _messages(store, "other") == ["step", "two"]


async def test_without_a_key_the_same_append_made_twice_is_stored_twice(store: Store) -> None:
    # What a retry did before keys, and still does without one.
    await store.create_session("s")
    await store.append("s", [user("step")])
    await store.append("s", [user("step")])
    assert await _messages(store, "s") == ["step", "step"]


async def test_the_key_with_other_messages_is_refused_naming_it_and_nothing_is_stored(
        store: Store) -> None:
    await store.create_session("s")
    await store.append("s", [user("step")], idempotency_key="step-7")
    version = (await store.get_session("s")).surface_version
    for other in ([user("another step")], [user("step"), user("more")]):
        with pytest.raises(IdempotencyKeyReused, match="'step-7'"):
            await store.append("s", other, idempotency_key="step-7")
    assert await _messages(store, "s") == ["step"]
    assert (await store.get_session("s")).surface_version == version


async def test_appends_racing_with_one_key_store_the_batch_once(store: Store) -> None:
    await store.create_session("s")
    results = await asyncio.gather(*(
        store.append("s", [user("step")], idempotency_key="race") for _ in range(4)))
    assert await _messages(store, "s") == ["step"]
    assert {(r.first_seq, r.last_seq, r.version) for r in results} == {
        (1, 1, results[0].version)}
    assert sum(not r.replayed for r in results) == 1


async def test_a_key_older_than_its_window_is_taken_over_by_the_next_append(
        store: Store) -> None:
    await store.create_session("s")
    start = utcnow()
    await store.append("s", [user("step")], idempotency_key="k", now=start,
                       key_window_s=3600)
    inside = await store.append("s", [user("step")], idempotency_key="k",
                                now=start + HOUR - dt.timedelta(seconds=1), key_window_s=3600)
    assert inside.replayed
    after = await store.append("s", [user("step")], idempotency_key="k",
                               now=start + HOUR + dt.timedelta(seconds=1), key_window_s=3600)
    assert not after.replayed and after.first_seq == 2
    # Taken over: the key now answers for the second append.
    again = await store.append("s", [user("step")], idempotency_key="k",
                               now=start + HOUR + dt.timedelta(seconds=2), key_window_s=3600)
    assert again.replayed and again.first_seq == 2
    assert await _messages(store, "s") == ["step", "step"]


@pytest.mark.parametrize(("key", "problem"), [
    ("", "must not be empty"),
    ("k" * 1000, "at most 255 characters, not 1000"),
    ("clé-1", "printable ASCII without blanks (U+00E9 at character 2)"),
    ("a key", "printable ASCII without blanks (U+0020 at character 1)"),
    ("k\x00", "U+0000 at character 1"),
    (7, "must be a string, not int"),
])
async def test_a_key_that_cannot_be_one_is_refused_naming_it_and_nothing_is_stored(
        store: Store, key: object, problem: str) -> None:
    await store.create_session("s")
    with pytest.raises(InvalidMessage, match=re.escape(problem)) as refused:
        await store.append("s", [user("step")], idempotency_key=key)  # type: ignore[arg-type]
    assert refused.value.field == "idempotency_key"
    assert await _messages(store, "s") == [] and await _keys(store) == []


async def test_a_key_of_255_printable_characters_is_accepted(store: Store) -> None:
    await store.create_session("s")
    key = ("~!" * 128)[:255]
    await store.append("s", [user("step")], idempotency_key=key)
    assert (await store.append("s", [user("step")], idempotency_key=key)).replayed


async def test_an_append_refused_for_its_messages_keeps_no_key(store: Store) -> None:
    await store.create_session("s")
    orphan = Message(role="tool", content="result", tool_call_id="never-called")
    with pytest.raises(InvalidMessage, match="never-called"):
        await store.append("s", [orphan], idempotency_key="k")
    assert await _keys(store) == []
    # The key is free for the step made right.
    assert not (await store.append("s", [user("step")], idempotency_key="k")).replayed


async def test_a_key_for_a_missing_session_stores_nothing(store: Store) -> None:
    with pytest.raises(SessionNotFound):
        await store.append("nobody", [user("step")], idempotency_key="k")
    assert await _keys(store) == []


# ------------------------------------------------------------------------------------------
# retention and deletion


async def test_retention_purges_the_keys_past_append_keys_hours_and_keeps_the_others(
        store: Store) -> None:
    await store.create_session("s")
    await store.append("s", [user("old")], idempotency_key="old")
    await _age_keys(store, 3 * HOUR)
    await store.append("s", [user("new")], idempotency_key="new")
    kept = await purge_expired(store, RetentionConfig(append_keys_hours=4))
    assert kept.append_keys == 0 and len(await _keys(store)) == 2
    purged = await purge_expired(store, RetentionConfig(append_keys_hours=2))
    assert purged.append_keys == 1 and await _keys(store) == [("s", "new")]
    assert await _messages(store, "s") == ["old", "new"]


async def test_deleting_a_session_deletes_its_keys(store: Store) -> None:
    for session_id in ("gone", "kept"):
        await store.create_session(session_id)
        await store.append(session_id, [user("step")], idempotency_key="k")
    deleted = await store.delete_session("gone")
    assert deleted is not None and deleted.rows["append_keys"] == 1
    assert await _keys(store) == [("kept", "k")]


# ------------------------------------------------------------------------------------------
# the client


@pytest.fixture
async def client(store: Store, db_url: str) -> AsyncIterator[CompactdClient]:
    config = build_config({"retention": {"append_keys_hours": 2}},
                          settings=Settings(database_url=db_url, broker_url="memory://"))
    async with CompactdClient(config, store=store, enqueuer=RecordingEnqueuer()) as c:
        yield c


async def test_the_client_answers_a_step_made_again_with_its_key_from_the_first(
        client: CompactdClient, store: Store) -> None:
    session = await client.create_session("s")
    first = await session.append([{"role": "user", "content": "step"}], idempotency_key="k")
    again = await session.append([{"role": "user", "content": "step"}], idempotency_key="k")
    assert again.replayed and not first.replayed
    assert {**again.to_json(), "replayed": False} == first.to_json()
    assert await _messages(store, "s") == ["step"]
    # retry=True makes a key of its own for each call: two calls are two steps.
    await session.append([{"role": "user", "content": "next"}], retry=True)
    await session.append([{"role": "user", "content": "next"}], retry=True)
    assert await _messages(store, "s") == ["step", "next", "next"]
    assert len(await _keys(store)) == 3


async def test_the_client_keeps_a_key_for_retention_append_keys_hours(
        client: CompactdClient, store: Store) -> None:
    # The client's configuration says 2 hours: a key 1 hour old still answers, one 3 hours
    # old (older than the 24 of the default) no longer does.
    session = await client.create_session("s")
    await session.append([{"role": "user", "content": "step"}], idempotency_key="k")
    await _age_keys(store, HOUR)
    assert (await session.append([{"role": "user", "content": "step"}],
                                 idempotency_key="k")).replayed
    await _age_keys(store, 2 * HOUR)
    assert not (await session.append([{"role": "user", "content": "step"}],
                                     idempotency_key="k")).replayed
    assert await _messages(store, "s") == ["step", "step"]


def test_append_keys_hours_is_read_from_the_configuration() -> None:
    settings = Settings(database_url="sqlite:///x.sqlite3", broker_url="memory://")
    assert build_config({}, settings=settings).retention.append_key_window_s == 24 * 3600
    assert build_config({"retention": {"append_keys_hours": 0.5}},
                        settings=settings).retention.append_key_window_s == 1800


async def test_a_keyed_append_to_a_database_that_does_not_exist_fails_at_once_naming_it(
        clean_pg: str, caplog: pytest.LogCaptureFixture) -> None:
    # A retry cannot create the database: the client must not wait out its attempts.
    settings = Settings(database_url=clean_pg, broker_url="memory://")
    async with CompactdClient(build_config({}, settings=settings),
                              enqueuer=RecordingEnqueuer()) as real:
        info = (await real.create_session("s")).info
    missing = clean_pg.rsplit("/", 1)[0] + "/compactd_no_such_database"
    config = build_config({}, settings=Settings(database_url=missing, broker_url="memory://"))
    async with CompactdClient(config, enqueuer=RecordingEnqueuer()) as client:
        session = SessionHandle(client, info)
        with caplog.at_level(logging.WARNING), pytest.raises(DatabaseMissing) as refused:
            await session.append([{"role": "user", "content": "step"}], retry=True)
    assert not refused.value.retryable
    assert "'compactd_no_such_database' does not exist" in str(refused.value)
    assert [r for r in caplog.records if getattr(r, "action", None) == "append_retry"] == []


# ------------------------------------------------------------------------------------------
# an answer lost after the commit (PostgreSQL: a proxy cuts the connection mid-answer)


@pytest.fixture
async def cut(clean_pg: str) -> AsyncIterator[tuple[CutProxy, SessionHandle, Store]]:
    async with CutProxy(clean_pg) as proxy:
        url = proxy.url(clean_pg)
        config = build_config({}, settings=Settings(database_url=url, broker_url="memory://"))
        async with CompactdClient(config, enqueuer=RecordingEnqueuer()) as client:
            session = await client.create_session("s")
            direct = Store.from_url(clean_pg)
            try:
                yield proxy, session, direct
            finally:
                await direct.close()


async def test_an_append_whose_commit_answer_is_lost_is_made_again_with_its_key_and_stored_once(
        cut: tuple[CutProxy, SessionHandle, Store]) -> None:
    proxy, session, direct = cut
    await session.append([{"role": "user", "content": "before"}])
    # The keyed append is one autocommit statement: its answer is lost after it committed.
    proxy.arm()
    step = await session.append([{"role": "user", "content": "step"}], retry=True)
    assert proxy.cuts == 1
    # The first attempt committed; the retry found its key and stored nothing.
    assert step.replayed and (step.first_seq, step.last_seq) == (2, 2)
    assert await _messages(direct, "s") == ["before", "step"]
    assert step.version == (await direct.get_session("s")).surface_version


async def test_a_keyed_append_is_one_round_trip_as_an_unkeyed_one_is(
        cut: tuple[CutProxy, SessionHandle, Store]) -> None:
    # The key's check, its replay, its refusal and the append are one call of the append's
    # function (a transaction around separate statements was five round trips).
    proxy, session, direct = cut
    # Each statement is prepared once per connection: the first appends prepare them.
    await session.append([{"role": "user", "content": "warm"}])
    await session.append([{"role": "user", "content": "warm"}], idempotency_key="warm")
    for content, key, answer in (("plain", None, "appended"), ("step", "k", "appended"),
                                 ("step", "k", "replayed"), ("other", "k", "refused")):
        before = proxy.round_trips
        try:
            result = await session.append([{"role": "user", "content": content}],
                                          idempotency_key=key)
        except IdempotencyKeyReused:
            got = "refused"
        else:
            got = "replayed" if result.replayed else "appended"
        assert (got, proxy.round_trips - before) == (answer, 1), (content, key)
    assert await _messages(direct, "s") == ["warm", "warm", "plain", "step"]


async def test_without_a_key_an_append_whose_answer_is_lost_is_not_made_again(
        cut: tuple[CutProxy, SessionHandle, Store]) -> None:
    proxy, session, direct = cut
    await session.append([{"role": "user", "content": "before"}])
    # The unkeyed append is one autocommit statement: its answer is lost after it committed.
    proxy.arm()
    with pytest.raises(DatabaseUnavailable):
        await session.append([{"role": "user", "content": "step"}])
    assert proxy.cuts == 1
    # Stored once and not retried: a second append now, without a key, would store it twice.
    assert await _messages(direct, "s") == ["before", "step"]
