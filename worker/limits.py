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

Without Redis (the embedded default) the same meter runs in process.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from worker.keys import RATE_PREFIX

# KEYS[1] = meter key; ARGV = now_s, interval_s, burst_s. Returns the wait in seconds (string).
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
return tostring(wait)
"""


class Limiter(Protocol):
    async def acquire(self, name: str, rate_per_s: float) -> float:
        """Reserve a slot on meter ``name`` and sleep until it; returns the seconds waited."""
        ...


# How much wider than 1/rate the slots are (see the module's docstring).
JITTER_MARGIN = 0.05


def _check_rate(rate_per_s: float) -> float:
    if not rate_per_s > 0:
        raise ValueError(f"a rate must be positive, got {rate_per_s!r}")
    return (1.0 + JITTER_MARGIN) / rate_per_s


# After this many slots missed in a row the caller goes anyway (a late call beats none).
MAX_RESERVATIONS = 3


async def _wait_for_slot(reserve: Callable[[], Awaitable[float]], interval: float) -> float:
    """Reserve a slot and sleep until it, reserving again when woken a slot late; returns the
    seconds the meter asked for (lateness not included)."""
    loop = asyncio.get_running_loop()
    asked = 0.0
    for _ in range(MAX_RESERVATIONS):
        wait = await reserve()
        asked += wait
        if wait <= 0:
            break
        due = loop.time() + wait
        await asyncio.sleep(wait)
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

    async def acquire(self, name: str, rate_per_s: float) -> float:
        interval = _check_rate(rate_per_s)
        # The Redis server's clock would be the single source of truth, but EVAL cannot read
        # TIME before a write on older servers; workers run NTP, and the meter tolerates skew
        # of a few milliseconds as a slightly uneven spacing, never as a burst.

        async def reserve() -> float:
            return float(await self._script(keys=[RATE_PREFIX + name],
                                            args=[repr(self.clock()), repr(interval),
                                                  repr(interval * (self.burst - 1))]))

        return await _wait_for_slot(reserve, interval)


class LocalLimiter:
    """The same meter for one process (the embedded default)."""

    def __init__(self, *, burst: int = 1, clock: Callable[[], float] = time.monotonic) -> None:
        self.burst = burst
        self.clock = clock
        self._tat: dict[str, float] = {}

    async def acquire(self, name: str, rate_per_s: float) -> float:
        interval = _check_rate(rate_per_s)

        async def reserve() -> float:
            now = self.clock()
            tat = max(self._tat.get(name, now), now)
            self._tat[name] = tat + interval
            return max(0.0, tat - now - interval * (self.burst - 1))

        return await _wait_for_slot(reserve, interval)


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
