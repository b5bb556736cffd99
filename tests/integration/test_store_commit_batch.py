"""The compaction hot path in storage, on PostgreSQL and SQLite: many replacements in one commit
(a prune commit names every large tool result), and re-reading a surface from an earlier read."""

from __future__ import annotations

import pytest

from compactd.storage.errors import LeaseLost, SessionNotFound, SurfaceChanged
from compactd.storage.kinds import NodeKind
from compactd.storage.messages import Message, parse_openai
from compactd.storage.records import Claim, Replacement, RunEnd
from compactd.storage.store import Store


def user(text: str) -> Message:
    return parse_openai({"role": "user", "content": text})


def call(cid: str) -> Message:
    return parse_openai({"role": "assistant", "content": None, "tool_calls": [
        {"id": cid, "type": "function", "function": {"name": "bash", "arguments": "{}"}}]})


def result(cid: str, text: str) -> Message:
    return parse_openai({"role": "tool", "tool_call_id": cid, "name": "bash", "content": text})


def pruned(seq: int, cid: str) -> Replacement:
    message = result(cid, "cut").model_copy(update={"meta": {"pruned": True}})
    return Replacement(seqs=(seq,), kind=NodeKind.PRUNED, payload=message.to_payload(), tokens=5,
                       journal_kind="compaction/prune", journal={"seq": seq})


def checkpoint(seqs: tuple[int, ...]) -> Replacement:
    message = user("summary").model_copy(update={"meta": {"checkpoint": True}})
    return Replacement(seqs=seqs, kind=NodeKind.CHECKPOINT, payload=message.to_payload(),
                       tokens=7, journal_kind="compaction/summary", journal={"text": "summary"})


async def session(store: Store) -> Claim:
    await store.create_session("s1", run_model="gpt-4o")
    await store.append("s1", [user("go"), call("a"), result("a", "x" * 4000), call("b"),
                              result("b", "y" * 4000), call("c"), result("c", "z" * 4000),
                              user("next")])
    claimed = await store.claim("s1", owner="w1", trigger="pressure", lease_s=30)
    assert isinstance(claimed, Claim)
    return claimed


async def test_many_replacements_commit_as_one_at_a_time_would(store: Store) -> None:
    c = await session(store)
    info = await store.commit("s1", run_id=c.run_id, fence=c.fence,
                              replacements=[pruned(3, "a"), pruned(5, "b"), pruned(7, "c")])
    s = await store.read_surface("s1")
    # Each replacement journals, then adds its node: seqs interleave exactly as before.
    assert s.seqs == [1, 2, 11, 4, 13, 6, 15, 8]
    assert [n.kind for n in s.nodes].count(NodeKind.PRUNED) == 3
    events = await store.read_events("s1", after_seq=9)
    assert [(e.seq, e.kind) for e in events] == [
        (10, "compaction/prune"), (11, NodeKind.PRUNED), (12, "compaction/prune"),
        (13, NodeKind.PRUNED), (14, "compaction/prune"), (15, NodeKind.PRUNED)]
    assert events[0].payload["replaced_seqs"] == [3]
    assert info.surface_tokens == s.tokens and info.surface_messages == 8
    assert (await store.verify("s1")).ok


async def test_a_replacement_that_is_not_contiguous_changes_nothing(store: Store) -> None:
    c = await session(store)
    before = await store.read_surface("s1")
    info_before = await store.get_session("s1")
    # PostgreSQL checks these inside compactd_commit, SQLite in Python: the same words.
    for bad, problem in (([checkpoint((1, 3))], r"seqs \[1, 3\] .* one contiguous run"),
                         ([checkpoint((3, 2))], r"seqs \[3, 2\] .* in that order"),
                         ([pruned(3, "a"), checkpoint((99,))], r"seqs \[99\] .* in that order")):
        with pytest.raises(SurfaceChanged, match=problem):
            await store.commit("s1", run_id=c.run_id, fence=c.fence, replacements=bad,
                               end=RunEnd(outcome="committed"))
    with pytest.raises(SurfaceChanged, match="changed under run"):
        await store.commit("s1", run_id=c.run_id, fence=c.fence,
                           replacements=[checkpoint((1, 2))], expected=[(1, 1), (2, 3)])
    with pytest.raises(LeaseLost, match=f"fence {c.fence + 1}, now {c.fence}"):
        await store.commit("s1", run_id=c.run_id, fence=c.fence + 1,
                           replacements=[checkpoint((1, 2))])
    with pytest.raises(SessionNotFound):
        await store.commit("ghost", run_id=c.run_id, fence=c.fence, replacements=[])
    # With the prefix the plan read, as the worker's checkpoint commits pass it: same words.
    prefix = [(n.position, n.seq) for n in before.nodes]
    for bad, problem in (([checkpoint((1, 3))], r"seqs \[1, 3\] .* one contiguous run"),
                         ([checkpoint((3, 2))], r"seqs \[3, 2\] .* in that order")):
        with pytest.raises(SurfaceChanged, match=problem):
            await store.commit("s1", run_id=c.run_id, fence=c.fence, replacements=bad,
                               expected=prefix, end=RunEnd(outcome="committed"))
    with pytest.raises(ValueError, match="at least one seq"):
        await store.commit("s1", run_id=c.run_id, fence=c.fence, replacements=[checkpoint(())])
    with pytest.raises(ValueError, match="more than one"):
        await store.commit("s1", run_id=c.run_id, fence=c.fence,
                           replacements=[pruned(3, "a"), checkpoint((2, 3))])
    assert await store.read_surface("s1") == before
    assert await store.get_session("s1") == info_before
    run = await store.get_run(c.run_id)
    assert run is not None and run.status == "running"
    assert (await store.verify("s1")).ok


async def test_reread_with_an_earlier_read_equals_a_fresh_read(store: Store) -> None:
    c = await session(store)
    first = await store.read_surface("s1")
    await store.commit("s1", run_id=c.run_id, fence=c.fence,
                       replacements=[pruned(3, "a"), pruned(5, "b")])
    await store.append("s1", [user("appended meanwhile")])
    await store.commit("s1", run_id=c.run_id, fence=c.fence,
                       replacements=[checkpoint((1, 2, 11))], end=RunEnd(outcome="committed"))
    again = await store.read_surface("s1", reuse=first)
    assert again == await store.read_surface("s1")
    # Nodes that were on the first read are the same objects: their payloads were not decoded.
    kept = {n.seq: n for n in first.nodes}
    assert all(n is kept[n.seq] for n in again.nodes if n.seq in kept)
    assert again.nodes[-1].message.text == "appended meanwhile"
