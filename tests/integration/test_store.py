"""The store against real PostgreSQL and the embedded SQLite: append, surface, replace, replay,
leases. Every test runs on both."""

from __future__ import annotations

import asyncio
import datetime as dt

import pytest

from compactd.storage.errors import (
    InvalidMessage,
    LeaseLost,
    SessionExists,
    SessionNotFound,
    SurfaceChanged,
)
from compactd.storage.kinds import NodeKind
from compactd.storage.messages import Message, parse_openai
from compactd.storage.records import Busy, Claim, Replacement, RunEnd
from compactd.storage.store import Store
from compactd.storage.surface import NewNode, surface_after_commit
from compactd.storage.tokens import counter_for
from tests.support.tables import row_counts

T0 = dt.datetime(2026, 11, 30, 12, 0, tzinfo=dt.UTC)


def user(text: str) -> Message:
    return parse_openai({"role": "user", "content": text})


def asst_call(*ids: str) -> Message:
    return parse_openai({"role": "assistant", "content": None, "tool_calls": [
        {"id": i, "type": "function", "function": {"name": "bash", "arguments": "{}"}}
        for i in ids]})


def result(cid: str, text: str = "ok") -> Message:
    return parse_openai({"role": "tool", "tool_call_id": cid, "name": "bash", "content": text})


async def seeded(store: Store, sid: str = "s1", n: int = 6) -> None:
    await store.create_session(sid, run_model="gpt-4o", context_window=128_000)
    await store.append(sid, [user(f"message {i}") for i in range(n)])


async def test_append_assigns_gapless_seqs_and_counts_tokens_once(store: Store) -> None:
    await store.create_session("s1", run_model="gpt-4o")
    msgs = [user("hello"), asst_call("c1", "c2"), result("c2", "x" * 50), result("c1")]
    r = await store.append("s1", msgs)
    assert (r.first_seq, r.last_seq, r.version) == (1, 4, 1)
    counter = counter_for("gpt-4o")
    assert r.tokens == tuple(counter.count_message(m) for m in msgs)
    r2 = await store.append("s1", [user("again")])
    assert (r2.first_seq, r2.last_seq, r2.version) == (5, 5, 2)
    surface = await store.read_surface("s1")
    assert surface.seqs == [1, 2, 3, 4, 5]
    assert surface.tokens == sum(r.tokens) + sum(r2.tokens) == r2.session.surface_tokens
    assert surface.nodes[1].message == msgs[1]
    assert (await store.verify("s1")).ok


async def test_rejected_batch_writes_nothing(store: Store) -> None:
    await store.create_session("s1")
    await store.append("s1", [asst_call("c1"), result("c1"), asst_call("c2")])
    before = await row_counts(store)
    info_before = await store.get_session("s1")
    for bad in ([user("fine"), result("nope")], [asst_call("c2")], [result("c1")],
                [result("c2"), result("c2")], [asst_call("c3"), result("c1")]):
        with pytest.raises(InvalidMessage):
            await store.append("s1", bad)
    assert await row_counts(store) == before
    assert await store.get_session("s1") == info_before


async def test_ids_reused_after_their_result_pair_with_the_nearest_call(store: Store) -> None:
    await store.create_session("s1")
    await store.append("s1", [asst_call("a"), result("a")])
    await store.append("s1", [asst_call("a")])
    await store.append("s1", [result("a"), asst_call("a"), result("a", "third")])
    with pytest.raises(InvalidMessage, match="already has a result"):
        await store.append("s1", [result("a")])
    assert (await store.verify("s1")).ok


@pytest.mark.parametrize(("batch", "index", "reason"), [
    (lambda: [user("ok"), result("ghost")], 1, "matches no earlier tool call"),
    (lambda: [asst_call("open1")], 0, "reused while its earlier call has no result"),
    (lambda: [result("done1")], 0, "already has a result"),
])
async def test_link_errors_name_the_message(store: Store, batch, index: int,  # type: ignore[no-untyped-def]
                                            reason: str) -> None:
    await store.create_session("s1")
    await store.append("s1", [asst_call("done1"), result("done1"), asst_call("open1")])
    with pytest.raises(InvalidMessage) as err:
        await store.append("s1", batch())
    assert err.value.index == index and reason in str(err.value)


