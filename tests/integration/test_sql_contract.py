"""Every named query of storage/sql runs, on both backends or, when it says why, on one alone;
each case checks what the query returns or changes, through the store's connector."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import sqlalchemy as sa

from compactd.storage import schema as t
from compactd.storage import sql
from compactd.storage.database import transaction
from compactd.storage.events import commit_event_fields
from compactd.storage.kinds import JournalKind, NodeKind
from compactd.storage.migrate import HEAD_REVISION
from compactd.storage.records import Claim, Replacement, RunEnd, utcnow
from compactd.storage.store import Store
from tests.support.surfaces import user

Case = Callable[[Store], Awaitable[None]]
CASES: dict[str, Case] = {}
HOUR = dt.timedelta(hours=1)


def case(name: str) -> Callable[[Case], Case]:
    def register(fn: Case) -> Case:
        CASES[name] = fn
        return fn
    return register


@case("ping")
async def _ping(store: Store) -> None:
    assert await store.db.fetchval("ping") == 1


@case("schema_revision")
async def _schema_revision(store: Store) -> None:
    assert await store.db.fetchval("schema_revision") == HEAD_REVISION


@case("invalid_index")
async def _invalid_index(store: Store) -> None:
    name = "ix_sessions_over_trigger"
    assert await store.db.fetchval("invalid_index", index_name=name) is None  # valid
    assert await store.db.fetchval("invalid_index", index_name="no_such_index") is None
    # What a failed CREATE INDEX CONCURRENTLY leaves behind: the index, marked not valid.
    async with transaction(store.engine) as conn:
        await conn.execute(sa.text(
            "UPDATE pg_index SET indisvalid = false WHERE indexrelid = CAST(:name AS regclass)"),
            {"name": name})
    assert await store.db.fetchval("invalid_index", index_name=name) == 1


@case("read_surface")
async def _read_surface(store: Store) -> None:
    rows = await store.db.fetch("read_surface", session_id="s1")
    assert [(r["surface_version"], r["position"], r["seq"], r["kind"]) for r in rows] == [
        (1, 1, 1, "message"), (1, 2, 2, "message")]
    assert rows[1]["payload"]["content"] == "b"
    await store.create_session("empty")
    empty = await store.db.fetch("read_surface", session_id="empty")
    assert [(r["surface_version"], r["seq"]) for r in empty] == [(0, None)]
    assert await store.db.fetch("read_surface", session_id="ghost") == []


@case("poll")
async def _poll(store: Store) -> None:
    assert await store.db.fetchval("poll", session_id="s1") == 1
    assert await store.db.fetchval("poll", session_id="ghost") is None


@case("recent_messages")
async def _recent_messages(store: Store) -> None:
    # A run's journal event between the appends (the claim writes one): not a message.
    assert isinstance(await store.claim("s1", owner="w", trigger="pressure", lease_s=60), Claim)
    first, second = utcnow() + dt.timedelta(seconds=1), utcnow() + dt.timedelta(seconds=2)
    await store.append("s1", [user("c"), user("d")], now=first)
    await store.append("s1", [user("e")], now=second)
    rows = await store.db.fetch("recent_messages", session_id="s1", limit=3)
    # Newest first; the messages of one append carry its time.
    assert [(r["seq"], r["created_at"]) for r in rows] == [(6, second), (5, first), (4, first)]
    assert all(isinstance(r["tokens"], int) and r["tokens"] > 0 for r in rows)
    appended = await store.recent_messages("s1", limit=10)
    assert [m.seq for m in appended] == [1, 2, 4, 5, 6]
    assert appended[0].at == appended[1].at < first
    assert await store.db.fetch("recent_messages", session_id="ghost", limit=3) == []


@case("mark_signal")
async def _mark_signal(store: Store) -> None:
    now = utcnow()
    assert await store.db.execute("mark_signal", session_id="s1", now=now,
                                  stale_before=now - HOUR) == 1
    assert await store.db.execute("mark_signal", session_id="s1", now=now,
                                  stale_before=now - HOUR) == 0  # a live mark
    assert await store.db.execute("mark_signal", session_id="s1", now=now + HOUR,
                                  stale_before=now) == 1  # a stale one is taken over
    assert (await store.get_session("s1")).signal_at == now + HOUR


@case("clear_signal")
async def _clear_signal(store: Store) -> None:
    await store.mark_signal("s1", ttl_s=60)
    row = await store.db.fetchrow("clear_signal", session_id="s1")
    assert row is not None and row["id"] == "s1" and row["signal_at"] is None
    assert (await store.get_session("s1")).signal_at is None
    assert await store.db.fetchrow("clear_signal", session_id="ghost") is None


@case("report_usage")
async def _report_usage(store: Store) -> None:
    def report(surface_version: int | None) -> Awaitable[Any]:
        return store.db.fetchrow("report_usage", session_id="s1", input_tokens=900,
                                 output_tokens=40, unappended_tokens=40,
                                 surface_version=surface_version)

    row = await report(None)
    info = await store.get_session("s1")
    assert row is not None and row["id"] == "s1" and row["reported_version"] == 1
    assert (info.reported_input_tokens, info.reported_output_tokens) == (900, 40)
    assert info.reported_base_tokens == info.surface_tokens + info.envelope_tokens + 40
    assert await report(1) is not None  # built on the surface as it is
    assert await report(2) is None  # a version the session has not reached
    async with transaction(store.engine) as conn:
        await conn.execute(sa.update(t.sessions).where(t.sessions.c.id == "s1")
                           .values(compacted_version=1, surface_version=2))
    assert await report(0) is None  # built before a compaction
    assert await report(1) is not None  # on the compaction's own surface
    assert await store.db.fetchrow("report_usage", session_id="ghost", input_tokens=1,
                                   output_tokens=0, unappended_tokens=0,
                                   surface_version=None) is None


@case("session_runs")
async def _session_runs(store: Store) -> None:
    now = utcnow()
    claim = await store.claim("s1", owner="w", trigger="manual", lease_s=60, now=now)
    rows = await store.db.fetch("session_runs", session_id="s1", status="running",
                                since=now - HOUR, limit=10)
    assert [r["id"] for r in rows] == [claim.run_id]  # type: ignore[union-attr]
    assert rows[0]["started_at"] == now
    assert await store.db.fetch("session_runs", session_id="s1", status="running",
                                since=now + HOUR, limit=10) == []


async def _ended_run(store: Store, session_id: str, start: dt.datetime, seconds: float,
                     model: str | None, outcome: str = "committed",
                     stages: dict[str, Any] | None = None) -> None:
    claim = await store.claim(session_id, owner="w", trigger="pressure", lease_s=600, now=start)
    assert isinstance(claim, Claim)
    assert await store.finish(session_id, run_id=claim.run_id, fence=claim.fence,
                              end=RunEnd(outcome=outcome, model=model, stages=stages),
                              now=start + dt.timedelta(seconds=seconds))


async def _recent_summary_runs(store: Store) -> None:
    now = utcnow()
    await _ended_run(store, "s1", now - 3 * HOUR, 9.0, "m")  # too old
    await _ended_run(store, "s1", now - dt.timedelta(seconds=60), 2.5, "m")
    await _ended_run(store, "s1", now - dt.timedelta(seconds=50), 1.0, None)  # a prune only
    await _ended_run(store, "s1", now - dt.timedelta(seconds=40), 7.0, "m", "failed")
    await _ended_run(store, "s1", now - dt.timedelta(seconds=30), 4.0, "other")
    # Two rounds: its first checkpoint was committed 1.5 s after the claim.
    await _ended_run(store, "s1", now - dt.timedelta(seconds=20), 3.0, "m",
                     stages={"rounds": 2, "claim_to_commit_s": 1.5})
    # Committed its first round's checkpoint 0.5 s after the claim, then failed.
    await _ended_run(store, "s1", now - dt.timedelta(seconds=10), 6.0, "m", "partial",
                     stages={"stages": ["summary"], "claim_to_commit_s": 0.5})
    rows = await store.db.recent_summary_runs(["committed"], since=now - HOUR, limit=10)
    assert [(r["model"], (r["finished_at"] - r["started_at"]).total_seconds())
            for r in rows] == [("m", 3.0), ("other", 4.0), ("m", 2.5)]
    assert rows[0]["stages"]["claim_to_commit_s"] == 1.5
    # Several statuses in one statement, newest first across them, at most :limit in all.
    both = await store.db.recent_summary_runs(["committed", "partial"], since=now - HOUR,
                                              limit=10)
    assert [(r["status"], r["model"]) for r in both] == [
        ("partial", "m"), ("committed", "m"), ("committed", "other"), ("committed", "m")]
    assert [r["status"] for r in await store.db.recent_summary_runs(
        ["committed", "partial"], since=now - HOUR, limit=2)] == ["partial", "committed"]
    assert await store.db.recent_summary_runs([], since=now - HOUR, limit=10) == []
    # The store's reading: the model's own, else every model's; the first commit where known.
    assert await store.claim_to_commit_durations("m", since=now - HOUR) == [0.5, 1.5, 2.5]
    assert await store.claim_to_commit_durations("renamed", since=now - HOUR) == [
        0.5, 1.5, 4.0, 2.5]
    assert await store.claim_to_commit_durations("m", since=now) == []


for _suffix in ("pg", "sqlite"):
    case(f"recent_summary_runs_{_suffix}")(_recent_summary_runs)


@case("append")
async def _append(store: Store) -> None:
    now = utcnow()
    batch = {"session_id": "s1", "payloads": [json.dumps({"role": "user", "content": "c"})],
             "tokens": [5], "now": now, "call_ids": [], "call_idx": [], "call_result_idx": [],
             "ext_ids": [], "ext_idx": [], "counts": [json.dumps({"turns": 1})],
             "counts_sum": json.dumps({"turns": 1})}
    row = await store.db.fetchrow("append", **batch, key=None, request_sha256=None,
                                  key_live_after=None)
    assert row is not None and (row["last_seq"], row["surface_messages"]) == (3, 3)
    assert row["key_request_sha256"] is None
    # The counters kept by name, summed onto the session.
    assert (row["counts"], row["over_counts"]) == ({"turns": 1}, False)
    # With a key: appended and recorded, then answered from the key's row.
    keyed = {**batch, "key": "k", "request_sha256": "a" * 64, "key_live_after": now - HOUR}
    row = await store.db.fetchrow("append", **keyed)
    assert row is not None and (row["last_seq"], row["key_request_sha256"]) == (4, None)
    row = await store.db.fetchrow("append", **keyed)
    assert row is not None and (row["last_seq"], row["surface_messages"]) == (4, 4)
    assert (row["key_request_sha256"], row["key_first_seq"], row["key_last_seq"],
            row["key_surface_messages"]) == ("a" * 64, 4, 4, 4)


def _key_row(now: dt.datetime, digest: str, version: int) -> dict[str, Any]:
    return {"session_id": "s1", "key": "k", "request_sha256": digest, "first_seq": 1,
            "last_seq": 2, "surface_version": version, "surface_tokens": 9,
            "surface_messages": 2, "now": now, "live_after": now - HOUR}


@case("append_key_store")
async def _append_key_store(store: Store) -> None:
    now = utcnow()
    assert await store.db.fetchval("append_key_store", **_key_row(now, "a" * 64, 1)) == 1
    # a live row is left as it is; an expired one is taken over
    assert await store.db.fetchval("append_key_store",
                                   **_key_row(now + HOUR / 2, "b" * 64, 2)) is None
    assert await store.db.fetchval("append_key_store",
                                   **_key_row(now + 2 * HOUR, "c" * 64, 3)) == 1
    row = await store.db.fetchrow("append_key_find", session_id="s1", key="k",
                                  live_after=now)
    assert row is not None
    assert (row["key_request_sha256"], row["key_surface_version"]) == ("c" * 64, 3)


@case("append_key_find")
async def _append_key_find(store: Store) -> None:
    now = utcnow()
    await store.db.execute("append_key_store", **_key_row(now, "a" * 64, 7))
    row = await store.db.fetchrow("append_key_find", session_id="s1", key="k",
                                  live_after=now - HOUR)
    assert row is not None
    assert (row["key_first_seq"], row["key_last_seq"], row["key_surface_version"],
            row["key_surface_tokens"], row["key_surface_messages"]) == (1, 2, 7, 9, 2)
    # beside the session's row, typed as the session's columns are
    assert row["id"] == "s1" and row["created_at"].tzinfo is not None
    for gone in ({"key": "other", "live_after": now - HOUR},
                 {"key": "k", "live_after": now}):
        assert await store.db.fetchrow("append_key_find", session_id="s1", **gone) is None


async def _claimed(store: Store) -> dict[str, Any]:
    now = utcnow()
    row = await store.db.fetchrow("claim_free", session_id="s1", run_id="r1", owner="w",
                                  trigger="manual", expires=now + HOUR, now=now, task_id=None)
    assert row is not None and (row["lease_run_id"], row["lease_fence"]) == ("r1", 1)
    return {"session_id": "s1", "run_id": "r1", "fence": 1, "now": now}


@case("claim_free")
async def _claim_free(store: Store) -> None:
    await _claimed(store)
    run = await store.get_run("r1")
    assert run is not None and run.status == "running"


def _prune_of_seq_1() -> dict[str, Any]:
    return {"seqs": [1], "counts": [1], "kinds": [NodeKind.PRUNED],
            "payloads": [json.dumps({"message": {"role": "user", "content": "[pruned]"},
                                     "replaces": [1], "run_id": "r1"})],
            "tokens": [1], "journal_kinds": [JournalKind.PRUNE],
            "journals": [json.dumps({"run_id": "r1", "replaced_seqs": [1]})],
            "expected_pos": [1], "expected_seq": [1], "before": None, "after": None,
            "refs": ["r1"], "firsts": [1], "lasts": [1],
            "node_counts": [json.dumps({"turns": 2})], "keeps": None, "keep_counts": None}


@case("commit")
async def _commit(store: Store) -> None:
    lease = await _claimed(store)
    row = await store.db.fetchrow("commit", **lease, **_prune_of_seq_1(), end_payload=None,
                                  event=commit_event_fields("s1", "r1", "running"))
    assert row is not None and row["lease_run_id"] == "r1" and row["surface_version"] == 2
    # The counters kept by name, summed again from the surface rows with the new node's.
    assert row["counts"] == {"turns": 2}
    assert (await store.read_surface("s1")).nodes[0].kind == NodeKind.PRUNED
    # the node recorded for recall by the name and span the caller stated, its original pending
    row = await store.db.fetchrow("history_node", session_id="s1", ref="r1")
    assert row is not None and (row["first_seq"], row["last_seq"]) == (1, 1)
    assert [r["seq"] for r in await store.db.fetch("recall_pending_originals", session_id="s1",
                                                   limit=5)] == [1]


SIGNALLED_AT = dt.datetime(2026, 12, 6, 4, 0, tzinfo=dt.UTC)


@case("commit_ending")
async def _commit_ending(store: Store) -> None:
    lease = await _claimed(store)
    row = await store.db.fetchrow(
        "commit_ending", **lease, **_prune_of_seq_1(),
        end_payload=json.dumps({"run_id": "r1", "outcome": "succeeded"}), status="succeeded",
        failure_class=None, error=None, tokens_before=10, tokens_after=6, model="m", usage=None,
        candidates=None, stages=None, range_seqs=json.dumps([1]), signalled_at=SIGNALLED_AT,
        item_state="done", item_done="done",
        event=commit_event_fields("s1", "r1", "succeeded"))
    assert row is not None and row["lease_run_id"] is None
    run = await store.get_run("r1")
    assert run is not None and (run.status, run.tokens_after, run.range_seqs,
                                run.signalled_at) == ("succeeded", 6, [1], SIGNALLED_AT)


@case("set_timeouts")
async def _set_timeouts(store: Store) -> None:
    rows = await store.db.fetch("set_timeouts", ms="1500ms")
    assert [tuple(r.values()) for r in rows] == [("1500ms", "1500ms")]


@case("notify")
async def _notify(store: Store) -> None:
    heard: list[str] = []
    async with store.engine.connect() as conn:
        raw = (await conn.get_raw_connection()).driver_connection

        def hear(*args: Any) -> None:
            heard.append(args[-1])

        await raw.add_listener("compactd_events", hear)
        await store.db.execute("notify", payload='{"event": "compaction.committed"}')
        for _ in range(100):
            if heard:
                break
            await asyncio.sleep(0.01)
        await raw.remove_listener("compactd_events", hear)
        await conn.invalidate()
    assert heard == ['{"event": "compaction.committed"}']


@case("set_lock_wait")
async def _set_lock_wait(store: Store) -> None:
    assert [tuple(r.values()) for r in await store.db.fetch("set_lock_wait", ms="20ms")] == [
        ("20ms",)]


@case("plan_for_each_search")
async def _plan_for_each_search(store: Store) -> None:
    assert [tuple(r.values()) for r in await store.db.fetch("plan_for_each_search")] == [
        ("force_custom_plan",)]


# Recall (recall.sql): seqs 1 and 2 ("a", "b") replaced by a checkpoint named c1-2.
SPAN: dict[str, Any] = {"session_id": "s1", "first_seq": 1, "last_seq": 2}
EVERYWHERE: dict[str, Any] = {"session_id": "s1", "first_seq": 0, "last_seq": 2**63 - 1}


async def _recorded(store: Store) -> None:
    """Seqs 1 and 2 replaced by checkpoint c1-2, their text not indexed yet."""
    claim = await store.claim("s1", owner="w", trigger="manual", lease_s=60)
    await store.commit("s1", run_id=claim.run_id, fence=claim.fence,  # type: ignore[union-attr]
                       replacements=[Replacement(
                           seqs=(1, 2), kind=NodeKind.CHECKPOINT, tokens=3,
                           journal_kind="compaction/summary",
                           payload={"role": "user", "content": "summary",
                                    "meta": {"checkpoint": True, "recall": {"ref": "c1-2"}}})])


async def _checkpointed(store: Store) -> None:
    """The same, indexed."""
    await _recorded(store)
    await store.index_recall("s1")


async def _search(store: Store, form: str, query: str, **params: Any) -> list[tuple[Any, ...]]:
    """What ``form`` of a search returns (both forms take the same parameters)."""
    name = f"{form}_{store.db.variant_suffix}"
    words = query.lower().split()
    rows = await store.db.fetch(name, **{
        **EVERYWHERE, "query": query, "limit": 10, "before": 1, "width": 3,
        "pattern": f"%{query}%", "phrase": f'"{query}"', "needles": json.dumps([query.lower()]),
        "word": query.lower(), "cap": 10, "word_list": words, "words": json.dumps(words),
        **params})
    return [tuple(r.values()) for r in rows]


@case("history_session")
async def _history_session(store: Store) -> None:
    row = await store.db.fetchrow("history_session", session_id="s1")
    assert row is not None and (row["tenant"], row["run_model"]) == ("default", "gpt-4o")
    assert await store.db.fetchrow("history_session", session_id="ghost") is None


@case("history_node")
async def _history_node(store: Store) -> None:
    await _checkpointed(store)
    [event] = await store.db.fetch("recall_replace_events")
    row = await store.db.fetchrow("history_node", session_id="s1", ref="c1-2")
    assert row is not None and tuple(row.values()) == (event["seq"], "c1-2", 1, 2)
    assert await store.db.fetchrow("history_node", session_id="s1", ref="c9-9") is None


@case("history_scanned")
async def _history_scanned(store: Store) -> None:
    assert tuple((await store.db.fetchrow("history_scanned", **SPAN) or {}).values()) == (0, 0)
    await _checkpointed(store)
    assert tuple((await store.db.fetchrow("history_scanned", **SPAN) or {}).values()) == (2, 2)


@case("history_count")
async def _history_count(store: Store) -> None:
    await _checkpointed(store)
    assert await store.db.fetchval("history_count", **SPAN) == 2
    assert await store.db.fetchval("history_count", **{**SPAN, "last_seq": 1}) == 1


@case("history_originals")
async def _history_originals(store: Store) -> None:
    await _checkpointed(store)
    rows = await store.db.fetch("history_originals", **SPAN, limit=1, offset=1)
    assert [r["seq"] for r in rows] == [2]
    payload = rows[0]["payload"]
    assert (json.loads(payload) if isinstance(payload, str) else payload)["content"] == "b"


async def _exact(store: Store) -> None:
    await store.append("s1", [user("the Needle here"), user("needle")])
    claim = await store.claim("s1", owner="w", trigger="manual", lease_s=60)
    await store.commit("s1", run_id=claim.run_id, fence=claim.fence,  # type: ignore[union-attr]
                       replacements=[Replacement(
                           seqs=(3, 4), kind=NodeKind.CHECKPOINT, tokens=3,
                           journal_kind="compaction/summary",
                           payload={"role": "user", "content": "s", "meta": {"checkpoint": True}})])
    await store.index_recall("s1")
    # newest first, case-insensitive, the snippet cut around the match; the node named from
    # its span when its footer names none
    assert await _search(store, "history_search_exact", "NEEDLE") == [
        (4, "c3-4", "nee"), (3, "c3-4", " Ne")]
    assert await _search(store, "history_search_exact", "needle", last_seq=3) == [
        (3, "c3-4", " Ne")]


async def _replaced(store: Store, *texts: str) -> None:
    """``texts`` appended after "a" and "b" (seqs 1, 2) and all of them replaced by c1-N."""
    await store.append("s1", [user(text) for text in texts])
    claim = await store.claim("s1", owner="w", trigger="manual", lease_s=60)
    await store.commit("s1", run_id=claim.run_id, fence=claim.fence,  # type: ignore[union-attr]
                       replacements=[Replacement(
                           seqs=tuple(range(1, len(texts) + 3)), kind=NodeKind.CHECKPOINT,
                           tokens=3, journal_kind="compaction/summary",
                           payload={"role": "user", "content": "s", "meta": {"checkpoint": True}})])
    await store.index_recall("s1")


async def _word(store: Store) -> None:
    await _replaced(store, "Beta one", "no", "alphabet", "ÜBERGRÖSSE beta")
    # the newest cap originals holding the word as a case-insensitive substring
    assert await _search(store, "history_search_word", "beta") == [(6,), (3,)]
    assert await _search(store, "history_search_word", "beta", cap=1) == [(6,)]
    assert await _search(store, "history_search_word", "beta", last_seq=5) == [(3,)]
    assert await _search(store, "history_search_word", "übergrösse") == [(6,)]
    assert await _search(store, "history_search_word", "zeta") == []


async def _held(store: Store) -> None:
    await _replaced(store, "alpha beta", "beta gamma", "alpha beta gamma", "Gamma only")
    rows = await _search(store, "history_search_held", "alpha beta gamma",
                         seq_list=[3, 4, 5, 6], seqs=json.dumps([3, 4, 5, 6]),
                         before=0, width=5)
    # bit i: word i of the list held; the message holding the whole query is left out; the
    # snippet starts at the first word held
    assert sorted(rows) == [(3, "c1-6", 0b011, "alpha"), (4, "c1-6", 0b110, "beta "),
                            (6, "c1-6", 0b100, "Gamma")]


for _form, _check in (("history_search_exact", _exact), ("history_search_word", _word),
                      ("history_search_held", _held)):
    for _suffix in ("pg", "sqlite"):
        case(f"{_form}_{_suffix}")(_check)


@case("recall_replace_events")
async def _recall_replace_events(store: Store) -> None:
    assert await store.db.fetch("recall_replace_events") == []
    await _checkpointed(store)
    rows = await store.db.fetch("recall_replace_events")
    assert [(r["session_id"], r["kind"]) for r in rows] == [("s1", NodeKind.CHECKPOINT)]
    payload = rows[0]["payload"]
    assert (json.loads(payload) if isinstance(payload, str) else payload)["replaces"] == [1, 2]


async def _unindexed(store: Store) -> dict[str, Any]:
    """The checkpoint's event, its index rows deleted as if written before migration 0010."""
    await _checkpointed(store)
    async with transaction(store.engine) as conn:
        await conn.execute(sa.delete(t.recall_originals))
        await conn.execute(sa.delete(t.recall_nodes))
    [event] = await store.db.fetch("recall_replace_events")
    payload = event["payload"]
    return {**event, "payload": payload if isinstance(payload, str) else json.dumps(payload)}


