"""Recall's index is built after the commit, never in it (issue 26), on PostgreSQL and SQLite.

A tool result holding a NUL, and one of 2 MB of distinct tokens (more than PostgreSQL takes in
one tsvector), are compacted by the orchestration a worker runs: the prune commits, and
history_search finds both originals, by their needles, whether or not their text is indexed
yet. A run whose worker never indexed (it died between its commit and the indexing) is found
by a scan until the beat sweep indexes it. A run that fails in a later round has its earlier
rounds' replaces indexed as a committed run has."""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import random
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import sqlalchemy as sa

from compactd.storage.kinds import RunStatus
from compactd.storage.messages import parse_openai
from compactd.storage.recall_index import MAX_INDEXED_BYTES
from compactd.storage.store import Store
from compactd.worker.orchestration import BackgroundIndexer, compact
from compactd.worker.runtime import Deps, open_deps
from compactd.worker.settings import Config, Settings, build_config
from compactd.worker.sweeps import index_recall
from tests.conftest import compactd_cmd
from tests.support.bulky import access_log, high_entropy
from tests.support.fake_provider import Behaviour, FakeProvider
from tests.support.stack import FAKE_KEY_ENV, fake_models

POLICY = {"trigger": [{"type": "tokens", "value": 20_000}],
          "keep": {"type": "messages", "value": 4}}
BIG_NEEDLE = "ERR-5c1e77: shard 0042 lost its lease"
NUL_NEEDLE = "checksum mismatch in /srv/blob/part-00017"


@functools.cache
def _big_result() -> str:
    body = high_entropy(2 * 1024 * 1024)
    # Past what the surface keeps of a pruned result (its head and tail), inside the prefix the
    # index keeps verbatim.
    at = 64 * 1024
    return body[:at] + "\n" + BIG_NEEDLE + "\n" + body[at:]


@functools.cache
def _nul_result() -> str:
    # The NUL sits in the head the pruned result keeps on the surface, so the pruned node's own
    # payload holds one too; the needle is past it, outside the surface's head and tail.
    return ("binary dump\x00header\x00\n" + "row of plain log text\n" * 3000 + NUL_NEEDLE + "\n"
            + "more plain log text\n" * 3000)


def _call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"role": "assistant", "content": None,
            "tool_calls": [{"id": call_id, "type": "function",
                            "function": {"name": name, "arguments": arguments}}]}


