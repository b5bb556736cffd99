"""The growth rate, the largest recent step and the pressure each exist once per language: in
Python (``storage.records.growth_rate_after``, ``storage.records.step_tokens_after``,
``worker.compaction.triggers.pressure_tokens``) and in SQL (``compactd_append``'s UPDATE; the
sweep's stored flag ``storage.schema.OVER_SWEEP_SQL``).
The same inputs give the same results on PostgreSQL and on SQLite as in Python."""

from __future__ import annotations

import datetime as dt

import pytest

from compactd.storage.messages import Message, parse_openai
from compactd.storage.records import next_growth_rate, step_tokens_after
from compactd.storage.store import Store
from compactd.worker.compaction.triggers import pressure_tokens

T0 = dt.datetime(2026, 12, 1, 12, 0, tzinfo=dt.UTC)


def words(n: int, i: int = 0) -> Message:
    return parse_openai({"role": "user", "content": " ".join(f"w{i}x{k}" for k in range(n))})


# (seconds from creation to the first append, then to the second, words in each append)
GROWTH = [(0.0, 0.0, 10, 10), (30.0, 5.0, 200, 50), (600.0, 0.25, 5, 900),
          (1.5, 3600.0, 80, 1), (-2.0, 10.0, 40, 40)]  # an append dated before its session


@pytest.mark.parametrize(("first_s", "second_s", "a", "b"), GROWTH)
async def test_the_append_s_growth_rate_is_the_python_one(store: Store, first_s: float,
                                                          second_s: float, a: int,
                                                          b: int) -> None:
    await store.create_session("s", run_model="gpt-4o", now=T0)
    first = await store.append("s", [words(a)], now=T0 + dt.timedelta(seconds=first_s))
    second = await store.append("s", [words(b, 1)],
                                now=T0 + dt.timedelta(seconds=first_s + second_s))
    once = next_growth_rate(0.0, sum(first.tokens), first_s)
    twice = next_growth_rate(once, sum(second.tokens), second_s)
    # SQLite reads the seconds between appends through julianday, a count of days in a double:
    # they come out whole to some tens of microseconds, where PostgreSQL's are exact.
    rel = 1e-6 if store.engine.dialect.name == "sqlite" else 1e-9
    assert first.session.growth_rate == pytest.approx(once, rel=rel)
    assert second.session.growth_rate == pytest.approx(twice, rel=rel)


# Appends, each a batch of messages of these word counts: a first append that brings a history,
# steps that rise, a small one that decays the largest, a batch of two, and a larger one again.
STEPS = [[900, 900], [40], [300], [10], [10], [120, 200], [700]]


async def test_the_append_s_largest_step_is_the_python_one(store: Store) -> None:
    await store.create_session("s", run_model="gpt-4o", now=T0)
    expected = 0.0
    for i, batch in enumerate(STEPS):
        result = await store.append("s", [words(n, 10 * i + j) for j, n in enumerate(batch)],
                                    now=T0 + dt.timedelta(seconds=i))
        expected = step_tokens_after(expected, sum(result.tokens), first=i == 0)
        assert result.session.step_tokens == pytest.approx(expected, rel=1e-9), (i, batch)
    assert expected > 0
    assert (await store.get_session("s")).step_tokens == pytest.approx(expected, rel=1e-9)


# (words appended, the provider's reported input and output tokens or None)
PRESSURE = [(50, None), (50, (10, 5)), (50, (5_000, 200)), (400, (100, 0))]


@pytest.mark.parametrize(("n", "reported"), PRESSURE)
async def test_the_sweep_s_stored_flag_measures_the_python_pressure(
        store: Store, n: int, reported: tuple[int, int] | None) -> None:
    await store.create_session("s", run_model="gpt-4o", now=T0)
    info = (await store.append("s", [words(n)], now=T0)).session
    if reported is not None:
        info = await store.report_usage("s", *reported, surface_version=info.surface_version)
    # More appended after the report: the report's request grew by it.
    info = (await store.append("s", [words(n // 2, 1)], now=T0)).session
    pressure = pressure_tokens(info.surface_tokens, info.envelope_tokens, info.reported_tokens)
    assert info.lead_s == 0  # no lead: the flag counts no growth
    for floor, over in ((pressure, True), (pressure + 1, False)):
        await store.resolve_sweep_thresholds(
            key=str(floor), resolve=lambda _, f=floor: {"tokens": f, "messages": None})
        assert bool((await store.get_session("s")).over_sweep) is over, (floor, pressure)