async def test_unknown_session(store: Store) -> None:
    with pytest.raises(SessionNotFound):
        await store.append("ghost", [user("x")])
    with pytest.raises(SessionNotFound):
        await store.read_surface("ghost")
    with pytest.raises(SessionNotFound):
        await store.poll("ghost", 0)


async def test_create_session_is_idempotent_but_refuses_conflicts(store: Store) -> None:
    a = await store.create_session("s1", tenant="t1", run_model="gpt-4o")
    b = await store.create_session("s1", tenant="t1", run_model="gpt-4o",
                                   envelope={"system": "be brief", "tools": [{"name": "bash"}]})
    assert a.id == b.id and b.envelope_tokens > 0
    with pytest.raises(SessionExists, match="run_model"):
        await store.create_session("s1", tenant="t1", run_model="claude-3")
    with pytest.raises(SessionExists, match="tenant"):
        await store.create_session("s1", tenant="t2", run_model="gpt-4o")


async def test_poll_is_none_until_the_version_moves(store: Store) -> None:
    await seeded(store)
    v = await store.poll("s1", None)
    assert v == 1
    assert await store.poll("s1", v) is None
    await store.append("s1", [user("more")])
    assert await store.poll("s1", v) == 2


async def test_two_concurrent_writers_get_unique_gapless_seqs(db_url: str) -> None:
    stores = [Store.from_url(db_url), Store.from_url(db_url)]
    try:
        await stores[0].create_session("s1", run_model="gpt-4o")

        async def writer(st: Store, tag: str) -> list[int]:
            seqs = []
            for i in range(40):
                r = await st.append("s1", [user(f"{tag}{i}"), user(f"{tag}{i}b")])
                seqs.extend(range(r.first_seq, r.last_seq + 1))
            return seqs

        a, b = await asyncio.gather(writer(stores[0], "a"), writer(stores[1], "b"))
        assert sorted(a + b) == list(range(1, 161))
        surface = await stores[0].read_surface("s1")
        counter = counter_for("gpt-4o")
        assert surface.tokens == sum(counter.count_message(n.message) for n in surface.nodes)
        info = await stores[0].get_session("s1")
        assert (info.surface_tokens, info.surface_messages, info.last_seq) == (
            surface.tokens, 160, 160)
        assert (await stores[0].verify("s1")).ok
    finally:
        for st in stores:
            await st.close()


async def claim(store: Store, sid: str = "s1", owner: str = "w1", now: dt.datetime = T0,
                trigger: str = "manual") -> Claim:
    c = await store.claim(sid, owner=owner, trigger=trigger, lease_s=30, now=now)
    assert isinstance(c, Claim)
    return c


def checkpoint(seqs: tuple[int, ...], tokens: int = 7) -> Replacement:
    return Replacement(seqs=seqs, kind=NodeKind.CHECKPOINT, tokens=tokens,
                       payload={"role": "user", "content": "summary",
                                "meta": {"checkpoint": True, "summary": "summary"}},
                       journal_kind="compaction/summary", journal={"text": "summary"})


async def test_replace_and_replay(store: Store) -> None:
    await seeded(store)
    before = await store.read_surface("s1")
    c = await claim(store)
    expected = [(n.position, n.seq) for n in before.nodes[:4]]
    info = await store.commit("s1", run_id=c.run_id, fence=c.fence, expected=expected,
                              replacements=[checkpoint((2, 3, 4))],
                              end=RunEnd(outcome="committed", tokens_before=1, tokens_after=1),
                              now=T0)
    after = await store.read_surface("s1")
    assert [n.kind for n in after.nodes] == ["message", NodeKind.CHECKPOINT, "message", "message"]
    assert after.seqs[0] == 1 and after.seqs[2:] == [5, 6]
    assert after.nodes[1].position == before.nodes[1].position
    assert after.version == before.version + 1
    assert info.surface_tokens == after.tokens and info.lease_owner is None
    assert (await store.verify("s1")).ok
    kinds = [e.kind for e in await store.read_events("s1")]
    assert kinds[6:] == ["compaction/start", "compaction/summary", NodeKind.CHECKPOINT,
                         "compaction/end"]
    run = await store.get_run(c.run_id)
    assert run is not None and run.status == "committed"