@case("recall_index")
async def _recall_index(store: Store) -> None:
    event = await _unindexed(store)
    params = {"session_id": "s1", "seq": event["seq"], "kind": event["kind"], "ref": None,
              "first": None, "last": None, "replaces": [1, 2]}
    for _ in range(2):  # a second run adds nothing
        await store.db.fetch("recall_index", **params)
        assert await store.db.fetchval("history_count", **SPAN) == 2
        # recorded, the text pending: no bytes yet
        assert tuple((await store.db.fetchrow("history_scanned", **SPAN) or {}).values()) == (
            2, 0)
    # named from its span when no name is stated
    assert await store.db.fetchrow("history_node", session_id="s1", ref="c1-2") is not None
    assert await store.index_recall("s1") == 2
    assert tuple((await store.db.fetchrow("history_scanned", **SPAN) or {}).values()) == (2, 2)


@case("recall_pending_sessions")
async def _recall_pending_sessions(store: Store) -> None:
    assert await store.db.fetch("recall_pending_sessions", limit=5) == []
    await _recorded(store)
    assert [r["session_id"] for r in await store.db.fetch("recall_pending_sessions",
                                                          limit=5)] == ["s1"]


@case("recall_pending_originals")
async def _recall_pending_originals(store: Store) -> None:
    await _recorded(store)
    rows = await store.db.fetch("recall_pending_originals", session_id="s1", limit=1)
    assert [(r["seq"], r["node_seq"]) for r in rows] == [(1, 5)]
    payload = rows[0]["payload"]
    assert (json.loads(payload) if isinstance(payload, str) else payload)["content"] == "a"


