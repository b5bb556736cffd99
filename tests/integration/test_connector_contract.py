"""The two connectors hold one contract: the same inputs through PostgreSQL's implementation (its
SQL functions) and SQLite's (the general statements) give the same results. One script of
appends, claims and commits, and of word searches, runs on a store of each backend; what each
call returned, what the store then holds, and the order of each search's hits are compared
whole. Run ids are the only values generated inside a call; they are named by order of
appearance before comparing. Floats (the growth rate) agree to a millionth."""

from __future__ import annotations

import dataclasses
import datetime as dt
import math
import re
from typing import Any

import pytest

from compactd.storage.errors import CompactdError
from compactd.storage.kinds import NodeKind
from compactd.storage.messages import Message, parse_openai
from compactd.storage.records import Claim, Replacement, RunEnd
from compactd.storage.store import Store

T0 = dt.datetime(2026, 12, 6, 8, 0, tzinfo=dt.UTC)
RUN_ID = re.compile(r"\b[0-9a-f]{32}\b")
# Each holds some of the words the queries below rank by, in different numbers.
ORIGINALS = (
    "The volume hit its quota at 02:14, so the nightly backup stopped with an error.",
    "job 4: the volume was mounted read-only; quota fine",
    "job 5: error in step 5, retry scheduled",
    "Die Datei ist zu groß: Übergröße beim Upload des Archivs, Abbruch.",
    "job 6: error in step 6, retry scheduled after the backup",
    "nightly report: no error, the volume quota holds",
)
QUERIES = ("volume quota error", "backup quota", "error retry volume", "Übergröße upload",
           "nightly error", "quota", "job error", "scheduled retry backup")


def at(seconds: float) -> dt.datetime:
    return T0 + dt.timedelta(seconds=seconds)


def messages() -> list[Message]:
    out = [parse_openai({"role": "user", "content": "Why did the nightly backup stop?"}),
           parse_openai({"role": "assistant", "content": None, "tool_calls": [
               {"id": "call_1", "type": "function",
                "function": {"name": "read_log", "arguments": '{"path": "/var/log/backup"}'}}]}),
           parse_openai({"role": "tool", "tool_call_id": "call_1", "content": ORIGINALS[0]})]
    out += [parse_openai({"role": "assistant" if i % 2 else "user", "content": text})
            for i, text in enumerate(ORIGINALS[1:])]
    return out


def checkpoint(seqs: tuple[int, ...], text: str) -> Replacement:
    return Replacement(seqs=seqs, kind=NodeKind.CHECKPOINT, tokens=11,
                       payload={"role": "user", "content": text,
                                "meta": {"checkpoint": True, "summary": text}},
                       journal_kind="compaction/summary", journal={"text": text})


async def outcome(call: Any) -> Any:
    """What a call returned, or the compactd error it raised (its class and words)."""
    try:
        return await call
    except CompactdError as exc:
        return (type(exc).__name__, str(exc))


