"""The growth rate the append keeps on the session row, on PostgreSQL (``compactd_append``) and
SQLite alike, and the runway ``compactd status`` lists from it."""

from __future__ import annotations

import datetime as dt
import json
import re
import subprocess

import pytest

from compactd.storage.messages import Message, parse_openai
from compactd.storage.records import decayed_growth_rate, next_growth_rate, utcnow
from compactd.storage.store import Store
from tests.conftest import run_cli

T0 = dt.datetime(2026, 12, 1, 12, 0, tzinfo=dt.UTC)


def words(n: int, i: int = 0) -> Message:
    return parse_openai({"role": "user", "content": " ".join(f"w{i}x{k}" for k in range(n))})


async def test_each_append_moves_the_stored_rate_as_the_formula_says(store: Store) -> None:
    created = await store.create_session("s1", run_model="gpt-4o", now=T0)
    assert created.growth_rate == 0.0
    expected, last = 0.0, T0
    # Irregular gaps, a batch of two, and two appends in the same instant.
    for i, (gap_s, sizes) in enumerate([(3, (40,)), (10, (40, 80)), (0, (20,)), (7.5, (200,)),
                                        (60, (10,)), (0.25, (30,))]):
        at = last + dt.timedelta(seconds=gap_s)
        r = await store.append("s1", [words(n, i) for n in sizes], now=at)
        expected = next_growth_rate(expected, sum(r.tokens), gap_s)
        last = at
        # SQLite's date functions keep milliseconds, as doubles of days.
        assert r.session.growth_rate == pytest.approx(expected, rel=1e-6), i
    # Stored, not only returned; and read back decayed by the idle time.
    info = await store.get_session("s1")
    assert info.growth_rate == pytest.approx(expected, rel=1e-6)
    assert info.growth_rate_at(last + dt.timedelta(seconds=30)) == pytest.approx(
        decayed_growth_rate(expected, 30))


async def test_a_steady_session_converges_to_its_real_rate(store: Store) -> None:
    await store.create_session("s1", run_model="gpt-4o", now=T0)
    at = T0
    for i in range(60):
        at += dt.timedelta(seconds=10)
        r = await store.append("s1", [words(50, i)], now=at)
    per_step = r.tokens[0]
    # Each step is the same size (one word per count): per_step tokens every 10 s.
    assert r.session.growth_rate == pytest.approx(per_step / 10, rel=0.02)


async def test_growing_sessions_leave_out_idle_ones_and_the_oldest_live_signal_is_found(
        store: Store) -> None:
    now = utcnow()
    for sid in ("busy", "idle", "new"):
        await store.create_session(sid, run_model="gpt-4o", now=now - dt.timedelta(hours=2))
    await store.append("busy", [words(30)], now=now - dt.timedelta(seconds=5))
    await store.append("idle", [words(30)], now=now - dt.timedelta(hours=1))
    assert [s.id for s in await store.growing_sessions(now=now)] == ["busy"]

    # "busy" and "idle" are over their sweep thresholds, "new" (no append) is not.
    await store.resolve_sweep_thresholds(key="k",
                                         resolve=lambda info: {"tokens": 10, "messages": None})
    assert await store.oldest_signal() is None
    first = now - dt.timedelta(seconds=40)
    assert await store.mark_signal("idle", ttl_s=60, now=first)
    assert await store.mark_signal("busy", ttl_s=60, now=now - dt.timedelta(seconds=3))
    assert await store.oldest_signal() == first
    # An older mark on a session under its threshold is no work waiting (a lost message on a
    # session another run relieved): no run will clear it, and it is not counted.
    assert await store.mark_signal("new", ttl_s=60, now=now - dt.timedelta(hours=1))
    assert await store.oldest_signal() == first


def test_cli_status_lists_the_least_runway_first(db_url: str, cli_env: dict[str, str]) -> None:
    import asyncio

    async def seed() -> None:
        store = Store.from_url(db_url)
        try:
            start = utcnow() - dt.timedelta(seconds=60)
            # A session that never appended has no growth to measure.
            await store.create_session("still", run_model="gpt-4o", context_window=20_000,
                                       now=start)
            # Same history and window, three growth rates.
            for sid, words_per_step in (("slow", 5), ("fast", 120), ("mid", 30)):
                await store.create_session(sid, run_model="gpt-4o", context_window=20_000,
                                           now=start)
                await store.append(sid, [words(3_000, 9)], now=start)
                for k in range(1, 7):
                    await store.append(sid, [words(words_per_step, k)],
                                       now=start + dt.timedelta(seconds=10 * k))
        finally:
            await store.close()

    asyncio.run(seed())
    cli_env["COMPACTD_DATABASE_URL"] = db_url

    def status(*args: str) -> subprocess.CompletedProcess[str]:
        return run_cli(cli_env, "status", *args, check=False, timeout=120)

    before = utcnow()
    out = status("--json")
    after = utcnow()
    assert out.returncode == 0, out.stderr
    listed = json.loads(out.stdout)["runway"]
    assert [r["session"] for r in listed] == ["fast", "mid", "slow"]

    async def bounds() -> dict[str, tuple[float, float]]:
        store = Store.from_url(db_url)
        try:
            found = {}
            for sid in ("fast", "mid", "slow"):
                info = await store.get_session(sid)
                headroom = 20_000 - info.surface_tokens
                # The runway lengthens as the rate decays: it lies between these two.
                found[sid] = (headroom / info.growth_rate_at(before),
                              headroom / info.growth_rate_at(after))
            return found
        finally:
            await store.close()

    bounds_by = asyncio.run(bounds())
    for r in listed:
        lo, hi = bounds_by[r["session"]]
        assert lo - 0.1 <= r["runway_s"] <= hi + 0.1, r
        assert r["window"] == 20_000

    text = status().stdout
    assert "growing sessions: 3 (least runway first" in text
    # Taken a moment later than the JSON: the same sessions, the seconds a little longer.
    assert re.search(rf"\n  fast: runway [0-9.]+ s, {listed[0]['tokens']}/20000 tokens, growing "
                     r"[0-9.]+ tokens/s\n", text), text
    assert text.index("  fast: ") < text.index("  mid: ") < text.index("  slow: ")