async def _set_body(store: Store, seq: int, body: str, size: int) -> None:
    async with transaction(store.engine) as conn:
        await store.db.execute_many("recall_set_body", conn=conn, rows=[
            {"session_id": "s1", "seq": seq, "body": body, "bytes": size}])
        await store.db.execute_many("recall_node_bytes", conn=conn, rows=[
            {"session_id": "s1", "seq": 5}])


@case("recall_set_body")
async def _recall_set_body(store: Store) -> None:
    await _recorded(store)
    await _set_body(store, 1, "zebra", 7)
    # an original indexed already keeps its text
    await _set_body(store, 1, "yak", 9)
    assert await _search(store, "history_search_exact", "zebra") == [(1, "c1-2", "zeb")]
    assert await _search(store, "history_search_exact", "yak") == []
    assert [r["seq"] for r in await store.db.fetch("recall_pending_originals", session_id="s1",
                                                   limit=5)] == [2]


@case("recall_set_bodies")
async def _recall_set_bodies(store: Store) -> None:
    await _recorded(store)
    for _ in range(2):  # an original indexed already keeps its text and adds no bytes
        await store.db.execute("recall_set_bodies", session_id="s1", seqs=[1, 2],
                               bodies=["zebra", "yak"], sizes=[7, 5])
    assert await _search(store, "history_search_exact", "zebra") == [(1, "c1-2", "zeb")]
    assert tuple((await store.db.fetchrow("history_scanned", **SPAN) or {}).values()) == (2, 12)
    assert await store.db.fetch("recall_pending_originals", session_id="s1", limit=5) == []


