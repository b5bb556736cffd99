"""The rules every holder of a manual run's instructions follows (``storage.instructions``)."""

from __future__ import annotations

import pytest

from compactd.storage.instructions import MAX_INSTRUCTIONS, first_instructions

MANY = tuple(f"note {i}" for i in range(MAX_INSTRUCTIONS + 2))


@pytest.mark.parametrize(("groups", "taken"), [
    ((), ()),
    ((("a",), (), ("b", "a")), ("a", "b")),
    # The run's own first, then the mark's, then what earlier deliveries recorded.
    ((("own",), ("mark", "own"), ("row", "mark")), ("own", "mark", "row")),
    # Over the bound: the first ones are kept, the latest holder's give way.
    ((MANY[:MAX_INSTRUCTIONS], MANY[MAX_INSTRUCTIONS:]), MANY[:MAX_INSTRUCTIONS]),
    ((MANY[:2], MANY), MANY[:MAX_INSTRUCTIONS]),
])
def test_first_instructions_keeps_each_text_once_in_order_up_to_the_bound(
        groups: tuple[tuple[str, ...], ...], taken: tuple[str, ...]) -> None:
    assert first_instructions(*groups) == taken
