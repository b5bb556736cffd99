"""What a trigger or keep kind is: one object with everything the hot path, the sweep and the
plan ask of it.

A kind measures one of the counters a session keeps (``storage.counters``, each one object
saying what a message adds to it): the append keeps each one counted on the session row (both
backends), the sweep stores one floor per counter and compares it with the row, and the plan
counts the same counter on the surface it read. A kind turns its configured value into a
threshold on its counter (``fraction`` of the window into tokens); nothing else branches on a
kind's name, so a kind that is not registered (``worker.compaction.kinds.KINDS``) is refused
when the policy is read, never read as another unit.

Pure: no I/O.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Any, ClassVar

from compactd.storage.counters import Counter


class Kind(ABC):
    """One trigger and keep kind."""

    name: ClassVar[str]
    counter: ClassVar[Counter]
    # Whether the threshold needs the run model's window; a policy resolved without one drops
    # such trigger clauses and falls back to the default keep (``Policy.resolve``).
    needs_window: ClassVar[bool] = False

    @abstractmethod
    def check(self, value: Any) -> float:
        """The configured value as the kind holds it; ``ValueError`` naming what is wrong."""

    @abstractmethod
    def threshold(self, value: float, window: int | None) -> float | None:
        """The count of :attr:`counter` at which a clause of ``value`` holds (a keep keeps at
        most that much); None when it cannot be judged (no window)."""

    def written(self, value: float) -> str:
        """``value`` as the kind's text form writes it (``KIND:N`` reads it back equal)."""
        return str(int(value))

    def floor(self, value: float, window: int | None) -> int | None:
        """The stored floor of :attr:`counter` the sweep selects on for a clause of ``value``."""
        threshold = self.threshold(value, window)
        return None if threshold is None else math.ceil(threshold)


def number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"must be a finite number, got {value!r} "
                         "(a non-finite threshold never compares true)")
    return float(value)


def count(value: Any, *, allow_zero: bool = False) -> int:
    v = number(value)
    if not float(v).is_integer():
        raise ValueError(f"must be an integer, got {value!r}")
    if v < 0 or (v == 0 and not allow_zero):
        raise ValueError(f"must be {'non-negative' if allow_zero else 'positive'}, "
                         f"got {value!r}")
    return int(v)


def fraction(value: Any) -> float:
    v = number(value)
    if not 0 < v <= 1:
        hint = f" (write {v / 100:g} for {v:g}%)" if 1 < v <= 100 else ""
        raise ValueError(f"a fraction must be in (0, 1], got {value!r}{hint}")
    return v