@case("recall_node_bytes")
async def _recall_node_bytes(store: Store) -> None:
    await _recorded(store)
    await _set_body(store, 2, "b", 5)
    assert tuple((await store.db.fetchrow("history_scanned", **SPAN) or {}).values()) == (2, 5)
    await _set_body(store, 1, "a", 3)
    assert tuple((await store.db.fetchrow("history_scanned", **SPAN) or {}).values()) == (2, 8)


async def _pending_scan(store: Store) -> None:
    await store.append("s1", [user('say "Needle"\nhere'), user("nothing")])
    claim = await store.claim("s1", owner="w", trigger="manual", lease_s=60)
    await store.commit("s1", run_id=claim.run_id, fence=claim.fence,  # type: ignore[union-attr]
                       replacements=[Replacement(
                           seqs=seqs, kind=NodeKind.CHECKPOINT, tokens=3,
                           journal_kind="compaction/summary",
                           payload={"role": "user", "content": "s", "meta": {"checkpoint": True}})
                           for seqs in ((1, 2), (3, 4))])
    escaped = json.dumps('"needle"', ensure_ascii=False)[1:-1]
    like = escaped.replace("\\", "\\\\")  # LIKE's own escape character
    found = {**EVERYWHERE, "escaped": escaped, "pattern": f"%{like}%", "before": 1,
             "width": 4, "scan": 10, "limit": 10}
    name = f"history_search_pending_{store.db.variant_suffix}"
    # the payload as appended, JSON-escaped query and all, case-insensitive
    assert [tuple(r.values()) for r in await store.db.fetch(name, **found)] == [
        (3, "c3-4", ' \\"N')]
    # only the newest :scan pending originals are scanned
    assert await store.db.fetch(name, **{**found, "scan": 1}) == []
    # an indexed original is no longer pending
    await store.index_recall("s1")
    assert await store.db.fetch(name, **found) == []


