"""history_search's ranked stage through the client, over a session a real compaction replaced:
the message holding every word of the query comes first however many newer messages hold one
of them, and PostgreSQL and SQLite return the same hits in the same order for the same queries."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from compactd.scheduler.client import CompactdClient, SessionHandle
from compactd.storage.messages import parse_openai
from compactd.worker.orchestration import compact
from compactd.worker.runtime import open_deps
from compactd.worker.settings import Settings, build_config
from tests.support.enqueuer import RecordingEnqueuer

POLICY = {"trigger": [{"type": "tokens", "value": 1_000}],
          "keep": {"type": "messages", "value": 4}}
# Each holds all the words of one query below, none of them adjacent as the query has them.
ANSWER = "The volume hit its quota at 02:14, so the nightly backup stopped with an error."
UNICODE = "Die Datei ist zu groß: Übergröße beim Upload des Archivs, Abbruch."
QUERIES = ("volume quota error", "backup quota", "error retry volume", "mounted volume quota",
           "upload archiv", "Übergröße upload", "ÜBERGRÖßE", "step retry scheduled",
           "nightly error", "quota", "job error")


def messages() -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{"role": "system", "content": "You are an operations agent."},
                                 {"role": "user", "content": "Why did the nightly backup stop?"},
                                 {"role": "assistant", "content": ANSWER},
                                 {"role": "user", "content": "And the upload?"},
                                 {"role": "assistant", "content": UNICODE}]
    for n in range(70):
        out.append({"role": "user", "content": f"Look at job {n}."})
        if n % 9 == 4:
            text = f"job {n}: the volume was mounted read-only; quota fine"
        else:
            text = f"job {n}: error in step {n % 7}, retry scheduled"
        out.append({"role": "assistant", "content": text})
    return [*out, {"role": "user", "content": "Summarize the failures."}]


async def compacted(url: str) -> None:
    config = build_config({}, settings=Settings(database_url=url, broker_url="memory://"))
    async with open_deps(config, owner="ranking-test") as deps:
        await deps.store.create_session("s1", context_window=128_000, policy=POLICY)
        await deps.store.append("s1", [parse_openai(m) for m in messages()])
        outcome = await compact(deps, "s1", trigger="pressure")
        assert outcome.outcome == "committed", outcome.to_json()


@pytest.fixture
async def session(db_url: str) -> AsyncIterator[SessionHandle]:
    await compacted(db_url)
    config = build_config({}, settings=Settings(database_url=db_url, broker_url="memory://"))
    async with CompactdClient(config, enqueuer=RecordingEnqueuer()) as client:
        yield await client.get_session("s1")


async def test_the_message_holding_every_word_ranks_first_over_sixty_newer_holding_one(
        session: SessionHandle) -> None:
    found = await session.history_search("volume quota error")
    top = found.hits[0]
    # seq 3: older than the 62 messages holding "error" (and the 8 holding "volume" and "quota")
    assert (top.seq, top.exact) == (3, False), found
    assert "quota" in top.snippet
    # then the messages holding two of the three words, before any holding one
    assert [h.seq for h in found.hits[1:]] == sorted(
        [h.seq for h in found.hits[1:]], reverse=True)
    assert all("mounted" in h.snippet for h in found.hits[1:]), found


async def test_a_message_holding_the_query_whole_comes_first_then_the_ranked_ones(
        session: SessionHandle) -> None:
    found = await session.history_search("quota fine", limit=10)
    exact = [h for h in found.hits if h.exact]
    assert len(exact) == 8 and found.hits[:8] == tuple(exact)
    assert [h.seq for h in exact] == sorted((h.seq for h in exact), reverse=True)
    # "quota" alone: the answer holding it, ranked after the exact hits
    assert [h.seq for h in found.hits[8:]] == [3]


async def test_unicode_case_is_folded_in_exact_and_ranked_searches(
        session: SessionHandle) -> None:
    for query in ("übergröße", "ÜBERGRÖßE", "ÜBERGRÖßE BEIM"):
        found = await session.history_search(query)
        assert [(h.seq, h.exact) for h in found.hits][:1] == [(5, True)], (query, found)
    ranked = await session.history_search("archivs übergröße")
    assert [(h.seq, h.exact) for h in ranked.hits] == [(5, False)]
    assert "Übergröße" in ranked.hits[0].snippet


async def test_both_backends_return_the_same_hits_in_the_same_order(
        clean_pg: str, sqlite_url: str) -> None:
    """The contract: the same session, the same queries, the same answers on each."""
    answers: dict[str, list[list[tuple[str, int, bool]]]] = {}
    for url in (clean_pg, sqlite_url):
        await compacted(url)
        config = build_config({}, settings=Settings(database_url=url, broker_url="memory://"))
        async with CompactdClient(config, enqueuer=RecordingEnqueuer()) as client:
            handle = await client.get_session("s1")
            answers[url] = [[(h.checkpoint, h.seq, h.exact)
                             for h in (await handle.history_search(q, limit=20)).hits]
                            for q in QUERIES]
    postgres, sqlite = answers[clean_pg], answers[sqlite_url]
    for query, on_pg, on_sqlite in zip(QUERIES, postgres, sqlite, strict=True):
        assert on_pg, f"{query!r} found nothing"
        assert on_pg == on_sqlite, f"{query!r}: PostgreSQL {on_pg}, SQLite {on_sqlite}"
