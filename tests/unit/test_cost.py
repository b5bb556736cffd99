"""worker.cost: a run's usage at the configured prices, and several runs' usage added up."""

from __future__ import annotations

from typing import Any

import pytest

from compactd.worker.cost import (
    NO_USAGE,
    PRICED,
    Billed,
    Price,
    cost_parts,
    total_usage,
    usage_cost,
)

OPENAI = Price(input=2.0, cached_input=0.5, cache_write=2.0, output=8.0)
ANTHROPIC = Price(input=3.0, cached_input=0.3, cache_write=3.75, output=15.0)


def counts(calls: int, input_tokens: int, cached: int = 0, written: int = 0,
           output: int = 0) -> dict[str, int]:
    return {"calls": calls, "input_tokens": input_tokens, "cached_tokens": cached,
            "cache_write_tokens": written, "output_tokens": output}


@pytest.mark.parametrize(("billed", "price", "parts"), [
    # A million fresh input tokens cost the input price; cached ones the cached price.
    (Billed(input=1_000_000), OPENAI, {"input": 2.0, "cached": 0.0, "cache_write": 0.0,
                                       "output": 0.0}),
    (Billed(input=1_000_000, cached=750_000, output=1_000), OPENAI,
     {"input": 0.5, "cached": 0.375, "cache_write": 0.0, "output": 0.008}),
    # Anthropic: input counts reads and writes too; what is left is fresh.
    (Billed(input=10_000, cached=6_000, cache_write=3_000, output=500), ANTHROPIC,
     {"input": 0.003, "cached": 0.0018, "cache_write": 0.01125, "output": 0.0075}),
    # Usage that says more cached than input (a provider's rounding) never goes negative.
    (Billed(input=100, cached=200), OPENAI, {"input": 0.0, "cached": 0.0001,
                                             "cache_write": 0.0, "output": 0.0}),
    (Billed(), ANTHROPIC, {"input": 0.0, "cached": 0.0, "cache_write": 0.0, "output": 0.0}),
])
def test_each_part_of_a_bill_is_its_tokens_at_its_price(
        billed: Billed, price: Price, parts: dict[str, float]) -> None:
    assert cost_parts(billed, price) == pytest.approx(parts)


def test_a_run_without_provider_usage_costs_nothing_and_says_why() -> None:
    for usage in (None, {}, {"calls": 0, "by_candidate": {}}):
        assert usage_cost(usage, {"gpt": OPENAI}) == {"usd": 0.0, "basis": NO_USAGE,
                                                      "by_candidate": {}}


def test_a_run_is_priced_per_candidate_and_a_missing_price_leaves_no_total() -> None:
    usage: dict[str, Any] = {"by_candidate": {"gpt": counts(2, 1_000_000, 500_000, 0, 10_000),
                                              "claude": counts(1, 100_000, 0, 100_000, 0)}}
    cost = usage_cost(usage, {"gpt": OPENAI, "claude": ANTHROPIC})
    assert cost == {"usd": pytest.approx(1.25 + 0.08 + 0.375), "basis": PRICED,
                    "by_candidate": {"claude": pytest.approx(0.375),
                                     "gpt": pytest.approx(1.33)}}
    unpriced = usage_cost(usage, {"gpt": OPENAI})
    assert unpriced["usd"] is None
    assert unpriced["basis"] == "no price for claude in prices:"
    assert unpriced["by_candidate"] == {"claude": None, "gpt": pytest.approx(1.33)}


def test_runs_add_up_per_candidate_and_old_rows_without_cache_writes_count_zero() -> None:
    old_row = {"by_candidate": {"gpt": {"calls": 1, "input_tokens": 100, "cached_tokens": 50,
                                        "output_tokens": 7}}}
    new_row = {"by_candidate": {"gpt": counts(2, 300, 100, 0, 20),
                                "claude": counts(1, 40, 10, 20, 5)}}
    total = total_usage([old_row, None, new_row])
    assert total["by_candidate"] == {"gpt": counts(3, 400, 150, 0, 27),
                                     "claude": counts(1, 40, 10, 20, 5)}
    assert {k: total[k] for k in ("calls", "input_tokens", "cached_tokens",
                                  "cache_write_tokens", "output_tokens")} == counts(
        4, 440, 160, 20, 32)
    # The session's cost is the cost of its summed usage: the sum of its runs' costs.
    prices = {"gpt": OPENAI, "claude": ANTHROPIC}
    runs = [usage_cost(u, prices)["usd"] for u in (old_row, new_row)]
    assert usage_cost(total, prices)["usd"] == pytest.approx(sum(runs), abs=1e-6)