for _suffix in ("pg", "sqlite"):
    case(f"history_search_pending_{_suffix}")(_pending_scan)


@case("recall_index_originals")
async def _recall_index_originals(store: Store) -> None:
    event = await _unindexed(store)
    params = {k: event[k] for k in ("session_id", "seq", "payload")}
    assert await store.db.execute("recall_index_originals", **params) == 2
    assert await store.db.execute("recall_index_originals", **params) == 0
    assert await store.db.fetchval("history_count", **SPAN) == 2


@case("recall_index_node")
async def _recall_index_node(store: Store) -> None:
    event = await _unindexed(store)
    await store.db.execute("recall_index_originals",
                           **{k: event[k] for k in ("session_id", "seq", "payload")})
    assert await store.db.execute("recall_index_node", **event) == 1
    assert await store.db.execute("recall_index_node", **event) == 0
    row = await store.db.fetchrow("history_node", session_id="s1", ref="c1-2")
    assert row is not None and tuple(row.values()) == (event["seq"], "c1-2", 1, 2)


@case("recall_fts_add")
async def _recall_fts_add(store: Store) -> None:
    await _checkpointed(store)  # the trigger indexed the originals "a" and "b"
    found: dict[str, Any] = {"name": "history_search_word_sqlite", **EVERYWHERE, "word": "a",
                             "phrase": '"zebra"', "cap": 10}
    assert await store.db.fetch(**found) == []
    # the index is what the search reads: an entry added for seq 1 finds the original
    await store.db.execute("recall_fts_add", session_id="s1", seq=1, body="zebra crossing")
    assert [tuple(r.values()) for r in await store.db.fetch(**found)] == [(1,)]


