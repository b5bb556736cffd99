"""storage.counters: what a batch adds to the counters kept by name, their sums and whether
they reach the sweep's floors, and where each counter's floor is stored."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from compactd.storage.counters import (
    COUNTERS,
    Counter,
    batch_counts,
    floor_values,
    node_counts,
    reaches,
    summed,
)
from compactd.storage.messages import Message, parse_openai


class Requests(Counter):
    name = "requests"

    def of(self, message: Message, tokens: int) -> int:
        return int(message.role == "user")


@pytest.fixture
def requests() -> Iterator[None]:
    COUNTERS["requests"] = Requests()
    try:
        yield
    finally:
        del COUNTERS["requests"]


def batch() -> list[Message]:
    return [parse_openai({"role": role, "content": "x"}) for role in ("user", "assistant", "user")]


def test_a_batch_costs_nothing_while_no_counter_is_kept_by_name() -> None:
    assert batch_counts(batch(), [1, 2, 3]) == ([], None)
    assert node_counts({"role": "user", "content": "x"}, 1) is None


def test_each_message_counts_its_own_and_the_batch_their_sum(requests: None) -> None:
    assert batch_counts(batch(), [1, 2, 3]) == (
        [{"requests": 1}, None, {"requests": 1}], {"requests": 2})
    assert node_counts({"role": "assistant", "content": "x"}, 1) is None


@pytest.mark.parametrize(("counts", "total"), [
    ([], None),
    ([None, None], None),
    ([{"a": 1}, None, {"a": 2, "b": 1}], {"a": 3, "b": 1}),
    ([{"a": 2}, {"a": -2, "b": 1}], {"b": 1}),  # a sum of 0 is left out
    ([{"a": -1}], {"a": -1}),
])
def test_summed(counts: list[dict[str, int] | None], total: dict[str, int] | None) -> None:
    assert summed(counts) == total


@pytest.mark.parametrize(("counts", "floors", "reached"), [
    (None, None, False),
    ({"a": 3}, None, False),
    ({"a": 3}, {"a": 3}, True),
    ({"a": 2}, {"a": 3}, False),
    (None, {"a": 0}, True),  # a count left out is 0
    ({"a": 1}, {"a": 5, "b": 1}, False),
    ({"a": 1, "b": 1}, {"a": 5, "b": 1}, True),
])
def test_reaches(counts: dict[str, int] | None, floors: dict[str, int] | None,
                 reached: bool) -> None:
    assert reaches(counts, floors) is reached


def test_floors_go_to_their_own_columns_or_by_name(requests: None) -> None:
    assert floor_values({"tokens": 100, "messages": None, "requests": 4}) == {
        "sweep_tokens": 100, "sweep_messages": None, "sweep_counts": {"requests": 4}}
    assert floor_values({"tokens": None, "messages": 9, "requests": None}) == {
        "sweep_tokens": None, "sweep_messages": 9, "sweep_counts": None}
    floors: dict[str, Any] = {"tokens": 100, "messages": None}
    with pytest.raises(ValueError, match="registered counters"):
        floor_values(floors)