async def test_a_second_checkpoint_merges_over_the_first(store: Store) -> None:
    await seeded(store, n=8)
    c = await claim(store)
    s = await store.read_surface("s1")
    await store.commit("s1", run_id=c.run_id, fence=c.fence,
                       expected=[(n.position, n.seq) for n in s.nodes[:3]],
                       replacements=[checkpoint((1, 2, 3))], end=RunEnd(outcome="committed"))
    s = await store.read_surface("s1")
    first = s.nodes[0].seq
    c = await claim(store)
    await store.commit("s1", run_id=c.run_id, fence=c.fence,
                       expected=[(n.position, n.seq) for n in s.nodes[:3]],
                       replacements=[checkpoint((first, 4, 5))], end=RunEnd(outcome="committed"))
    s = await store.read_surface("s1")
    assert [n.kind for n in s.nodes].count(NodeKind.CHECKPOINT) == 1
    assert s.seqs[1:] == [6, 7, 8]
    assert (await store.verify("s1")).ok


async def test_prune_replaces_one_node_and_keeps_its_place(store: Store) -> None:
    await store.create_session("s1", run_model="gpt-4o")
    await store.append("s1", [user("go"), asst_call("c1"), result("c1", "y" * 5000), user("ok")])
    c = await claim(store)
    pruned = result("c1", "y" * 10).model_copy(update={"meta": {"pruned": True}})
    rep = Replacement(seqs=(3,), kind=NodeKind.PRUNED, payload=pruned.to_payload(), tokens=9,
                      journal_kind="compaction/prune", journal={"tokens_before": 600,
                                                                "tokens_after": 9})
    await store.commit("s1", run_id=c.run_id, fence=c.fence, replacements=[rep])
    s = await store.read_surface("s1")
    assert s.nodes[2].kind == NodeKind.PRUNED and s.nodes[2].message.tool_call_id == "c1"
    assert s.nodes[2].tokens == 9
    # The lease is still held: the prune commit does not end the run.
    assert (await store.get_session("s1")).lease_run_id == c.run_id
    assert (await store.verify("s1")).ok


def pruned_result(cid: str, text: str) -> Message:
    return result(cid, text).model_copy(update={"meta": {"pruned": True}})


async def test_the_surface_after_a_commit_is_what_a_read_returns(store: Store) -> None:
    """The worker skips the read after its prune commit; what it computes instead must be
    exactly what the read would have returned, and it must give up when an append came in."""
    await store.create_session("s1", run_model="gpt-4o")
    await store.append("s1", [user("go"), asst_call("c1", "c2"), result("c1", "y" * 5000),
                              result("c2", "z" * 5000), user("ok")])
    c = await claim(store)
    before = await store.read_surface("s1")
    new = [NewNode((3,), NodeKind.PRUNED, pruned_result("c1", "y" * 10), 9),
           NewNode((4,), NodeKind.PRUNED, pruned_result("c2", "z" * 10), 8)]
    reps = [Replacement(seqs=n.replaces, kind=n.kind, payload=n.message.to_payload(),
                        tokens=n.tokens, journal_kind="compaction/prune") for n in new]
    info = await store.commit("s1", run_id=c.run_id, fence=c.fence, replacements=reps)
    computed = surface_after_commit(before, new, version=info.surface_version,
                                    last_seq=info.last_seq)
    assert computed == await store.read_surface("s1")
    assert computed is not None and [n.kind for n in computed.nodes][2:4] == [NodeKind.PRUNED] * 2

    # An append between the read and the commit: the computed surface would miss it.
    before = await store.read_surface("s1")
    await store.append("s1", [user("late")])
    new = [NewNode((5,), NodeKind.PRUNED, user("o"), 1)]
    info = await store.commit("s1", run_id=c.run_id, fence=c.fence, replacements=[
        Replacement(seqs=(5,), kind=NodeKind.PRUNED, payload=user("o").to_payload(), tokens=1,
                    journal_kind="compaction/prune")])
    assert surface_after_commit(before, new, version=info.surface_version,
                                last_seq=info.last_seq) is None


