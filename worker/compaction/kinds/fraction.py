"""``fraction: F``: the pressure reaches F of the run model's window (the model that would
overflow, never the summary model's)."""

from __future__ import annotations

from typing import Any

from compactd.storage.counters import TOKENS
from compactd.worker.compaction.kinds.base import Kind, fraction


class Fraction(Kind):
    name = "fraction"
    counter = TOKENS
    needs_window = True

    def check(self, value: Any) -> float:
        return fraction(value)

    def threshold(self, value: float, window: int | None) -> float | None:
        # Without a window a fraction cannot be judged; it never fires on a guess.
        return value * window if window else None

    def written(self, value: float) -> str:
        return repr(value)
