"""The candidates' circuits (worker.llm.breaker), the same table on both backends: Redis (shared
by every worker) and the in-process one of the embedded default. Time is a clock the test moves."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from compactd.worker.llm.breaker import BreakerLimits, LocalBreaker, RedisBreaker, circuit_key
from compactd.worker.llm.candidates import Candidate
from compactd.worker.settings import ModelSpec

HANGS = Candidate.from_spec(ModelSpec(name="hangs", provider="openai", model="gpt-x",
                                      base_url="http://127.0.0.1:1/v1"))
# Another name for the same endpoint shares its circuit; another endpoint does not.
ALIAS = Candidate.from_spec(ModelSpec(name="alias", provider="openai", model="gpt-x",
                                      base_url="http://127.0.0.1:1/v1"))
OTHER = Candidate.from_spec(ModelSpec(name="other", provider="openai", model="gpt-y",
                                      base_url="http://127.0.0.1:1/v1"))


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(params=["local", pytest.param("redis", marks=pytest.mark.redis)])
async def make(request: pytest.FixtureRequest) -> AsyncIterator[Any]:
    clients: list[Any] = []

    def build(limits: BreakerLimits, clock: Clock) -> Any:
        if request.param == "local":
            return LocalBreaker(limits, clock=clock)
        import redis.asyncio as aioredis

        client = aioredis.from_url(request.getfixturevalue("clean_redis"))
        clients.append(client)
        return RedisBreaker(client, limits, clock=clock)

    yield build
    for client in clients:
        await client.aclose()


async def _fail(breaker: Any, candidate: Candidate, times: int) -> None:
    for _ in range(times):
        await breaker.record(candidate, failed=True)


async def test_failures_in_a_row_open_the_circuit_and_an_answer_resets_the_count(
        make: Any) -> None:
    clock = Clock()
    breaker = make(BreakerLimits(failures=3, cooldown_s=60, probe_s=30), clock)
    await _fail(breaker, HANGS, 2)
    await breaker.record(HANGS, failed=False)  # an answer, even one validation refused
    await _fail(breaker, HANGS, 2)
    assert await breaker.admit(HANGS) is None, "two in a row since the answer: still closed"
    await _fail(breaker, HANGS, 1)
    reason = await breaker.admit(HANGS)
    assert reason is not None and reason.startswith("circuit open: 3 failed calls in a row"), \
        reason
    assert await breaker.admit(ALIAS) is not None, "one endpoint, one circuit"
    assert await breaker.admit(OTHER) is None


@pytest.mark.parametrize("failures", [1, 2, 5])
async def test_the_failures_setting_is_the_number_that_opens_it(make: Any, failures: int) -> None:
    breaker = make(BreakerLimits(failures=failures, cooldown_s=60, probe_s=30), Clock())
    await _fail(breaker, HANGS, failures - 1)
    assert await breaker.admit(HANGS) is None
    await _fail(breaker, HANGS, 1)
    assert await breaker.admit(HANGS) is not None


async def test_after_the_cooldown_one_probe_goes_and_its_outcome_decides(make: Any) -> None:
    clock = Clock()
    breaker = make(BreakerLimits(failures=1, cooldown_s=60, probe_s=30), clock)
    await _fail(breaker, HANGS, 1)
    clock.now += 59
    reason = await breaker.admit(HANGS)
    assert reason is not None and "skipped for 1 s more" in reason, reason
    clock.now += 1  # the cool-down is over: one caller probes, the others still skip
    assert await breaker.admit(HANGS) is None
    probing = await breaker.admit(HANGS)
    assert probing is not None and "probing" in probing, probing
    await breaker.record(HANGS, failed=True)  # the probe failed: open for another cool-down
    clock.now += 59
    assert await breaker.admit(HANGS) is not None
    clock.now += 1
    assert await breaker.admit(HANGS) is None  # the next probe
    await breaker.record(HANGS, failed=False)  # it answered: closed for everyone
    assert await breaker.admit(HANGS) is None and await breaker.admit(HANGS) is None


async def test_a_probe_that_never_reports_holds_the_circuit_for_probe_s_only(make: Any) -> None:
    clock = Clock()
    breaker = make(BreakerLimits(failures=1, cooldown_s=10, probe_s=30), clock)
    await _fail(breaker, HANGS, 1)
    clock.now += 10
    assert await breaker.admit(HANGS) is None  # its worker dies mid-call
    clock.now += 29
    assert await breaker.admit(HANGS) is not None
    clock.now += 1
    assert await breaker.admit(HANGS) is None


async def test_circuits_are_shared_by_breakers_on_one_redis(clean_redis: str) -> None:
    import redis.asyncio as aioredis

    limits = BreakerLimits(failures=2, cooldown_s=60, probe_s=30)
    a, b = aioredis.from_url(clean_redis), aioredis.from_url(clean_redis)
    try:
        worker_a, worker_b = RedisBreaker(a, limits), RedisBreaker(b, limits)
        await worker_a.record(HANGS, failed=True)
        await worker_b.record(HANGS, failed=True)
        assert await worker_a.admit(HANGS) is not None
        assert await a.exists(circuit_key(HANGS)) == 1
        assert 0 < await a.pttl(circuit_key(HANGS)) <= limits.ttl_ms
    finally:
        await a.aclose()
        await b.aclose()


async def test_a_redis_that_cannot_be_reached_never_stops_a_call() -> None:
    import redis.asyncio as aioredis

    client = aioredis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=0.5)
    try:
        breaker = RedisBreaker(client, BreakerLimits(failures=1))
        await breaker.record(HANGS, failed=True)
        assert await breaker.admit(HANGS) is None
    finally:
        await client.aclose()