async def test_a_claim_of_a_free_session_writes_the_same_rows_on_both_databases(
        store: Store) -> None:
    """PostgreSQL claims a free session with one call of ``compactd_claim``; SQLite runs the
    general path. Both must leave exactly these rows."""
    await seeded(store)
    before = await store.get_session("s1")
    c = await store.claim("s1", owner="w1", trigger="pressure", lease_s=30, now=T0,
                          task_id="task-1")
    assert isinstance(c, Claim)
    assert c.fence == before.lease_fence + 1 and c.expires_at == T0 + dt.timedelta(seconds=30)
    info = await store.get_session("s1")
    assert info == c.session
    assert (info.lease_owner, info.lease_run_id, info.lease_expires_at, info.lease_fence,
            info.last_seq) == ("w1", c.run_id, c.expires_at, c.fence, before.last_seq + 1)
    assert (info.surface_version, info.surface_tokens) == (before.surface_version,
                                                           before.surface_tokens)
    start = (await store.read_events("s1"))[-1]
    assert (start.seq, start.kind, start.run_id, start.tokens, start.created_at) == (
        before.last_seq + 1, "compaction/start", c.run_id, None, T0)
    assert start.payload == {"run_id": c.run_id, "trigger": "pressure", "owner": "w1",
                             "fence": c.fence, "surface_version": before.surface_version}
    run = await store.get_run(c.run_id)
    assert run is not None
    assert (run.session_id, run.trigger, run.status, run.failure_class, run.owner, run.fence,
            run.task_id, run.bulk_job_id, run.surface_version_at_start, run.started_at,
            run.heartbeat_at, run.finished_at) == (
        "s1", "pressure", "running", None, "w1", c.fence, "task-1", None,
        before.surface_version, T0, T0, None)
    assert (await store.verify("s1")).ok
    with pytest.raises(SessionNotFound):
        await store.claim("ghost", owner="w1", trigger="pressure", lease_s=30, now=T0)


async def test_busy_when_leased(store: Store) -> None:
    await seeded(store)
    await claim(store)
    other = await store.claim("s1", owner="w2", trigger="pressure", lease_s=30,
                              now=T0 + dt.timedelta(seconds=5))
    assert isinstance(other, Busy) and other.holder == "w1"
    run = await store.get_run(other.run_id)
    assert run is not None and (run.status, run.failure_class) == ("failed", "busy")


async def test_fence_moves_on_expiry_and_the_old_owner_cannot_commit(store: Store) -> None:
    await seeded(store)
    old = await claim(store, owner="w1")
    s = await store.read_surface("s1")
    later = T0 + dt.timedelta(seconds=31)
    new = await claim(store, owner="w2", now=later)
    assert new.fence == old.fence + 1
    with pytest.raises(LeaseLost):
        await store.commit("s1", run_id=old.run_id, fence=old.fence,
                           replacements=[checkpoint((1, 2))],
                           expected=[(n.position, n.seq) for n in s.nodes[:2]])
    old_run = await store.get_run(old.run_id)
    assert old_run is not None and old_run.failure_class == "abandoned"
    assert await store.read_surface("s1") == s
    ends = [e for e in await store.read_events("s1") if e.kind == "compaction/end"]
    assert ends[0].payload["failure_class"] == "abandoned"


async def test_commit_refuses_a_changed_range_but_accepts_appends(store: Store) -> None:
    await seeded(store)
    s = await store.read_surface("s1")
    c = await claim(store)
    expected = [(n.position, n.seq) for n in s.nodes[:3]]
    await store.append("s1", [user("appended during the model call")])
    with pytest.raises(SurfaceChanged):
        await store.commit("s1", run_id=c.run_id, fence=c.fence, replacements=[checkpoint((1, 2))],
                           expected=[(1, 1), (2, 99)])
    info = await store.commit("s1", run_id=c.run_id, fence=c.fence,
                              replacements=[checkpoint((1, 2, 3))], expected=expected,
                              end=RunEnd(outcome="committed"))
    after = await store.read_surface("s1")
    assert after.seqs[-1] == 8 and after.nodes[-1].message.text == "appended during the model call"
    assert info.surface_messages == 5
    assert (await store.verify("s1")).ok
    # What the commit left, which the lead's growth is counted from (worker.compaction.lead).
    assert info.compacted_tokens == info.surface_tokens + info.envelope_tokens
    assert (await store.get_session("s1")).compacted_tokens == info.compacted_tokens


