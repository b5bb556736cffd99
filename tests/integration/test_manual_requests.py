"""The manual-run mark on both databases: one queued manual task per session until it starts."""

from __future__ import annotations

import asyncio
import datetime as dt

import pytest

from compactd.storage.errors import InvalidMessage, SessionNotFound
from compactd.storage.instructions import MAX_INSTRUCTION_CHARS, MAX_INSTRUCTIONS
from compactd.storage.records import Claim
from compactd.storage.store import Store

NOW = dt.datetime(2026, 12, 1, 12, 0, tzinfo=dt.UTC)


async def test_a_live_mark_answers_with_its_task_until_cleared_or_stale(store: Store) -> None:
    await store.create_session("s1")
    await store.create_session("s2")
    assert await store.mark_manual("s1", "t1", ttl_s=120, now=NOW) == "t1"
    assert await store.mark_manual("s1", "t2", ttl_s=120, now=NOW) == "t1"
    assert await store.mark_manual("s2", "t3", ttl_s=120, now=NOW) == "t3"
    # Another task's clear leaves the mark; its own frees it.
    await store.clear_manual("s1", "t2")
    assert await store.mark_manual("s1", "t4", ttl_s=120, now=NOW) == "t1"
    await store.clear_manual("s1", "t1")
    assert await store.mark_manual("s1", "t4", ttl_s=120, now=NOW) == "t4"
    # A mark older than the TTL (its message lost) is taken over.
    later = NOW + dt.timedelta(seconds=121)
    assert await store.mark_manual("s1", "t5", ttl_s=120, now=later) == "t5"
    assert await store.mark_manual("s2", "t6", ttl_s=120, now=NOW) == "t3"


async def test_racing_requests_agree_on_one_task(store: Store) -> None:
    await store.create_session("s1")
    held = await asyncio.gather(*(store.mark_manual("s1", f"t{i}", ttl_s=120)
                                  for i in range(10)))
    assert len(set(held)) == 1


async def test_a_missing_session_is_not_found(store: Store) -> None:
    with pytest.raises(SessionNotFound):
        await store.mark_manual("nope", "t1", ttl_s=120)


async def test_coalesced_requests_keep_every_distinct_instruction_for_the_run(store: Store
                                                                              ) -> None:
    await store.create_session("s1")
    assert await store.mark_manual("s1", "t1", ttl_s=120, now=NOW,
                                   instructions=["focus on the migration"]) == "t1"
    assert await store.mark_manual("s1", "t2", ttl_s=120, now=NOW) == "t1"
    assert await store.mark_manual("s1", "t3", ttl_s=120, now=NOW,
                                   instructions=["keep the error names"]) == "t1"
    assert await store.mark_manual("s1", "t4", ttl_s=120, now=NOW,
                                   instructions=["focus on the migration"]) == "t1"
    # Another task's clear takes nothing; the run's own takes them all, once, in order.
    assert await store.clear_manual("s1", "t2") == ()
    assert await store.clear_manual("s1", "t1") == ("focus on the migration",
                                                    "keep the error names")
    assert await store.clear_manual("s1", "t1") == ()
    # A stale mark's instructions are not lost with its task's message: the task that takes
    # the mark over carries them (test_a_stale_mark_s_instructions_go_to_the_task_that_...).
    await store.mark_manual("s1", "t5", ttl_s=120, now=NOW, instructions=["old"])
    later = NOW + dt.timedelta(seconds=121)
    assert await store.mark_manual("s1", "t6", ttl_s=120, now=later,
                                   instructions=["new"]) == "t6"
    assert await store.clear_manual("s1", "t6") == ("old", "new")


async def test_a_stale_mark_s_instructions_go_to_the_task_that_takes_it_over(store: Store
                                                                             ) -> None:
    """A mark past its TTL (its task's message lost, or the urgent queue backed up) is taken
    over by the next request's task, and with it the instructions the requests coalesced into
    the stale task left there: the stale task's clear no longer finds its mark, so they would
    reach no run at all."""
    await store.create_session("s1")
    assert await store.mark_manual("s1", "t1", ttl_s=120, now=NOW,
                                   instructions=["focus on the migration"]) == "t1"
    assert await store.mark_manual("s1", "t2", ttl_s=120, now=NOW,
                                   instructions=["keep the error names"]) == "t1"
    later = NOW + dt.timedelta(seconds=121)
    assert await store.mark_manual("s1", "t3", ttl_s=120, now=later,
                                   instructions=["name the open ticket"]) == "t3"
    assert await store.clear_manual("s1", "t1") == ()
    assert await store.clear_manual("s1", "t3") == ("focus on the migration",
                                                    "keep the error names",
                                                    "name the open ticket")


async def test_instructions_over_the_bound_change_nothing(store: Store) -> None:
    await store.create_session("s1")
    with pytest.raises(InvalidMessage, match=f"at most {MAX_INSTRUCTION_CHARS}"):
        await store.mark_manual("s1", "t1", ttl_s=120, now=NOW,
                                instructions=["x" * (MAX_INSTRUCTION_CHARS + 1)])
    # No mark was left: the next request queues its own task.
    assert await store.mark_manual("s1", "t2", ttl_s=120, now=NOW,
                                   instructions=[f"i{n}" for n in range(MAX_INSTRUCTIONS)]) == "t2"
    with pytest.raises(InvalidMessage, match="distinct instructions"):
        await store.mark_manual("s1", "t3", ttl_s=120, now=NOW, instructions=["one more"])
    assert await store.clear_manual("s1", "t2") == tuple(f"i{n}" for n in range(MAX_INSTRUCTIONS))


