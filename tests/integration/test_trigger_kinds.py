"""A trigger kind added the way a maintainer adds one: its ``Kind`` object registered in
``worker.compaction.kinds.KINDS``, nothing else. It fires from the append's signal, the sweep's
stored floor and the plan, on SQLite and on PostgreSQL, on the counter it names (the issue's
``turns: 10`` once came back as a token floor and never fired from the append or the sweep)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from typing import Any

import pytest

from compactd.storage.messages import Message, parse_openai
from compactd.storage.records import utcnow
from compactd.storage.store import Store
from compactd.worker.compaction.kinds import KINDS, Counter, Kind, check_registry
from compactd.worker.compaction.kinds.base import count
from compactd.worker.compaction.planner import plan
from compactd.worker.pressure import over_trigger, session_policy, sweep_thresholds, wants_run
from compactd.worker.settings import Config, build_config

TURNS = 3  # the trigger: three turns, six surface messages


class Turns(Kind):
    """``turns: N``: N exchanges, a request and its reply each, on the surface."""

    name = "turns"
    counter = Counter.MESSAGES

    def check(self, value: Any) -> float:
        return count(value)

    def threshold(self, value: float, window: int | None) -> float | None:
        return 2 * value


@pytest.fixture
def turns() -> Iterator[None]:
    KINDS["turns"] = Turns()
    check_registry(KINDS)
    try:
        yield
    finally:
        del KINDS["turns"]


def config() -> Config:
    return build_config({"summarization": {"trigger": {"type": "turns", "value": TURNS},
                                           "keep": {"type": "messages", "value": 2}}})


def user(i: int) -> Message:
    return parse_openai({"role": "user", "content": f"request {i}: " + "word " * 40})


async def test_a_registered_kind_fires_from_the_append_the_sweep_and_the_plan(
        turns: None, store: Store) -> None:
    c = config()
    now = utcnow() - dt.timedelta(seconds=30)
    for sid in ("under", "over"):
        await store.create_session(sid, run_model="gpt-4o", now=now)
        first = await store.append(sid, [user(i) for i in range(2 * TURNS - 1)], now=now,
                                   signal_if=lambda info: wants_run(info, c))
        assert not first.signalled  # five messages: two and a half turns
    last = await store.append("over", [user(9)], now=now + dt.timedelta(seconds=1),
                              signal_if=lambda info: wants_run(info, c))
    assert last.signalled

    await store.resolve_sweep_thresholds(key="k", resolve=lambda i: sweep_thresholds(i, c))
    over = await store.get_session("over")
    assert (over.sweep_tokens, over.sweep_messages) == (None, 2 * TURNS)
    assert over.over_sweep and not (await store.get_session("under")).over_sweep
    await store.clear_signal("over")
    chosen, _ = await store.select_for_sweep(decide=lambda i: over_trigger(i, c), limit=10,
                                             fresh_signal_s=0)
    assert [s.id for s in chosen] == ["over"]

    for sid, fires in (("under", False), ("over", True)):
        info = await store.get_session(sid)
        policy = session_policy(info, c)
        surface = await store.read_surface(sid)
        planned = plan(surface.nodes, policy=policy, now=utcnow())
        assert planned.fired is fires, planned.reason
        if fires:
            assert planned.reason.startswith(f"turns>={TURNS}")
            assert planned.compacts
