"""Recall's index is built after the commit, never in it (issue 26), on PostgreSQL and SQLite.

A tool result holding a NUL, and one of 2 MB of distinct tokens (more than PostgreSQL takes in
one tsvector), are compacted by the orchestration a worker runs: the prune commits, and
history_search finds both originals, by their needles, whether or not their text is indexed
yet. A run whose worker never indexed (it died between its commit and the indexing) is found
by a scan until the beat sweep indexes it."""

from __future__ import annotations

import random
import string
from collections.abc import AsyncIterator
from typing import Any

import pytest
import sqlalchemy as sa

from storage.messages import parse_openai
from storage.recall_index import MAX_INDEXED_BYTES
from storage.store import Store
from worker.orchestration import compact
from worker.runtime import Deps, open_deps
from worker.settings import Config, Settings, build_config
from worker.sweeps import index_recall

POLICY = {"trigger": [{"type": "tokens", "value": 20_000}],
          "keep": {"type": "messages", "value": 4}}
BIG_NEEDLE = "ERR-5c1e77: shard 0042 lost its lease"
NUL_NEEDLE = "checksum mismatch in /srv/blob/part-00017"


def _high_entropy(size: int, seed: int = 26) -> str:
    """``size`` characters of distinct random tokens (a log of ids, hashes), one per line."""
    rng = random.Random(seed)
    alphabet = string.ascii_letters + string.digits
    lines, total = [], 0
    while total < size:
        line = "".join(rng.choices(alphabet, k=31))
        lines.append(line)
        total += len(line) + 1
    return "\n".join(lines)[:size]


def _big_result() -> str:
    body = _high_entropy(2 * 1024 * 1024)
    # Past what the surface keeps of a pruned result (its head and tail), inside the prefix the
    # index keeps verbatim.
    at = 64 * 1024
    return body[:at] + "\n" + BIG_NEEDLE + "\n" + body[at:]


def _nul_result() -> str:
    # The NUL sits in the head the pruned result keeps on the surface, so the pruned node's own
    # payload holds one too; the needle is past it, outside the surface's head and tail.
    return ("binary dump\x00header\x00\n" + "row of plain log text\n" * 600 + NUL_NEEDLE + "\n"
            + "more plain log text\n" * 600)


def _messages() -> list[dict[str, Any]]:
    return [
        {"role": "user", "content": "collect the shard logs and the blob dump"},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "read_log", "arguments": "{\"shard\": 42}"}}]},
        {"role": "tool", "tool_call_id": "c1", "name": "read_log", "content": _big_result()},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "c2", "type": "function",
                         "function": {"name": "dump_blob", "arguments": "{\"part\": 17}"}}]},
        {"role": "tool", "tool_call_id": "c2", "name": "dump_blob", "content": _nul_result()},
        {"role": "assistant", "content": "Both read. Shard 42 and part 17 look wrong."},
        {"role": "user", "content": "what went wrong?"},
    ]


def _config(db_url: str, *, recall_index: bool = True) -> Config:
    return build_config({"worker": {"recall_index": recall_index}},
                        settings=Settings(database_url=db_url, broker_url="memory://"))


@pytest.fixture
async def deps(db_url: str) -> AsyncIterator[Deps]:
    async with open_deps(_config(db_url), owner="recall-index-test") as opened:
        yield opened


async def _append_and_compact(deps: Deps, session_id: str) -> list[int]:
    """The session appended and compacted by the worker's orchestration; the seqs of the two
    large tool results."""
    store = deps.store
    await store.create_session(session_id, tenant="acme", context_window=2_000_000,
                               policy=POLICY)
    await store.append(session_id, [parse_openai(m) for m in _messages()])
    outcome = await compact(deps, session_id, trigger="pressure")
    assert outcome.outcome == "committed", outcome.to_json()
    assert outcome.pruned == 2, outcome.to_json()
    assert (await store.verify(session_id)).ok
    return [3, 5]


async def _pending(store: Store, session_id: str) -> int:
    rows = await store.db.fetch("recall_pending_originals", session_id=session_id, limit=100)
    return len(rows)


async def _assert_found(store: Store, session_id: str, big: int, nul: int) -> None:
    for needle, seq in ((BIG_NEEDLE, big), (NUL_NEEDLE, nul)):
        result = await store.history_search(session_id, needle, tenant="acme")
        # (random text shares short words with any query: only the exact hits are judged)
        assert [(h.seq, h.checkpoint) for h in result.hits if h.exact] == [
            (seq, f"r{seq}")], (needle, result)
        assert needle in result.hits[0].snippet
        # the name reads back the original byte-exact, NUL and all
        page = await store.history_read(session_id, f"r{seq}", budget_tokens=100_000)
        assert page.seqs[0] == seq
    nul_page = await store.history_read(session_id, f"r{nul}", budget_tokens=100_000)
    assert _nul_result() in nul_page.transcript


async def test_a_nul_and_two_megabytes_of_distinct_tokens_compact_and_are_found(
        deps: Deps) -> None:
    big, nul = await _append_and_compact(deps, "s1")
    store = deps.store
    # indexed right after the run, bounded
    assert await _pending(store, "s1") == 0
    await _assert_found(store, "s1", big, nul)
    # the words of the NUL result past the NUL are indexed as words too
    words = await store.history_search("s1", "blob checksum part-00017", tenant="acme")
    assert any(h.seq == nul for h in words.hits), words


async def test_the_index_holds_a_bounded_text_per_original(deps: Deps) -> None:
    big, _ = await _append_and_compact(deps, "s1")
    sizes = await deps.store.db.fetch("history_scanned", session_id="s1", first_seq=big,
                                      last_seq=big)
    # the scanned bytes count the whole original; the index keeps at most its bound
    assert int(sizes[0]["bytes"]) > 2 * 1024 * 1024
    async with deps.store.engine.connect() as conn:
        held = (await conn.execute(sa.text(
            "SELECT length(body) FROM recall_originals WHERE session_id = 's1' AND seq = :seq"),
            {"seq": big})).scalar_one()
    assert held <= MAX_INDEXED_BYTES


async def test_originals_no_worker_indexed_are_found_and_the_sweep_indexes_them(
        db_url: str) -> None:
    """The state a worker leaves when it dies between its commit and the indexing: the
    commit recorded what it replaced, nothing is indexed."""
    async with open_deps(_config(db_url, recall_index=False), owner="dies-after-commit") as d:
        big, nul = await _append_and_compact(d, "s1")
        assert await _pending(d.store, "s1") == 2
        # found by the scan of what is not indexed yet
        await _assert_found(d.store, "s1", big, nul)
    config = _config(db_url)
    store = Store.from_url(db_url)
    try:
        assert await index_recall(store, config) == 2
        assert await _pending(store, "s1") == 0
        await _assert_found(store, "s1", big, nul)
        assert await index_recall(store, config) == 0
    finally:
        await store.close()
