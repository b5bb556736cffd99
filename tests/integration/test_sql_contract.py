"""Every named query of storage/sql runs, on both backends or, when it says why, on PostgreSQL
alone; each case checks what the query returns or changes, through the store's connector."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from storage import sql
from storage.kinds import JournalKind, NodeKind
from storage.migrate import HEAD_REVISION
from storage.records import utcnow
from storage.store import Store
from tests.unit.compaction_helpers import user

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


@case("append")
async def _append(store: Store) -> None:
    row = await store.db.fetchrow(
        "append", session_id="s1", payloads=[json.dumps({"role": "user", "content": "c"})],
        tokens=[5], now=utcnow(), call_ids=[], call_idx=[], call_result_idx=[], ext_ids=[],
        ext_idx=[])
    assert row is not None and (row["last_seq"], row["surface_messages"]) == (3, 3)


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
            "expected_pos": [1], "expected_seq": [1]}


@case("commit")
async def _commit(store: Store) -> None:
    lease = await _claimed(store)
    row = await store.db.fetchrow("commit", **lease, **_prune_of_seq_1(), end_payload=None)
    assert row is not None and row["lease_run_id"] == "r1" and row["surface_version"] == 2
    assert (await store.read_surface("s1")).nodes[0].kind == NodeKind.PRUNED


@case("commit_ending")
async def _commit_ending(store: Store) -> None:
    lease = await _claimed(store)
    row = await store.db.fetchrow(
        "commit_ending", **lease, **_prune_of_seq_1(),
        end_payload=json.dumps({"run_id": "r1", "outcome": "succeeded"}), status="succeeded",
        failure_class=None, error=None, tokens_before=10, tokens_after=6, model="m", usage=None,
        candidates=None, stages=None, range_seqs=json.dumps([1]), item_state="done",
        item_done="done")
    assert row is not None and row["lease_run_id"] is None
    run = await store.get_run("r1")
    assert run is not None and (run.status, run.tokens_after, run.range_seqs) == (
        "succeeded", 6, [1])


@case("set_timeouts")
async def _set_timeouts(store: Store) -> None:
    rows = await store.db.fetch("set_timeouts", ms="1500ms")
    assert [tuple(r.values()) for r in rows] == [("1500ms", "1500ms")]


@case("set_lock_wait")
async def _set_lock_wait(store: Store) -> None:
    assert [tuple(r.values()) for r in await store.db.fetch("set_lock_wait", ms="20ms")] == [
        ("20ms",)]


def test_every_named_query_has_a_case() -> None:
    assert sorted(CASES) == sorted(sql.NAMES)


@pytest.mark.parametrize("name", sql.NAMES)
async def test_the_named_query_runs(store: Store, name: str) -> None:
    await store.create_session("s1", run_model="gpt-4o")
    await store.append("s1", [user("a"), user("b")])
    if store.db.encodes_appends or sql.postgres_only(name) is None:
        await CASES[name](store)
        return
    # The embedded backend refuses what it cannot run, by name.
    with pytest.raises(KeyError, match="PostgreSQL only"):
        await store.db.fetch(name)
