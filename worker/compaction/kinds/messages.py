"""``messages: N``: the surface holds N nodes."""

from __future__ import annotations

from typing import Any

from compactd.worker.compaction.kinds.base import Counter, Kind, count


class Messages(Kind):
    name = "messages"
    counter = Counter.MESSAGES

    def check(self, value: Any) -> float:
        return count(value)

    def threshold(self, value: float, window: int | None) -> float | None:
        return value
