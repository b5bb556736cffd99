"""history_search and history_read over what a real compaction replaced, on PostgreSQL and
SQLite: sessions appended and compacted by the orchestration a worker runs (local summarizer),
then searched and read back through storage."""

from __future__ import annotations

import json
from typing import Any

import pytest
import sqlalchemy as sa

from compactd.storage.errors import RecallArgumentError, RecallNotFound, SessionNotFound
from compactd.storage.messages import parse_openai
from compactd.storage.recall import encode_cursor, render_original
from compactd.storage.recall_bounds import MAX_QUERY_BYTES
from compactd.storage.store import Store
from tests.support.recall_sample import NEEDLE, compacted, needle_messages
from tests.support.tables import row_counts

__all__ = ["compacted"]  # the fixture (tests/support/recall_sample.py)


async def _checkpoint_ref(store: Store, session_id: str) -> str:
    surface = await store.read_surface(session_id)
    [ref] = [n.message.meta["recall"]["ref"] for n in surface.nodes
             if n.message.meta.get("checkpoint")]
    return str(ref)


async def test_search_finds_a_dropped_fact_exactly_and_names_its_checkpoint(compacted) -> None:
    store, sample = compacted
    surface = await store.read_surface("s1")
    assert NEEDLE not in json.dumps([n.message.content for n in surface.nodes])
    result = await store.history_search("s1", NEEDLE, tenant="acme")
    assert result.hits, result
    top = result.hits[0]
    assert top.exact and NEEDLE in top.snippet
    original = sample[top.seq - 1]
    assert NEEDLE in original["content"]
    # the hit's name reads back a page that holds it
    page = await store.history_read("s1", top.checkpoint, budget_tokens=100_000)
    assert top.seq in page.seqs
    assert result.scanned_messages > 0 and result.scanned_bytes >= len(NEEDLE)
    # case-insensitive substring still exact; a same-case match ranks first
    lower = await store.history_search("s1", "err-7F3A9C")
    assert lower.hits[0].seq == top.seq and lower.hits[0].exact


async def test_fuzzy_hits_rank_below_exact_ones(compacted) -> None:
    store, _ = compacted
    result = await store.history_search("s1", "checksum parquet nonexistentword", limit=10)
    assert result.hits and not any(h.exact for h in result.hits)
    assert any("checksum" in h.snippet for h in result.hits)
    mixed = await store.history_search("s1", "mismatch", limit=20)
    flags = [h.exact for h in mixed.hits]
    assert flags == sorted(flags, reverse=True)


async def test_read_pages_give_back_every_original_byte_exact(compacted) -> None:
    store, sample = compacted
    ref = await _checkpoint_ref(store, "s1")
    pages, offset = [], 0
    seen: list[int] = []
    while True:
        page = await store.history_read("s1", ref, offset, budget_tokens=500)
        assert page.tokens <= 500
        pages.append(page.transcript)
        seen += [s for s in page.seqs if not seen or s != seen[-1]]
        if page.cursor is None:
            break
        offset = page.cursor
    assert len(pages) > 3
    transcript = "".join(pages)
    first, last = (int(x) for x in ref[1:].split("-"))
    expected = "".join(render_original(seq, _payload(sample[seq - 1]))
                       for seq in seen)
    assert transcript == expected
    # every message the checkpoint replaced came back, content verbatim
    assert seen == sorted(seen) and seen[0] == first and seen[-1] <= last
    for seq in seen:
        content = sample[seq - 1].get("content")
        if isinstance(content, str):
            assert content in transcript


async def test_a_pruned_result_reads_back_its_original(compacted) -> None:
    store, sample = compacted
    events = await store.read_events("s1", kinds=["pruned"])
    if not events:
        pytest.skip("this sample had nothing pruned")
    ref = events[0].payload["message"]["meta"]["recall"]["ref"]
    seq = int(ref[1:])
    page = await store.history_read("s1", ref, budget_tokens=100_000)
    assert page.seqs == (seq,) and page.total_messages == 1
    assert sample[seq - 1]["content"] in page.transcript


async def test_a_checkpoint_scope_restricts_the_search(compacted) -> None:
    store, _ = compacted
    ref = await _checkpoint_ref(store, "s1")
    inside = await store.history_search("s1", NEEDLE, checkpoint=ref)
    assert inside.hits
    events = await store.read_events("s1", kinds=["pruned"])
    if events:
        pruned = events[0].payload["message"]["meta"]["recall"]["ref"]
        elsewhere = await store.history_search("s1", NEEDLE, checkpoint=pruned)
        assert all(h.seq == int(pruned[1:]) for h in elsewhere.hits)
        assert elsewhere.scanned_messages == 1


async def test_another_tenant_or_session_finds_nothing(compacted) -> None:
    store, _ = compacted
    ref = await _checkpoint_ref(store, "s1")
    with pytest.raises(SessionNotFound):
        await store.history_search("s1", NEEDLE, tenant="globex")
    with pytest.raises(SessionNotFound):
        await store.history_read("s1", ref, tenant="globex")
    with pytest.raises(SessionNotFound):
        await store.history_read("nope", ref)
    # s2 is another session: its own originals only
    other = await store.history_search("s2", NEEDLE, tenant="globex")
    assert other.hits and all(h.seq <= len(needle_messages()) for h in other.hits)


