"""``tokens: N``: the pressure in tokens reaches N."""

from __future__ import annotations

from typing import Any

from compactd.storage.counters import TOKENS
from compactd.worker.compaction.kinds.base import Kind, count


class Tokens(Kind):
    name = "tokens"
    counter = TOKENS

    def check(self, value: Any) -> float:
        return count(value)

    def threshold(self, value: float, window: int | None) -> float | None:
        return value
