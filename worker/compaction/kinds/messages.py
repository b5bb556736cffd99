"""``messages: N``: the surface holds N nodes."""

from __future__ import annotations

from typing import Any

from compactd.storage.counters import MESSAGES
from compactd.worker.compaction.kinds.base import Kind, count


class Messages(Kind):
    name = "messages"
    counter = MESSAGES

    def check(self, value: Any) -> float:
        return count(value)

    def threshold(self, value: float, window: int | None) -> float | None:
        return value