@pytest.mark.parametrize(("call", "argument"), [
    (lambda s, ref: s.history_read("s1", "c999999-1000000"), None),
    (lambda s, ref: s.history_read("s1", "not-a-ref"), None),
    (lambda s, ref: s.history_search("s1", "x", checkpoint="r424242"), None),
    (lambda s, ref: s.history_search("s1", ""), "query"),
    (lambda s, ref: s.history_search("s1", "   "), "query"),
    (lambda s, ref: s.history_search("s1", "q" * (MAX_QUERY_BYTES + 1)), "query"),
    (lambda s, ref: s.history_search("s1", "x" * 10_240), "query"),
    (lambda s, ref: s.history_search("s1", "x", limit=101), "limit"),
    (lambda s, ref: s.history_search("s1", "x", limit=0), "limit"),
    (lambda s, ref: s.history_read("s1", ref, -1), "offset"),
    (lambda s, ref: s.history_read("s1", ref, "garbage"), "offset"),
    (lambda s, ref: s.history_read("s1", ref, encode_cursor("r1", 0, 0)), "offset"),
    (lambda s, ref: s.history_read("s1", ref, budget_tokens=1), "budget_tokens"),
    (lambda s, ref: s.history_read("s1", ref, budget_tokens=100_001), "budget_tokens"),
    (lambda s, ref: s.history_read("s1", ref, budget_tokens="9"), "budget_tokens"),
    (lambda s, ref: s.history_read("s1", ref, cursor="garbage"), "cursor"),
    (lambda s, ref: s.history_read("s1", ref, cursor=""), "cursor"),
    (lambda s, ref: s.history_read("s1", ref, cursor="hr1." + "A" * 300), "cursor"),
    (lambda s, ref: s.history_read("s1", ref, cursor=encode_cursor("r1", 0, 0)), "cursor"),
    (lambda s, ref: s.history_read("s1", ref, cursor=encode_cursor(ref, -1, 0)), "cursor"),
    (lambda s, ref: s.history_read("s1", ref, 2, cursor=encode_cursor(ref, 0, 0)), "cursor"),
])
async def test_bad_input_is_refused_by_name_and_writes_nothing(compacted, call,
                                                               argument) -> None:
    store, _ = compacted
    ref = await _checkpoint_ref(store, "s1")
    before = await row_counts(store)
    expected = RecallNotFound if argument is None else RecallArgumentError
    with pytest.raises(expected) as caught:
        await call(store, ref)
    if argument is not None:
        assert caught.value.argument == argument  # type: ignore[attr-defined]
        assert str(caught.value).startswith(argument)
    assert await row_counts(store) == before


async def test_a_cursor_of_another_checkpoint_is_refused(compacted) -> None:
    store, _ = compacted
    ref = await _checkpoint_ref(store, "s1")
    page = await store.history_read("s1", ref, budget_tokens=200)
    assert page.cursor is not None
    events = await store.read_events("s1", kinds=["pruned"])
    other = (events[0].payload["message"]["meta"]["recall"]["ref"] if events
             else "c1-2")
    with pytest.raises((RecallArgumentError, RecallNotFound)):
        await store.history_read("s1", other, page.cursor)


async def test_a_cursor_given_as_cursor_reads_the_same_page_as_given_as_offset(
        compacted) -> None:
    store, _ = compacted
    ref = await _checkpoint_ref(store, "s1")
    first = await store.history_read("s1", ref, budget_tokens=200)
    assert first.cursor is not None
    assert (await store.history_read("s1", ref, cursor=first.cursor, budget_tokens=200)
            == await store.history_read("s1", ref, first.cursor, budget_tokens=200))


def _payload(message: dict[str, Any]) -> dict[str, Any]:
    return parse_openai(message).to_payload()


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
async def test_searches_are_planned_for_their_own_values_however_often_they_run(
        compacted) -> None:
    """A prepared statement's generic plan (PostgreSQL's choice after five runs on one
    connection) cannot see that a needle is rare, and walks the session's originals for every
    search instead of asking the trigram index: each search is planned for its values."""
    store, _ = compacted
    for i in range(12):
        await store.history_search("s1", f"ERR-7f3a9c {i}")
    async with store.engine.connect() as conn:
        plans = (await conn.execute(sa.text(
            "SELECT statement, generic_plans, custom_plans FROM pg_prepared_statements "
            "WHERE statement LIKE '%FROM recall_originals o%' "
            "AND statement NOT LIKE '%pg_prepared_statements%'"))).all()
    assert len(plans) == 3, "the exact search and the ranked stage's two, prepared here"
    assert [(p.generic_plans, p.custom_plans >= 12) for p in plans] == [(0, True)] * len(plans)
