"""The closed set of trigger and keep kinds: every kind is one object, every counter it can
measure is counted wherever a decision reads it, and a kind without its object is refused by
name rather than read as another unit."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import pytest

from compactd.storage import schema
from compactd.storage.counters import COUNTERS, MESSAGES, TOKENS, Counter
from compactd.storage.messages import Message
from compactd.worker.compaction.arrivals import Arrivals
from compactd.worker.compaction.kinds import KINDS, Kind, check_registry
from compactd.worker.compaction.kinds.base import count
from compactd.worker.compaction.policy import Clause, PolicyError, parse_policy
from compactd.worker.compaction.triggers import Pressure, clause_holds


class Requests(Counter):
    name = "requests"

    def of(self, message: Message, tokens: int) -> int:
        return int(message.role == "user")


def test_every_counter_has_its_columns_or_is_kept_by_name_and_counted_in_each_measure(
        ) -> None:
    for counter in COUNTERS.values():
        assert counter.column in schema.sessions.c and counter.column in schema.OVER_SWEEP_SQL
        assert counter.floor_column in schema.sessions.c
        assert counter.floor_column in schema.OVER_SWEEP_SQL
    assert Pressure(tokens=7, messages=3, fraction=None).count(MESSAGES) == 3
    assert Arrivals(tokens=7, messages=3, seconds=1.0, rate_tokens_per_s=1.0).count(TOKENS) == 7
    assert {f.name for f in fields(Pressure)} >= set(COUNTERS)
    # A counter kept by name: in the pressure's counts (0 when left out), none expected to
    # arrive before the pickup.
    requests = Requests()
    assert Pressure(7, 3, None, counts={"requests": 2}).count(requests) == 2
    assert Pressure(7, 3, None).count(requests) == 0
    assert Arrivals(tokens=7, messages=3, seconds=1.0, rate_tokens_per_s=1.0).count(
        requests) == 0


def test_the_registry_holds_each_kind_under_its_own_name() -> None:
    check_registry(KINDS)
    assert list(KINDS) == ["tokens", "messages", "fraction"]
    with pytest.raises(RuntimeError, match="registered as"):
        check_registry({"turns": KINDS["messages"]})
    with pytest.raises(RuntimeError, match="counter"):
        check_registry({"tokens": KINDS["tokens"]})
    with pytest.raises(RuntimeError, match="not registered"):
        check_registry({**KINDS, "half": _half(Requests())})
    with pytest.raises(RuntimeError, match="has no kind of its own name"):
        check_registry(KINDS, {**COUNTERS, "requests": Requests()})
    with pytest.raises(RuntimeError, match="registered as"):
        check_registry(KINDS, {**COUNTERS, "turns": Requests()})


def _half(measured: Counter) -> Kind:
    class Half(Kind):
        name = "half"
        counter = measured

        def check(self, value: Any) -> float:
            return count(value)

        def threshold(self, value: float, window: int | None) -> float | None:
            return value

    return Half()


def test_a_kind_without_its_object_is_refused_by_name_not_read_as_tokens() -> None:
    with pytest.raises(PolicyError, match=r"summarization\.trigger\.type: unknown kind 'turns'"):
        parse_policy({"trigger": {"type": "turns", "value": 10}})
    with pytest.raises(PolicyError, match=r"summarization\.trigger\.turns: unknown trigger kind"):
        parse_policy({"trigger": {"turns": 10, "tokens": 4000}})
    with pytest.raises(ValueError, match="unknown kind 'turns'"):
        Clause("turns", 10)


def test_a_kind_missing_a_hook_cannot_be_made() -> None:
    class Half(Kind):
        name = "half"
        counter = MESSAGES

        def check(self, value: Any) -> float:
            return count(value)

    with pytest.raises(TypeError, match="threshold"):
        Half()  # type: ignore[abstract]


@pytest.mark.parametrize(("clause", "window", "pressure", "holds"), [
    (Clause("tokens", 100), None, (100, 1), True),
    (Clause("tokens", 100), None, (99, 50), False),
    (Clause("messages", 5), None, (10, 5), True),
    (Clause("messages", 5), None, (10_000, 4), False),
    (Clause("fraction", 0.5), 200, (100, 1), True),
    (Clause("fraction", 0.5), 200, (99, 1), False),
    (Clause("fraction", 0.5), None, (10**9, 10**6), False),  # no window: never on a guess
])
def test_a_clause_holds_on_its_own_counter(clause: Clause, window: int | None,
                                           pressure: tuple[int, int], holds: bool) -> None:
    tokens, messages = pressure
    measured = Pressure(tokens=tokens, messages=messages, fraction=None)
    assert clause_holds(clause, measured, window) is holds


@pytest.mark.parametrize(("trigger", "floors"), [
    ({"type": "messages", "value": 30}, {TOKENS: None, MESSAGES: 30}),
    ({"type": "tokens", "value": 4000}, {TOKENS: 4000, MESSAGES: None}),
    ({"type": "fraction", "value": 0.25}, {TOKENS: 1000, MESSAGES: None}),
])
def test_each_kind_floors_the_sweep_on_its_own_counter(trigger: Any,
                                                       floors: dict[Counter, int | None]) -> None:
    assert parse_policy({"trigger": trigger}).resolve(4000).trigger_floors() == floors