async def test_renew_and_finish(store: Store) -> None:
    await seeded(store)
    c = await claim(store)
    assert await store.renew("s1", run_id=c.run_id, fence=c.fence, lease_s=30,
                             now=T0 + dt.timedelta(seconds=20))
    info = await store.get_session("s1")
    assert info.lease_expires_at == T0 + dt.timedelta(seconds=50)
    assert await store.finish("s1", run_id=c.run_id, fence=c.fence,
                              end=RunEnd(outcome="failed", failure_class="summary",
                                         candidates=[{"model": "m", "reason": "whitespace"}]))
    run = await store.get_run(c.run_id)
    assert run is not None and run.failure_class == "summary" and run.candidates
    assert not await store.renew("s1", run_id=c.run_id, fence=c.fence, lease_s=30)


async def test_reaper_closes_expired_leases(store: Store) -> None:
    await seeded(store, "a")
    await seeded(store, "b")
    ca = await claim(store, "a")
    await claim(store, "b", now=T0 + dt.timedelta(seconds=100))
    reaped = await store.reap_expired(now=T0 + dt.timedelta(seconds=40))
    assert [r.session_id for r in reaped] == ["a"]
    run = await store.get_run(ca.run_id)
    assert run is not None and (run.status, run.failure_class) == ("failed", "abandoned")
    events = await store.read_events("a")
    assert [e.kind for e in events][-2:] == ["compaction/start", "compaction/end"]
    assert (await store.get_session("a")).lease_run_id is None
    assert (await store.verify("a")).ok


async def test_verify_detects_a_tampered_surface(db_url: str) -> None:
    import sqlalchemy as sa

    from compactd.storage import schema as t

    st = Store.from_url(db_url)
    try:
        await seeded(st)
        async with st.engine.begin() as conn:
            await conn.execute(t.surface.delete().where(t.surface.c.seq == 3))
        result = await st.verify("s1")
        assert not result.ok and any("seq 3" in p for p in result.problems)
        del sa
    finally:
        await st.close()


async def test_signal_mark_deduplicates(store: Store) -> None:
    await seeded(store)
    assert await store.mark_signal("s1", ttl_s=60, now=T0)
    assert not await store.mark_signal("s1", ttl_s=60, now=T0 + dt.timedelta(seconds=10))
    assert await store.mark_signal("s1", ttl_s=60, now=T0 + dt.timedelta(seconds=61))
    cleared = await store.clear_signal("s1")
    assert cleared is not None and cleared.signal_at is None
    assert (await store.get_session("s1")).signal_at is None
    assert await store.mark_signal("s1", ttl_s=60, now=T0 + dt.timedelta(seconds=62))
    with pytest.raises(SessionNotFound):
        await store.mark_signal("ghost", ttl_s=60)
    assert await store.clear_signal("ghost") is None


async def test_an_append_over_the_trigger_sets_the_signal_mark_once(store: Store) -> None:
    await seeded(store)
    r = await store.append("s1", [user("x")], now=T0, signal_if=lambda s: s.surface_messages > 5)
    assert r.signalled
    r = await store.append("s1", [user("y")], now=T0, signal_if=lambda s: True)
    assert not r.signalled  # already pending


async def test_report_usage_is_cleared_by_a_commit(store: Store) -> None:
    await seeded(store)
    info = await store.report_usage("s1", 12345)
    assert info.reported_input_tokens == 12345
    with pytest.raises(InvalidMessage):
        await store.report_usage("s1", -1)
    c = await claim(store)
    s = await store.read_surface("s1")
    info = await store.commit("s1", run_id=c.run_id, fence=c.fence,
                              replacements=[checkpoint((1, 2))],
                              expected=[(n.position, n.seq) for n in s.nodes[:2]],
                              end=RunEnd(outcome="committed"))
    assert info.reported_input_tokens is None


async def test_a_naive_time_is_refused_on_both_backends_and_the_loop_guard_read(
        store: Store) -> None:
    """On PostgreSQL the loop guard's read goes around SQLAlchemy's UTC type, which refuses
    naive datetimes; asyncpg alone would read one as the server's local time."""
    await seeded(store)
    naive = dt.datetime(2026, 1, 1, 12, 0)
    for kwargs in ({}, {"session_id": "s1", "status": "committed"}):
        with pytest.raises(ValueError, match="naive datetime"):
            await store.recent_runs(since=naive, **kwargs)  # type: ignore[arg-type]
        assert await store.recent_runs(since=naive.replace(tzinfo=dt.UTC), **kwargs) == []