async def script(store: Store) -> dict[str, Any]:
    """Every result of one script of appends, claims, commits and searches, and what the store
    holds at the end."""
    seen: dict[str, Any] = {}
    await store.create_session("s1", run_model="gpt-4o", context_window=8_000, now=at(0))
    seen["append"] = await store.append("s1", messages(), now=at(1))
    # Over the trigger: the first append sets the pending-signal mark, the next finds it live.
    seen["append_signalled"] = await store.append(
        "s1", [parse_openai({"role": "user", "content": "Summarize the failures."})],
        now=at(4), signal_if=lambda info: True, signal_ttl_s=60.0)
    seen["append_mark_live"] = await store.append(
        "s1", [parse_openai({"role": "assistant", "content": "Looking."})], now=at(5),
        signal_if=lambda info: True, signal_ttl_s=60.0)
    seen["append_orphan"] = await outcome(store.append("s1", [parse_openai(
        {"role": "tool", "tool_call_id": "call_9", "content": "late"})], now=at(6)))
    seen["append_missing"] = await outcome(store.append("nope", messages()[:1], now=at(6)))

    claim = await store.claim("s1", owner="w1", trigger="pressure", lease_s=30, now=at(10))
    assert isinstance(claim, Claim)
    seen["claim"] = claim
    seen["busy"] = await store.claim("s1", owner="w2", trigger="pressure", lease_s=30,
                                     now=at(11))
    seen["claim_missing"] = await outcome(store.claim("nope", owner="w1", trigger="pressure",
                                                      lease_s=30, now=at(11)))
    surface = await store.read_surface("s1")
    expected = [(n.position, n.seq) for n in surface.nodes[:5]]
    run, fence = claim.run_id, claim.fence
    seen["commit_lost"] = await outcome(store.commit(
        "s1", run_id=run, fence=fence + 1, replacements=[checkpoint((1, 2, 3), "one")],
        expected=expected, now=at(12)))
    seen["commit_prefix"] = await outcome(store.commit(
        "s1", run_id=run, fence=fence, replacements=[checkpoint((1, 2, 3), "one")],
        expected=[(1, 1), (2, 3)], now=at(12)))
    seen["commit_refused"] = await outcome(store.commit(
        "s1", run_id=run, fence=fence, replacements=[checkpoint((1, 3), "one")],
        expected=expected, now=at(12)))
    seen["commit"] = await store.commit(
        "s1", run_id=run, fence=fence, now=at(13), expected=expected,
        replacements=[checkpoint((1, 2, 3), "backup summary"), checkpoint((4, 5), "jobs")],
        end=RunEnd(outcome="committed", tokens_before=200, tokens_after=50,
                   model="gpt-4o", usage={"input_tokens": 3}, range_seqs=[1, 5]))
    # A lease past its expiry: the next claim closes it first, the commit without an end keeps
    # the lease, and a later claim finds it live.
    second = await store.claim("s1", owner="w3", trigger="manual", lease_s=5, now=at(20))
    assert isinstance(second, Claim)
    seen["claim_expired"] = await store.claim("s1", owner="w4", trigger="manual", lease_s=30,
                                              now=at(40))
    seen["commit_after_reclaim"] = await outcome(store.commit(
        "s1", run_id=second.run_id, fence=second.fence, now=at(41),
        replacements=[checkpoint((6, 7), "late")]))
    third = seen["claim_expired"]
    assert isinstance(third, Claim)
    seen["commit_no_end"] = await store.commit(
        "s1", run_id=third.run_id, fence=third.fence, now=at(42),
        replacements=[checkpoint((6, 7), "upload and nightly")])

    await store.index_recall("s1")
    seen["searches"] = {q: [(h.checkpoint, h.seq, h.exact) for h in
                            (await store.history_search("s1", q, limit=20)).hits]
                        for q in QUERIES}
    seen["events"] = [(e.seq, e.kind, e.payload, e.tokens, e.run_id is not None, e.created_at)
                      for e in await store.read_events("s1")]
    seen["surface"] = [(n.seq, n.kind, n.position, n.tokens, n.message.to_payload())
                       for n in (await store.read_surface("s1")).nodes]
    seen["session"] = await store.get_session("s1")
    seen["verify"] = await store.verify("s1")
    return seen


def normal(value: Any, runs: dict[str, str]) -> Any:
    """``value`` as plain data, run ids named by order of appearance."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: normal(getattr(value, f.name), runs) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {normal(k, runs): normal(v, runs) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [normal(v, runs) for v in value]
    if isinstance(value, str):
        return RUN_ID.sub(lambda m: runs.setdefault(m.group(0), f"run{len(runs)}"), value)
    return value


@pytest.fixture
async def both(clean_pg: str, sqlite_url: str) -> Any:
    stores = Store.from_url(clean_pg), Store.from_url(sqlite_url)
    yield stores
    for s in stores:
        await s.close()


async def test_postgres_and_sqlite_return_and_store_the_same(both: tuple[Store, Store]) -> None:
    pg, lite = [normal(await script(store), {}) for store in both]
    assert pg["verify"]["ok"], pg["verify"]
    assert pg["append_signalled"]["signalled"] and not pg["append_mark_live"]["signalled"]
    assert pg["busy"]["holder"] == "w1" and pg["commit_lost"][0] == "LeaseLost"
    assert any(not exact for hits in pg["searches"].values() for _, _, exact in hits)
    found = differences(lite, pg)
    assert not found, "\n".join(found)


def differences(a: Any, b: Any, path: str = "") -> list[str]:
    """Where ``a`` and ``b`` differ, path by path (``a`` SQLite's, ``b`` PostgreSQL's)."""
    if isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys():
        return [d for k in a for d in differences(a[k], b[k], f"{path}/{k}")]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True))
                for d in differences(x, y, f"{path}[{i}]")]
    if isinstance(a, float) and isinstance(b, float):
        # The growth rate's seconds since the last append are julianday differences on SQLite
        # (a double of days since 4713 BC), exact to well under a millisecond, not a microsecond.
        same = math.isclose(a, b, rel_tol=1e-6)
    else:
        same = a == b
    return [] if same else [f"{path}: sqlite {a!r} != postgres {b!r}"]
