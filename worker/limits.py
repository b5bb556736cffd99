"""Rate limits shared by every worker: a GCRA meter in Redis.

Provider quotas and bulk-job rates are global, so the limiter lives in Redis, not in Celery's
per-worker ``rate_limit``. Each acquire atomically reserves the next slot on a schedule spaced
``1/rate`` apart (no burst beyond ``burst`` slots) and returns how long the caller must wait for it;
the caller sleeps that long without holding anything. Because slots are reserved, waiting callers
never race each other, and the observed rate over any window stays at or under the configured one.

Slots are spaced 5% wider than ``1/rate``: a call leaves some milliseconds after its slot (the
SDK builds the request, the network delivers it), unevenly, and at full load that jitter alone
would let a provider count a few calls over the rate in some one-second window.

A caller that wakes a whole interval or more after its slot (its process was descheduled, or its
event loop busy) gives the slot up and reserves again: otherwise every caller due during the stall
would send at the same instant, and the provider would see a burst over the rate.

A caller cancelled while it waits (its run hit its deadline, its bulk fan-out was stopped) gives
its slot back, so the meter does not keep callers that are gone: a freed slot is remembered, and
the schedule's end moves back over freed slots only while they are the last ones reserved (moving
it back over a slot someone still holds would send two calls in one slot).

Without Redis (the embedded default) the same meter runs in process.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from compactd.worker.keys import RATE_PREFIX

# KEYS[1] = meter key; ARGV = now_s, interval_s, burst_s. Returns the wait in seconds and the
# slot reserved (the schedule time it was given), as strings.
_GCRA = """
local now = tonumber(ARGV[1])
local interval = tonumber(ARGV[2])
local burst = tonumber(ARGV[3])
local tat = tonumber(redis.call('GET', KEYS[1]) or '0')
if tat < now then tat = now end
local wait = tat - now - burst
if wait < 0 then wait = 0 end
local new_tat = tat + interval
redis.call('SET', KEYS[1], tostring(new_tat), 'PX', math.ceil((new_tat - now + 1) * 1000))
return {tostring(wait), tostring(tat)}
"""

# KEYS[1] = meter key, KEYS[2] = its freed slots (a sorted set); ARGV = now_s, interval_s,
# slot. Frees the slot, then moves the schedule's end back over the freed slots at its end.
_RELEASE = """
local now = tonumber(ARGV[1])
local interval = tonumber(ARGV[2])
local slot = tonumber(ARGV[3])
local tat = tonumber(redis.call('GET', KEYS[1]) or '0')
if slot < now or tat <= now then return 0 end
redis.call('ZADD', KEYS[2], slot, ARGV[3])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', '(' .. tostring(now))
local eps = interval / 1000
local moved = 0
while tat - interval >= now - eps do
  local last = redis.call('ZRANGEBYSCORE', KEYS[2], tat - interval - eps, tat - interval + eps,
                          'LIMIT', 0, 1)
  if #last == 0 then break end
  redis.call('ZREM', KEYS[2], last[1])
  tat = tonumber(last[1])
  moved = moved + 1
end
local ttl = math.ceil((math.max(tat, slot) - now + 1) * 1000)
if moved > 0 then redis.call('SET', KEYS[1], tostring(tat), 'PX', ttl) end
redis.call('PEXPIRE', KEYS[2], ttl)
return moved
"""


class Limiter(Protocol):
    async def acquire(self, name: str, rate_per_s: float) -> float:
        """Reserve a slot on meter ``name`` and sleep until it; returns the seconds waited."""
        ...


# The sorted set of a meter's freed slots is its key plus this.
FREED_SUFFIX = ":freed"
# How much wider than 1/rate the slots are (see the module's docstring).
JITTER_MARGIN = 0.05


def _check_rate(rate_per_s: float) -> float:
    if not rate_per_s > 0:
        raise ValueError(f"a rate must be positive, got {rate_per_s!r}")
    return (1.0 + JITTER_MARGIN) / rate_per_s


# After this many slots missed in a row the caller goes anyway (a late call beats none).
MAX_RESERVATIONS = 3


async def _wait_for_slot(reserve: Callable[[], Awaitable[tuple[float, float]]],
                         release: Callable[[float], Awaitable[None]], interval: float) -> float:
    """Reserve a slot and sleep until it, reserving again when woken a slot late; returns the
    seconds the meter asked for (lateness not included). Cancelled while it waits, it gives the
    slot back before the cancellation goes on."""
    loop = asyncio.get_running_loop()
    asked = 0.0
    for _ in range(MAX_RESERVATIONS):
        wait, slot = await reserve()
        asked += wait
        if wait <= 0:
            break
        due = loop.time() + wait
        try:
            await asyncio.sleep(wait)
        except asyncio.CancelledError:
            if loop.time() < due:
                # Shielded: a second cancellation must not leave the slot half given back.
                await asyncio.shield(release(slot))
            raise
        if loop.time() - due < interval:
            break
    return asked


class RedisLimiter:
    def __init__(self, redis: Any, *, burst: int = 1,
                 clock: Callable[[], float] = time.time) -> None:
        self.redis = redis
        self.burst = burst
        self.clock = clock
        self._script = redis.register_script(_GCRA)
        self._release = redis.register_script(_RELEASE)

    async def acquire(self, name: str, rate_per_s: float) -> float:
        interval = _check_rate(rate_per_s)
        # The Redis server's clock would be the single source of truth, but EVAL cannot read
        # TIME before a write on older servers; workers run NTP, and the meter tolerates skew
        # of a few milliseconds as a slightly uneven spacing, never as a burst.

        key = RATE_PREFIX + name

        async def reserve() -> tuple[float, float]:
            wait, slot = await self._script(keys=[key], args=[
                repr(self.clock()), repr(interval), repr(interval * (self.burst - 1))])
            return float(wait), float(slot)

        async def release(slot: float) -> None:
            await self._release(keys=[key, key + FREED_SUFFIX],
                                args=[repr(self.clock()), repr(interval), repr(slot)])

        return await _wait_for_slot(reserve, release, interval)


class LocalLimiter:
    """The same meter for one process (the embedded default)."""

    def __init__(self, *, burst: int = 1, clock: Callable[[], float] = time.monotonic) -> None:
        self.burst = burst
        self.clock = clock
        self._tat: dict[str, float] = {}
        self._freed: dict[str, set[float]] = {}

    async def acquire(self, name: str, rate_per_s: float) -> float:
        interval = _check_rate(rate_per_s)

        async def reserve() -> tuple[float, float]:
            now = self.clock()
            tat = max(self._tat.get(name, now), now)
            self._tat[name] = tat + interval
            return max(0.0, tat - now - interval * (self.burst - 1)), tat

        async def release(slot: float) -> None:
            now = self.clock()
            tat = self._tat.get(name, now)
            if slot < now or tat <= now:
                return
            freed = self._freed.setdefault(name, set())
            freed.difference_update([s for s in freed if s < now])
            freed.add(slot)
            # Sums of floats drift: the freed slot at the end is found within a tolerance.
            eps = interval / 1000
            while (last := next((s for s in freed if abs(s - (tat - interval)) <= eps),
                                None)) is not None:
                freed.discard(last)
                tat = last
            self._tat[name] = tat

        return await _wait_for_slot(reserve, release, interval)


def parse_rate(text: str) -> float:
    """``"20/s"``, ``"600/m"``, ``"20"`` -> calls per second."""
    raw = text.strip().lower()
    per = 1.0
    if "/" in raw:
        raw, unit = raw.split("/", 1)
        per = {"s": 1.0, "sec": 1.0, "second": 1.0, "m": 60.0, "min": 60.0, "minute": 60.0,
               "h": 3600.0, "hour": 3600.0}.get(unit.strip(), 0.0)
        if not per:
            raise ValueError(f"unknown rate unit in {text!r} (use /s, /m or /h)")
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"not a rate: {text!r} (expected N/s)") from None
    if not value > 0 or value != value or value == float("inf"):
        raise ValueError(f"a rate must be a positive finite number, got {text!r}")
    return value / per


class MeteredProviders:
    """A provider source whose every HTTP call first takes a slot on each of ``meters``
    (name, rate per second); ``on_wait`` is told how long each slot was waited for."""

    def __init__(self, pool: Any, limiter: Limiter, meters: list[tuple[str, float]], *,
                 on_wait: Callable[[float], None] | None = None) -> None:
        self.pool = pool
        self.limiter = limiter
        self.meters = meters
        self.on_wait = on_wait

    def get(self, candidate: Any) -> Any:
        return _MeteredProvider(self.pool.get(candidate), self)

    def mark_broken(self, candidate: Any, reason: str) -> None:
        self.pool.mark_broken(candidate, reason)


class _MeteredProvider:
    def __init__(self, provider: Any, source: MeteredProviders) -> None:
        self.provider = provider
        self.source = source

    async def complete(self, *args: Any, **kwargs: Any) -> Any:
        source = self.source
        for name, rate in source.meters:
            waited = await source.limiter.acquire(name, rate)
            if source.on_wait is not None:
                source.on_wait(waited)
        return await self.provider.complete(*args, **kwargs)

    async def aclose(self) -> None:
        await self.provider.aclose()