def _messages(results: dict[str, str]) -> list[dict[str, Any]]:
    """A user request, then one tool call and its result per entry of ``results`` (seqs 3, 5,
    ...), then a short exchange."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": "collect the logs"}]
    for i, (name, content) in enumerate(results.items()):
        messages += [_call(f"c{i}", name, f"{{\"part\": {i}}}"),
                     {"role": "tool", "tool_call_id": f"c{i}", "name": name, "content": content}]
    return [*messages, {"role": "assistant", "content": "Read. Shard 42 and part 17 look wrong."},
            {"role": "user", "content": "what went wrong?"}]


def _both() -> dict[str, str]:
    return {"read_log": _big_result(), "dump_blob": _nul_result()}


def _config(db_url: str, *, recall_index: bool = True, concurrency: int = 64) -> Config:
    return build_config({"worker": {"recall_index": recall_index, "concurrency": concurrency}},
                        settings=Settings(database_url=db_url, broker_url="memory://"))


@pytest.fixture
async def deps(db_url: str) -> AsyncIterator[Deps]:
    async with open_deps(_config(db_url), owner="recall-index-test") as opened:
        yield opened


async def _append_and_compact(deps: Deps, session_id: str,
                              results: dict[str, str] | None = None) -> None:
    """The session appended and compacted by the worker's orchestration: every large tool
    result pruned, in a commit that must not fail."""
    store = deps.store
    results = results or _both()
    await store.create_session(session_id, tenant="acme", context_window=2_000_000,
                               policy=POLICY)
    await store.append(session_id, [parse_openai(m) for m in _messages(results)])
    outcome = await compact(deps, session_id, trigger="pressure")
    assert outcome.outcome == "committed", outcome.to_json()
    assert outcome.pruned == len(results), outcome.to_json()
    assert (await store.verify(session_id)).ok


async def _compact_in_background(deps: Deps, session_id: str, results: dict[str, str]) -> None:
    """As a worker's task compacts: the indexing left to the process's indexer."""
    store = deps.store
    await store.create_session(session_id, tenant="acme", context_window=2_000_000,
                               policy=POLICY)
    await store.append(session_id, [parse_openai(m) for m in _messages(results)])
    outcome = await compact(deps, session_id, trigger="pressure", index_in_background=True)
    assert (outcome.outcome, outcome.pruned) == ("committed", len(results)), outcome.to_json()


async def _until_indexed(store: Store, session_id: str, within_s: float = 30.0) -> None:
    give_up = time.monotonic() + within_s
    while await _pending(store, session_id):
        assert time.monotonic() < give_up, f"{session_id} not indexed in {within_s} s"
        await asyncio.sleep(0.05)


async def _pending(store: Store, session_id: str) -> int:
    rows = await store.db.fetch("recall_pending_originals", session_id=session_id, limit=100)
    return len(rows)


async def _assert_found(store: Store, session_id: str, needle: str, seq: int,
                        original: str) -> None:
    result = await store.history_search(session_id, needle, tenant="acme")
    # (random text shares short words with any query: only the exact hits are judged)
    assert [(h.seq, h.checkpoint) for h in result.hits if h.exact] == [(seq, f"r{seq}")], (
        needle, result)
    assert needle in result.hits[0].snippet
    # the name reads back the original byte-exact, NUL and all
    page = await store.history_read(session_id, f"r{seq}", budget_tokens=100_000)
    assert page.seqs[0] == seq
    if len(original) < 100_000:
        assert original in page.transcript


async def test_a_tool_result_with_a_nul_compacts_and_is_found(deps: Deps) -> None:
    """Issue 26, item 1: the commit failed on PostgreSQL (22P05); on SQLite the text after
    the NUL could not be searched."""
    await _append_and_compact(deps, "s1", {"dump_blob": _nul_result()})
    assert await _pending(deps.store, "s1") == 0  # indexed right after the run
    await _assert_found(deps.store, "s1", NUL_NEEDLE, 3, _nul_result())
    # the words past the NUL are indexed as words too
    words = await deps.store.history_search("s1", "blob checksum part-00017", tenant="acme")
    assert [h.seq for h in words.hits] == [3], words


async def test_two_megabytes_of_distinct_tokens_compact_and_are_found(deps: Deps) -> None:
    """Issue 26, item 2: past PostgreSQL's tsvector limit (54000) the prune commit rolled
    back, and so did every later run."""
    await _append_and_compact(deps, "s1", {"read_log": _big_result()})
    assert await _pending(deps.store, "s1") == 0
    await _assert_found(deps.store, "s1", BIG_NEEDLE, 3, _big_result())


async def test_the_index_holds_a_bounded_text_per_original(deps: Deps) -> None:
    await _append_and_compact(deps, "s1")
    big = 3
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
        await _append_and_compact(d, "s1")
        assert await _pending(d.store, "s1") == 2
        # found by the scan of what is not indexed yet
        await _assert_found(d.store, "s1", BIG_NEEDLE, 3, _big_result())
        await _assert_found(d.store, "s1", NUL_NEEDLE, 5, _nul_result())
    config = _config(db_url)
    store = Store.from_url(db_url)
    try:
        assert await index_recall(store, config) == 2
        assert await _pending(store, "s1") == 0
        await _assert_found(store, "s1", BIG_NEEDLE, 3, _big_result())
        await _assert_found(store, "s1", NUL_NEEDLE, 5, _nul_result())
        assert await index_recall(store, config) == 0
    finally:
        await store.close()


async def test_a_busy_worker_indexes_once_its_runs_thin_out(db_url: str) -> None:
    """A worker's indexing defers to its runs: while half its task slots hold runs, what a run
    replaced stays pending (and is found by the scan); it is indexed when they are fewer."""
    async with open_deps(_config(db_url, concurrency=4), owner="busy-worker") as deps:
        deps.runs_in_flight = 2  # two other runs of the process's four slots in progress
        await _compact_in_background(deps, "s1", {"dump_blob": _nul_result()})
        assert deps.indexer is not None
        await asyncio.sleep(2.0)  # (indexing this one original takes a fraction of that)
        assert await _pending(deps.store, "s1") == 1
        await _assert_found(deps.store, "s1", NUL_NEEDLE, 3, _nul_result())
        deps.runs_in_flight = 1
        await _until_indexed(deps.store, "s1")
        await _assert_found(deps.store, "s1", NUL_NEEDLE, 3, _nul_result())


async def test_a_worker_that_stays_busy_indexes_at_the_bound(db_url: str) -> None:
    async with open_deps(_config(db_url, recall_index=False), owner="left-pending") as d:
        await _append_and_compact(d, "s1")  # its originals left pending
        indexer = BackgroundIndexer(d.store, busy=lambda: True, defer_s=1.5, recheck_s=0.05)
        try:
            indexer.add("s1")
            await asyncio.sleep(0.5)
            assert await _pending(d.store, "s1") == 2  # deferred: the process stays busy
            await _until_indexed(d.store, "s1", within_s=15.0)  # yet indexed at the bound
        finally:
            await indexer.aclose()
        await _assert_found(d.store, "s1", BIG_NEEDLE, 3, _big_result())


@pytest.mark.timed
@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
async def test_appends_do_not_wait_while_a_commit_prunes_ten_megabytes(
        db_url: str, cli_env: dict[str, str]) -> None:
    """Issue 26, item 3: the commit held the session's row while it indexed what it pruned
    (four 2.5 MB results: 3.6 s), and the agent's appends waited for it. A compaction runs in
    its own process (``compactd compact --inline``) while the agent appends."""
    store = Store.from_url(db_url)
    results = {f"read_log_{i}": access_log(2_500_000, seed=i) for i in range(4)}
    try:
        await store.create_session("s1", tenant="acme", context_window=10_000_000,
                                   policy=POLICY)
        await store.append("s1", [parse_openai(m) for m in _messages(results)])
        cli_env["COMPACTD_DATABASE_URL"] = db_url
        run = await asyncio.create_subprocess_exec(
            *compactd_cmd(), "compact", "s1", "--inline", "--json", env=cli_env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        waited: list[float] = []
        done = asyncio.create_task(run.communicate())
        n = 0
        while not done.done():
            started = time.perf_counter()
            await store.append("s1", [parse_openai({"role": "user", "content": f"step {n}"})])
            waited.append(time.perf_counter() - started)
            n += 1
            await asyncio.sleep(0.01)
        out, err = await done
        assert run.returncode == 0, err.decode()
        outcome = json.loads(out)
        assert (outcome["outcome"], outcome["pruned"]) == ("committed", 4), outcome
        assert max(waited) < 1.0, sorted(waited)[-5:]
        for i in range(4):
            found = await store.history_search("s1", f"ERR-{i}-lease-lost", tenant="acme")
            assert [h.seq for h in found.hits if h.exact] == [3 + 2 * i], found
    finally:
        await store.close()


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
async def test_pending_originals_are_no_entries_of_the_trigram_index(deps: Deps) -> None:
    """Revision 0017: the originals a commit records pending are not in the trigram GIN index,
    so no commit merges the index's pending list under its session's row; the searches still
    go through the index (each one's ILIKE implies the index's condition)."""
    await _append_and_compact(deps, "s1")
    async with deps.store.engine.connect() as conn:
        definition = (await conn.execute(sa.text(
            "SELECT indexdef FROM pg_indexes WHERE indexname = 'ix_recall_originals_trgm'"
        ))).scalar_one()
        assert definition.endswith("WHERE (body IS NOT NULL)"), definition
        # The searches' condition on the text, alone: nothing but the index can serve it
        # once a full scan is ruled out.
        await conn.execute(sa.text("SET LOCAL enable_seqscan = off"))
        plan = "\n".join(r[0] for r in (await conn.execute(sa.text(
            "EXPLAIN SELECT seq FROM recall_originals WHERE body ILIKE :pattern"),
            {"pattern": "%shard%"})).all())
        assert "ix_recall_originals_trgm" in plan, plan


# A session whose first compaction commits in its first round and fails in its second, the way
# tests/bench/recall.py's 10,000-message session did: a long history of tool steps with planted
# facts, then the latest user request (rescued, so it splits the head in two segments), one tool
# step, and the kept tail. The first round replaces the history; the second, the lone step
# between the request and the tail, whose summary (the local summarizer's eight sections) is
# longer than the step itself and is refused.
LONG_POLICY = {"trigger": [{"type": "tokens", "value": 2_000}],
               "keep": {"type": "messages", "value": 12}}
FILLER = ["ledger", "invoice", "currency", "rounding", "balance", "payload", "retry", "window"]
COLOURS = ["cobalt", "amber", "crimson", "ivory", "olive", "scarlet", "teal", "umber"]
CARGO = ["pallet", "crate", "container", "parcel", "drum", "carton", "barrel", "coil"]
PORTS = ["rotterdam", "antwerp", "hamburg", "valencia", "genoa", "gdansk", "piraeus", "lisbon"]
# The step between the latest request and the tail: what is left for a second round.
WORDS_BETWEEN = 140


def _tool_step(rng: random.Random, step: int, result: str = "", words: int = 60
               ) -> list[dict[str, Any]]:
    return [_call(f"q{step}", "query", f'{{"batch": {step}}}'),
            {"role": "tool", "tool_call_id": f"q{step}", "name": "query",
             "content": f"rows for batch {step}:\n"
                        + " ".join(rng.choice(FILLER) for _ in range(words)) + result}]


def _long_session(turns: int) -> tuple[list[dict[str, Any]], dict[int, str]]:
    """The messages (4 a turn, then 16 more), and each planted fact's message (its position
    from 1) with the words a model would search it by."""
    rng = random.Random(26)
    combos = iter(itertools.product(COLOURS, CARGO, PORTS))
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a fulfilment agent."}]
    facts: dict[int, str] = {}
    for turn in range(1, turns + 1):
        fact = ""
        if turn % 10 == 0:
            colour, cargo, port = next(combos)
            fact = (f"\nORD-{turn:06d}: the {colour} {cargo} bound for {port} was held at dock "
                    f"{turn % 97}")
            facts[len(messages) + 3] = f"{port} {cargo} {colour}"
        messages += [{"role": "user", "content": f"Check batch {turn}."},
                     *_tool_step(rng, turn, fact),
                     {"role": "assistant", "content": f"Batch {turn} checked."}]
    messages.append({"role": "user", "content": "Reconcile the last batches."})
    messages += _tool_step(rng, turns + 1, words=WORDS_BETWEEN)
    for step in range(turns + 2, turns + 8):
        messages += _tool_step(rng, step)
    return messages, facts


@pytest.mark.parametrize("in_background", [False, True], ids=["inline", "worker"])
async def test_a_run_that_fails_after_its_first_commit_has_its_history_indexed(
        db_url: str, in_background: bool, fake: FakeProvider,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """tests/bench/recall.py found none of 248 facts at 10,000 messages: the run committed
    its checkpoint, then failed, and only a committed run's replaces were indexed; searches
    scan only the newest pending originals, so the history was found by nothing but the sweep.
    """
    messages, facts = _long_session(500)
    # The first round's calls are answered; the second round's, which alone reads the step
    # after the latest request, are refused (400: no retry) with no local fallback, so the
    # second round fails after the first round's checkpoint committed.
    monkeypatch.setenv(FAKE_KEY_ENV, "fake-key")
    fake.script(Behaviour(model="fake-gpt"),
                Behaviour(model="fake-gpt", status=400, times=-1))
    config = build_config({"models": fake_models(fake.url), "default_model": "fake-gpt",
                           "summarization": {"strategy": "shrink",
                                             "trim_tokens_to_summarize": 100_000},
                           "worker": {"recall_index": True, "local_fallback": False}},
                          settings=Settings(database_url=db_url, broker_url="memory://"))
    async with open_deps(config, owner="fails-in-round-two") as deps:
        store = deps.store
        await store.create_session("s1", tenant="acme", context_window=128_000,
                                   policy=LONG_POLICY)
        appended = await store.append("s1", [parse_openai(m) for m in messages])
        seqs = range(appended.first_seq, appended.last_seq + 1)
        outcome = await compact(deps, "s1", trigger="pressure",
                                index_in_background=in_background)
        # The scenario: the first round's checkpoint committed, the second round failed.
        assert (outcome.outcome, outcome.failure_class) == (RunStatus.PARTIAL, "summary"), \
            outcome.to_json()
        assert len(outcome.replaced_seqs) > 1800, outcome.to_json()
        if in_background:
            await _until_indexed(store, "s1")
        # Every fact the committed round took off the surface is found by its words.
        replaced = set(outcome.replaced_seqs)
        taken = {p: w for p, w in facts.items() if seqs[p - 1] in replaced}
        assert len(taken) >= 45, len(taken)
        missed = []
        for position, words in taken.items():
            found = await store.history_search("s1", words, tenant="acme")
            if seqs[position - 1] not in [h.seq for h in found.hits[:5]]:
                missed.append(words)
        assert missed == [], f"{len(missed)} of {len(taken)} facts not found: {missed[:5]}"
