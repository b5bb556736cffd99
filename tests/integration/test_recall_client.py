"""history_search and history_read through the async and the sync client, on PostgreSQL and
SQLite, over sessions a real compaction replaced (the fixture of tests/support/recall_sample.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from compactd.scheduler.client import Client, CompactdClient, SessionHandle
from compactd.storage.errors import RecallArgumentError, RecallNotFound
from compactd.storage.recall import ReadPage
from compactd.storage.store import Store
from compactd.worker.settings import Settings, build_config
from tests.support.enqueuer import RecordingEnqueuer
from tests.support.recall_sample import NEEDLE, compacted
from tests.support.tables import row_counts

__all__ = ["compacted"]  # the fixture (tests/support/recall_sample.py)


@pytest.fixture
async def s1(compacted: tuple[Store, list[dict[str, Any]]], db_url: str
             ) -> AsyncIterator[SessionHandle]:
    """Session s1 through the async client."""
    store, _ = compacted
    config = build_config({}, settings=Settings(database_url=db_url, broker_url="memory://"))
    async with CompactdClient(config, store=store, enqueuer=RecordingEnqueuer()) as client:
        yield await client.get_session("s1")


async def test_the_async_client_finds_a_dropped_fact_and_reads_it_back_page_by_page(
        compacted: tuple[Store, list[dict[str, Any]]], s1: SessionHandle) -> None:
    store, sample = compacted
    found = await s1.history_search(NEEDLE)
    top = found.hits[0]
    assert top.exact and NEEDLE in top.snippet and NEEDLE in sample[top.seq - 1]["content"]
    pages: list[ReadPage] = []
    offset: int | str = 0
    while True:
        page = await s1.history_read(top.checkpoint, offset, budget_tokens=300)
        pages.append(page)
        if page.cursor is None:
            break
        offset = page.cursor
    assert len(pages) > 1
    assert NEEDLE in "".join(p.transcript for p in pages)
    assert any(top.seq in p.seqs for p in pages)
    # scoped to the checkpoint it names, the same hit; limit is honoured
    scoped = await s1.history_search(NEEDLE, checkpoint=top.checkpoint, limit=1)
    assert [h.seq for h in scoped.hits] == [top.seq]
    before = await row_counts(store)
    with pytest.raises(RecallNotFound):
        await s1.history_read("c999999-1000000")
    with pytest.raises(RecallArgumentError) as caught:
        await s1.history_search(NEEDLE, limit=101)
    assert caught.value.argument == "limit"
    assert await row_counts(store) == before


async def test_the_client_refuses_every_bad_input_by_name_and_writes_nothing(
        compacted: tuple[Store, list[dict[str, Any]]], s1: SessionHandle) -> None:
    store, _ = compacted
    ref = (await s1.history_search(NEEDLE)).hits[0].checkpoint
    cursor = (await s1.history_read(ref, budget_tokens=64)).cursor
    assert cursor is not None
    before = await row_counts(store)
    cases: list[tuple[Any, str | None]] = [
        (s1.history_read("c999999-1000000"), None),
        (s1.history_search("x", checkpoint="r424242"), None),
        (s1.history_search("x", checkpoint="nope"), "checkpoint"),
        (s1.history_read("c-1"), "checkpoint"),
        (s1.history_read("r1", cursor), "offset"),
        (s1.history_read("r1", cursor=cursor), "cursor"),
        (s1.history_read(ref, 3, cursor=cursor), "cursor"),
        (s1.history_search(""), "query"),
        (s1.history_search("x" * 10_240), "query"),
        (s1.history_read(ref, -1), "offset"),
        (s1.history_search("x", limit=101), "limit"),
        (s1.history_read(ref, budget_tokens=63), "budget_tokens"),
        (s1.history_read(ref, budget_tokens=100_001), "budget_tokens"),
        # refused here, not sent to the database: text no database stores, and limits that
        # are not integers (a bool is not one, nor a float or a string of digits)
        (s1.history_search("x\ud800y"), "query"),
        (s1.history_search("\udcff"), "query"),
        (s1.history_search("x", limit=True), "limit"),
        (s1.history_search("x", limit=5.5), "limit"),  # type: ignore[arg-type]
        (s1.history_search("x", limit="5"), "limit"),  # type: ignore[arg-type]
    ]
    for call, argument in cases:
        with pytest.raises(RecallNotFound if argument is None else RecallArgumentError
                           ) as caught:
            await call
        if argument is not None:
            assert caught.value.argument == argument, caught.value  # type: ignore[attr-defined]
            assert str(caught.value).startswith(f"{argument}: ")
    assert await row_counts(store) == before
    # the budget is honoured
    assert (await s1.history_read(ref, budget_tokens=64)).tokens <= 64


def test_the_sync_client_gives_the_same_answers(
        compacted: tuple[Store, list[dict[str, Any]]], db_url: str) -> None:
    config = build_config({}, settings=Settings(database_url=db_url, broker_url="memory://"))
    with Client(config) as client:
        session = client.get_session("s1")
        found = session.history_search(NEEDLE, limit=3)
        assert found.hits and found.hits[0].exact and len(found.hits) <= 3
        page = session.history_read(found.hits[0].checkpoint, budget_tokens=100_000)
        assert found.hits[0].seq in page.seqs and NEEDLE in page.transcript
        with pytest.raises(RecallArgumentError) as caught:
            session.history_read(found.hits[0].checkpoint, -1)
        assert caught.value.argument == "offset"
        for query, limit in (("x\ud800y", 5), ("x", True), ("x", "5")):
            with pytest.raises(RecallArgumentError):
                session.history_search(query, limit=limit)  # type: ignore[arg-type]
