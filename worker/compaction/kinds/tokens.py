"""``tokens: N``: the pressure in tokens reaches N."""

from __future__ import annotations

from typing import Any

from compactd.worker.compaction.kinds.base import Counter, Kind, count


class Tokens(Kind):
    name = "tokens"
    counter = Counter.TOKENS

    def check(self, value: Any) -> float:
        return count(value)

    def threshold(self, value: float, window: int | None) -> float | None:
        return value