@case("recall_fts_drop")
async def _recall_fts_drop(store: Store) -> None:
    await store.append("s1", [user("findable text")])
    claim = await store.claim("s1", owner="w", trigger="manual", lease_s=60)
    await store.commit("s1", run_id=claim.run_id, fence=claim.fence,  # type: ignore[union-attr]
                       replacements=[Replacement(
                           seqs=(3,), kind=NodeKind.CHECKPOINT, tokens=3,
                           journal_kind="compaction/summary",
                           payload={"role": "user", "content": "s", "meta": {"checkpoint": True}})])
    await store.index_recall("s1")
    assert len(await _search(store, "history_search_exact", "findable")) == 1
    assert await store.db.execute("recall_fts_drop", session_id="s1", seq=3) == 1
    assert await _search(store, "history_search_exact", "findable") == []


def test_every_named_query_has_a_case() -> None:
    assert sorted(CASES) == sorted(sql.NAMES)


@pytest.mark.parametrize("name", sql.NAMES)
async def test_the_named_query_runs(store: Store, name: str) -> None:
    await store.create_session("s1", run_model="gpt-4o")
    await store.append("s1", [user("a"), user("b")])
    refused = (sql.sqlite_only(name) if store.db.encodes_appends
               else sql.postgres_only(name))
    if refused is None:
        await CASES[name](store)
        return
    # A backend refuses what it cannot run, by name.
    only = "SQLite only" if store.db.encodes_appends else "PostgreSQL only"
    with pytest.raises(KeyError, match=only):
        await store.db.fetch(name)