async def test_a_run_row_records_its_instructions(store: Store) -> None:
    await store.create_session("s1")
    claim = await store.claim("s1", owner="test", trigger="manual", lease_s=30)
    assert isinstance(claim, Claim)
    assert (await store.get_run(claim.run_id)).instructions is None
    await store.note_instructions(claim.run_id, ["keep the schema plan"])
    assert (await store.get_run(claim.run_id)).instructions == ["keep the schema plan"]


async def test_a_busy_run_s_instructions_go_to_the_next_manual_run(store: Store) -> None:
    await store.create_session("s1")
    # The run of t1 started (it took its instructions) and found the session leased.
    assert await store.mark_manual("s1", "t1", ttl_s=120, now=NOW,
                                   instructions=["keep the schema plan"]) == "t1"
    focus = await store.clear_manual("s1", "t1")
    assert await store.keep_manual("s1", focus)
    assert await store.keep_manual("s1", ["and the test names"])
    # They stand for no queued task: the next request queues its own, at once, and its run
    # takes them before its own.
    assert await store.mark_manual("s1", "t2", ttl_s=120, now=NOW,
                                   instructions=["the error text"]) == "t2"
    assert await store.mark_manual("s1", "t3", ttl_s=120, now=NOW) == "t2"
    assert await store.clear_manual("s1", "t2") == (
        "keep the schema plan", "and the test names", "the error text")
    assert await store.clear_manual("s1", "t2") == ()


async def test_a_busy_run_s_instructions_join_a_task_queued_since_it_started(
        store: Store) -> None:
    await store.create_session("s1")
    assert await store.mark_manual("s1", "t2", ttl_s=120, now=NOW,
                                   instructions=["the error text"]) == "t2"
    assert await store.keep_manual("s1", ["keep the schema plan"])
    assert await store.mark_manual("s1", "t3", ttl_s=120, now=NOW) == "t2"
    assert await store.clear_manual("s1", "t2") == ("the error text", "keep the schema plan")


async def test_instructions_a_busy_run_cannot_hand_back_change_nothing(store: Store) -> None:
    await store.create_session("s1")
    full = [f"i{n}" for n in range(MAX_INSTRUCTIONS)]
    assert await store.mark_manual("s1", "t1", ttl_s=120, now=NOW, instructions=full) == "t1"
    assert not await store.keep_manual("s1", ["one more"])
    assert await store.clear_manual("s1", "t1") == tuple(full)
    with pytest.raises(SessionNotFound):
        await store.keep_manual("gone", ["keep the schema plan"])


async def test_a_run_takes_its_task_s_instructions_onto_its_row_in_one_step(store: Store
                                                                            ) -> None:
    """Until the run holding the lease takes them, the mark keeps the instructions of every
    request its task stands for: a delivery that dies before (after receiving the task, before
    or during its claim) leaves them for the next delivery of the task."""
    await store.create_session("s1")
    assert await store.mark_manual("s1", "t1", ttl_s=120, now=NOW,
                                   instructions=["keep the schema plan"]) == "t1"
    assert await store.mark_manual("s1", "t2", ttl_s=120, now=NOW,
                                   instructions=["and the test names"]) == "t1"
    # The first delivery claimed, and died before it took them: they are on the mark still.
    died = await store.claim("s1", owner="w1", trigger="manual", lease_s=30, task_id="t1")
    assert isinstance(died, Claim)
    assert await store.mark_manual("s1", "t3", ttl_s=120, now=NOW) == "t1"
    await store.release_lease("s1", by="test")
    # The next delivery takes them (its own argument first), and the mark is cleared.
    again = await store.claim("s1", owner="w2", trigger="manual", lease_s=30, task_id="t1")
    assert isinstance(again, Claim)
    taken = await store.take_manual("s1", "t1", run_id=again.run_id,
                                    instructions=["keep the schema plan"])
    assert taken == ("keep the schema plan", "and the test names")
    assert (await store.get_run(again.run_id)).instructions == list(taken)
    assert await store.mark_manual("s1", "t4", ttl_s=120, now=NOW) == "t4"
    # A delivery after that one (it died mid-run) finds them on the earlier run row.
    await store.release_lease("s1", by="test")
    third = await store.claim("s1", owner="w3", trigger="manual", lease_s=30, task_id="t1")
    assert isinstance(third, Claim)
    assert await store.take_manual("s1", "t1", run_id=third.run_id) == taken
    assert (await store.get_run(third.run_id)).instructions == list(taken)


async def test_a_run_that_did_not_take_its_mark_hands_it_to_the_next_manual_run(
        store: Store) -> None:
    await store.create_session("s1")
    assert await store.mark_manual("s1", "t1", ttl_s=120, now=NOW,
                                   instructions=["keep the schema plan"]) == "t1"
    # Its task ended (busy, or failed before it held the lease): the mark is the next
    # request's, with what the run was given besides.
    assert await store.keep_manual("s1", ["and the test names"], task_id="t1")
    assert await store.mark_manual("s1", "t2", ttl_s=120, now=NOW) == "t2"
    assert await store.clear_manual("s1", "t2") == ("keep the schema plan",
                                                    "and the test names")
    # A run that took its mark hands nothing back, and leaves another task's mark as it is.
    assert await store.mark_manual("s1", "t3", ttl_s=120, now=NOW) == "t3"
    assert await store.keep_manual("s1", (), task_id="t1")
    assert await store.mark_manual("s1", "t4", ttl_s=120, now=NOW) == "t3"
