"""A trigger kind added the way a maintainer adds one: its ``Kind`` object registered in
``worker.compaction.kinds.KINDS``, nothing else; and a kind over a counter no kind had, added
with its ``Counter`` object registered in ``storage.counters.COUNTERS`` besides, nothing else
(no column, no SQL, no migration). Each fires from the append's signal, the sweep's stored
floor and the plan, on SQLite and on PostgreSQL, on the counter it names (the issue's
``turns: 10`` once came back as a token floor and never fired from the append or the sweep),
and a commit that replaces what a counter counted takes it off the count."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from typing import Any

import pytest

from compactd.storage.counters import COUNTERS, MESSAGES, Counter
from compactd.storage.kinds import JournalKind, NodeKind
from compactd.storage.messages import META_CHECKPOINT, Message, parse_openai
from compactd.storage.records import Claim, Replacement, SessionInfo, utcnow
from compactd.storage.store import Store
from compactd.worker.compaction.kinds import KINDS, Kind, check_registry
from compactd.worker.compaction.kinds.base import count
from compactd.worker.compaction.planner import plan
from compactd.worker.pressure import over_trigger, session_policy, sweep_thresholds, wants_run
from compactd.worker.settings import Config, build_config

TURNS = 3  # the trigger: three exchanges (six surface messages), or three requests


class Exchanges(Kind):
    """``exchanges: N``: N exchanges, a request and its reply each, on the surface."""

    name = "exchanges"
    counter = MESSAGES

    def check(self, value: Any) -> float:
        return count(value)

    def threshold(self, value: float, window: int | None) -> float | None:
        return 2 * value


@pytest.fixture
def exchanges() -> Iterator[None]:
    KINDS["exchanges"] = Exchanges()
    check_registry(KINDS)
    try:
        yield
    finally:
        del KINDS["exchanges"]


def config(kind: str) -> Config:
    return build_config({"summarization": {"trigger": {"type": kind, "value": TURNS},
                                           "keep": {"type": "messages", "value": 2}}})


def user(i: int) -> Message:
    return parse_openai({"role": "user", "content": f"request {i}: " + "word " * 40})


async def fires_from_the_append_the_sweep_and_the_plan(
        store: Store, kind: str, under: list[Message], last: Message) -> None:
    """Sessions ``under`` (``under`` appended) and ``over`` (``last`` on top): only ``over``
    is signalled by its append, flagged and chosen by the sweep, and fired by the plan of
    the surface it reads, on the clause of ``kind``."""
    c = config(kind)
    now = utcnow() - dt.timedelta(seconds=30)
    for sid in ("under", "over"):
        await store.create_session(sid, run_model="gpt-4o", now=now)
        first = await store.append(sid, under, now=now,
                                   signal_if=lambda info: wants_run(info, c))
        assert not first.signalled
    signalled = await store.append("over", [last], now=now + dt.timedelta(seconds=1),
                                   signal_if=lambda info: wants_run(info, c))
    assert signalled.signalled

    await store.resolve_sweep_thresholds(key="k", resolve=lambda i: sweep_thresholds(i, c))
    await store.clear_signal("over")
    read: list[str] = []

    def decide(info: SessionInfo) -> bool:
        read.append(info.id)
        return over_trigger(info, c)

    chosen, _ = await store.select_for_sweep(decide=decide, limit=10, fresh_signal_s=0)
    # The stored floor flags the session: the one under it is never read.
    assert read == [s.id for s in chosen] == ["over"]

    for sid, fires in (("under", False), ("over", True)):
        info = await store.get_session(sid)
        surface = await store.read_surface(sid)
        planned = plan(surface.nodes, policy=session_policy(info, c), now=utcnow())
        assert planned.fired is fires, planned.reason
        if fires:
            assert planned.reason.startswith(f"{kind}>={TURNS}")
            assert planned.compacts


async def test_a_registered_kind_fires_from_the_append_the_sweep_and_the_plan(
        exchanges: None, store: Store) -> None:
    # Five messages, two and a half exchanges, then the sixth.
    await fires_from_the_append_the_sweep_and_the_plan(
        store, "exchanges", [user(i) for i in range(2 * TURNS - 1)], user(9))
    over = await store.get_session("over")
    assert (over.sweep_tokens, over.sweep_messages) == (None, 2 * TURNS)
    assert over.over_sweep and not (await store.get_session("under")).over_sweep


class TurnCounter(Counter):
    """The user's requests on the surface (a checkpoint, though a user message, is none)."""

    name = "turns"

    def of(self, message: Message, tokens: int) -> int:
        return int(message.role == "user" and not message.flag(META_CHECKPOINT))


class Turns(Kind):
    """``turns: N``: N requests of the user on the surface."""

    name = "turns"
    counter = TurnCounter()

    def check(self, value: Any) -> float:
        return count(value)

    def threshold(self, value: float, window: int | None) -> float | None:
        return value


@pytest.fixture
def turns() -> Iterator[None]:
    COUNTERS["turns"] = Turns.counter
    KINDS["turns"] = Turns()
    check_registry(KINDS)
    try:
        yield
    finally:
        del KINDS["turns"], COUNTERS["turns"]


def reply(i: int) -> Message:
    return parse_openai({"role": "assistant", "content": f"reply {i}: " + "done " * 40})


async def test_a_kind_over_a_new_counter_fires_from_the_append_the_sweep_and_the_plan(
        turns: None, store: Store) -> None:
    # Many replies and TURNS - 1 requests (every other counter is well over TURNS), then one.
    exchange = [m for i in range(TURNS - 1) for m in (user(i), reply(i), reply(i + 10))]
    await fires_from_the_append_the_sweep_and_the_plan(store, "turns", exchange, user(9))
    over, under = await store.get_session("over"), await store.get_session("under")
    assert (over.counts, under.counts) == ({"turns": TURNS}, {"turns": TURNS - 1})
    assert (over.sweep_tokens, over.sweep_messages, over.sweep_counts) == (
        None, None, {"turns": TURNS})
    assert over.over_counts and not over.over_sweep and not under.over_counts

    # A checkpoint in place of the first two exchanges: two requests fewer, under the floor
    # again; the next request counts on top of what is left.
    claim = await store.claim("over", owner="w", trigger="pressure", lease_s=30)
    assert isinstance(claim, Claim)
    summary = {"role": "user", "content": "summary", "meta": {META_CHECKPOINT: True}}
    committed = await store.commit("over", run_id=claim.run_id, fence=claim.fence, replacements=[
        Replacement(seqs=tuple(range(1, 7)), kind=NodeKind.CHECKPOINT, payload=summary,
                    tokens=5, journal_kind=JournalKind.SUMMARY)])
    assert committed.counts == {"turns": TURNS - 2} and not committed.over_counts
    again = await store.append("over", [user(11), user(12)])
    assert again.session.counts == {"turns": TURNS} and again.session.over_counts
    assert (await store.verify("over")).ok
