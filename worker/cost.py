"""What compaction costs in dollars: tokens the providers billed times the configured prices.

Pure arithmetic on plain values, computed where a cost is read (``compactd status``, ``compact
--json``, the HTTP status route) from the usage each run row records, so a corrected price
reprices every run already stored; the worker's ``compactd_cost_usd_total`` counts at the prices
it was started with. The benchmarks use the same arithmetic.

A usage mapping is what a run records (``worker.run``): ``input_tokens`` (cached and
cache-written included, both providers alike), ``cached_tokens`` (read from the prompt cache),
``cache_write_tokens`` (written to it, billed apart by Anthropic), ``output_tokens``, and the
same per candidate under ``by_candidate``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

TOKENS_PER_PRICE_UNIT = 1_000_000  # prices are USD per million tokens
USAGE_KINDS = ("input_tokens", "cached_tokens", "cache_write_tokens", "output_tokens")
# The parts a bill is made of, as compactd_cost_usd_total{kind} names them.
COST_KINDS = ("input", "cached", "cache_write", "output")
NO_USAGE = "no provider usage: nothing billed (the local summarizer, or no model call)"
PRICED = "usage x prices"
# Rounding of reported dollars: a millionth of a dollar is far below any price's precision.
USD_DIGITS = 6


@dataclass(frozen=True, slots=True)
class Price:
    """USD per million tokens of one model."""

    input: float
    cached_input: float
    cache_write: float
    output: float


@dataclass(frozen=True, slots=True)
class Billed:
    """Tokens of one bill. ``input`` includes ``cached`` and ``cache_write``."""

    input: int = 0
    cached: int = 0
    cache_write: int = 0
    output: int = 0

    @classmethod
    def of(cls, counts: Mapping[str, Any]) -> Billed:
        return cls(*(int(counts.get(kind) or 0) for kind in USAGE_KINDS))


def cost_parts(billed: Billed, price: Price) -> dict[str, float]:
    """USD of each part of a bill: fresh input, cached input, cache writes, output."""
    fresh = max(0, billed.input - billed.cached - billed.cache_write)
    return {"input": fresh * price.input / TOKENS_PER_PRICE_UNIT,
            "cached": billed.cached * price.cached_input / TOKENS_PER_PRICE_UNIT,
            "cache_write": billed.cache_write * price.cache_write / TOKENS_PER_PRICE_UNIT,
            "output": billed.output * price.output / TOKENS_PER_PRICE_UNIT}


def cost_usd(billed: Billed, price: Price) -> float:
    return sum(cost_parts(billed, price).values())


def usage_cost(usage: Mapping[str, Any] | None, prices: Mapping[str, Price]
               ) -> dict[str, Any]:
    """The cost of one run's usage (or of several, summed by :func:`total_usage`):
    ``{"usd", "basis", "by_candidate"}``. ``usd`` is null when a candidate that billed tokens
    has no price (``basis`` names it): a figure that leaves a bill out would read as the total."""
    by_candidate = (usage or {}).get("by_candidate") or {}
    if not by_candidate:
        return {"usd": 0.0, "basis": NO_USAGE, "by_candidate": {}}
    costs: dict[str, float | None] = {}
    for candidate, counts in sorted(by_candidate.items()):
        price = prices.get(candidate)
        costs[candidate] = (None if price is None
                            else round(cost_usd(Billed.of(counts), price), USD_DIGITS))
    unpriced = [c for c, usd in costs.items() if usd is None]
    if unpriced:
        return {"usd": None, "basis": f"no price for {', '.join(unpriced)} in prices:",
                "by_candidate": costs}
    return {"usd": round(sum(u for u in costs.values() if u is not None), USD_DIGITS),
            "basis": PRICED, "by_candidate": costs}


def total_usage(usages: Iterable[Mapping[str, Any] | None]) -> dict[str, Any]:
    """Several runs' usage added up, in total and per candidate (a session's, say)."""
    total: dict[str, Any] = {"calls": 0, **dict.fromkeys(USAGE_KINDS, 0), "by_candidate": {}}
    for usage in usages:
        for candidate, counts in ((usage or {}).get("by_candidate") or {}).items():
            mine = total["by_candidate"].setdefault(
                candidate, {"calls": 0, **dict.fromkeys(USAGE_KINDS, 0)})
            for into in (total, mine):
                into["calls"] += int(counts.get("calls") or 0)
                for kind in USAGE_KINDS:
                    into[kind] += int(counts.get(kind) or 0)
    return total
