"""A circuit breaker per summary candidate, shared by every run of every worker.

A candidate that hangs or keeps failing costs each run that asks it its whole time budget before
the next candidate gets a turn. Retries and the deadline bound one run; they do not tell the next
run what this one learned. So each candidate's endpoint (provider, model id, base URL) has a
circuit in Redis, like the provider rate meter (``worker.limits``):

* **closed**: calls go through. A call that fails with a kind in
  :data:`~worker.llm.errors.CIRCUIT_KINDS` (a timeout, a hang the deadline ended, a connection or
  server error, a broken key or model) adds one to its count of failures in a row; any answer
  (accepted or refused by validation: the provider is up) resets it.
* **open**: after ``failures`` in a row, every run skips the candidate at once for
  ``cooldown_s``, recorded as that candidate's ``circuit_open`` failure.
* **half-open**: after the cool-down, one call is let through as a probe while the others still
  skip; its answer closes the circuit, its failure opens it for another cool-down. A probe whose
  result never comes (its worker died) holds the circuit for at most ``probe_s``, the longest a
  candidate's call may take, and then another run probes.

A count of failures in a row is forgotten ``FAILURE_MEMORY_S`` after its last change: failures an
hour apart say nothing about whether the endpoint is down now.

Without Redis (the embedded default) the same circuit is kept in process. A Redis error never
stops a call: the breaker is an optimisation, and a broker outage must not cost compaction its
models.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from compactd.worker.keys import BREAKER_PREFIX
from compactd.worker.llm.candidates import Candidate
from compactd.worker.settings import WorkerConfig

logger = logging.getLogger(__name__)

FAILURE_MEMORY_S = 3600.0
# A circuit read or write that takes longer than this is given up (the call goes on): an
# unreachable Redis must not hold a run that could be calling its model.
REDIS_TIMEOUT_S = 2.0

# KEYS[1] = the circuit; ARGV = now_s, probe_s, ttl_ms. Returns {state, failures, seconds}:
# closed | open (seconds left of the cool-down) | probing (seconds left of the probe in flight)
# | probe (this caller is the probe).
_ADMIT = """
local open_until = tonumber(redis.call('HGET', KEYS[1], 'open_until') or '0')
if open_until == 0 then return {'closed', '0', '0'} end
local now = tonumber(ARGV[1])
local failures = redis.call('HGET', KEYS[1], 'failures') or '0'
if now < open_until then return {'open', failures, tostring(open_until - now)} end
local probe_until = tonumber(redis.call('HGET', KEYS[1], 'probe_until') or '0')
if now < probe_until then return {'probing', failures, tostring(probe_until - now)} end
redis.call('HSET', KEYS[1], 'probe_until', tostring(now + tonumber(ARGV[2])))
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return {'probe', failures, '0'}
"""

# KEYS[1] = the circuit; ARGV = now_s, failed (0/1), failures to open, cooldown_s, ttl_ms.
# Returns the failures in a row when this failure opened the circuit, else 0.
_RECORD = """
if ARGV[2] == '0' then
  redis.call('DEL', KEYS[1])
  return 0
end
local failures = redis.call('HINCRBY', KEYS[1], 'failures', 1)
local open_until = tonumber(redis.call('HGET', KEYS[1], 'open_until') or '0')
local opened = 0
if failures >= tonumber(ARGV[3]) or open_until > 0 then
  redis.call('HSET', KEYS[1], 'open_until', tostring(tonumber(ARGV[1]) + tonumber(ARGV[4])))
  redis.call('HDEL', KEYS[1], 'probe_until')
  opened = failures
end
redis.call('PEXPIRE', KEYS[1], ARGV[5])
return opened
"""


def circuit_key(candidate: Candidate) -> str:
    """The circuit of ``candidate``'s endpoint: two names for one endpoint share it."""
    spec = candidate.spec
    base_url = (spec.base_url or "") if spec is not None else ""
    return f"{BREAKER_PREFIX}{candidate.provider}:{candidate.model_id}" + (
        f"@{base_url}" if base_url else "")


class Breaker(Protocol):
    async def admit(self, candidate: Candidate) -> str | None:
        """None when ``candidate`` may be called now, else why it is skipped."""
        ...

    async def record(self, candidate: Candidate, *, failed: bool) -> None:
        """The outcome of a call :meth:`admit` let through."""
        ...


@dataclass(frozen=True, slots=True)
class BreakerLimits:
    failures: int = 3
    cooldown_s: float = 120.0
    probe_s: float = 90.0

    @classmethod
    def from_config(cls, worker: WorkerConfig) -> BreakerLimits:
        # A probe holds the circuit as long as one candidate's call may take.
        return cls(worker.breaker.failures, worker.breaker.cooldown_s,
                   worker.candidate_budget_s)

    @property
    def ttl_ms(self) -> int:
        return int((self.cooldown_s + self.probe_s + FAILURE_MEMORY_S) * 1000)


def _verdict(state: str, failures: int, seconds: float) -> str | None:
    if state == "open":
        return (f"circuit open: {failures} failed calls in a row; skipped for "
                f"{seconds:.0f} s more")
    if state == "probing":
        return (f"circuit open: {failures} failed calls in a row, and another run's call is "
                f"probing it (for up to {seconds:.0f} s more)")
    return None


def _opened(candidate: Candidate, failures: int, limits: BreakerLimits) -> None:
    logger.warning("model %s failed %d calls in a row: skipped for %.0f s", candidate.name,
                   failures, limits.cooldown_s,
                   extra={"action": "llm.circuit_open", "candidate": candidate.name,
                          "failures": failures, "cooldown_s": limits.cooldown_s})


class RedisBreaker:
    """Circuits in Redis, shared by every worker on the broker."""

    def __init__(self, redis: Any, limits: BreakerLimits, *,
                 clock: Callable[[], float] = time.time) -> None:
        self.limits = limits
        self.clock = clock
        self._admit = redis.register_script(_ADMIT)
        self._record = redis.register_script(_RECORD)

    async def admit(self, candidate: Candidate) -> str | None:
        from redis.exceptions import RedisError

        try:
            async with asyncio.timeout(REDIS_TIMEOUT_S):
                state, failures, seconds = await self._admit(
                    keys=[circuit_key(candidate)],
                    args=[repr(self.clock()), repr(self.limits.probe_s), self.limits.ttl_ms])
        except (RedisError, OSError, TimeoutError):
            logger.debug("circuit of %s unreadable: calling it", candidate.name, exc_info=True,
                         extra={"action": "llm.circuit_unknown", "candidate": candidate.name})
            return None
        return _verdict(_text(state), int(failures), float(seconds))

    async def record(self, candidate: Candidate, *, failed: bool) -> None:
        from redis.exceptions import RedisError

        limits = self.limits
        try:
            async with asyncio.timeout(REDIS_TIMEOUT_S):
                opened = await self._record(
                    keys=[circuit_key(candidate)],
                    args=[repr(self.clock()), "1" if failed else "0", limits.failures,
                          repr(limits.cooldown_s), limits.ttl_ms])
        except (RedisError, OSError, TimeoutError):
            logger.debug("circuit of %s not updated", candidate.name, exc_info=True,
                         extra={"action": "llm.circuit_unknown", "candidate": candidate.name})
            return
        if int(opened):
            _opened(candidate, int(opened), limits)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


@dataclass
class _Circuit:
    failures: int = 0
    open_until: float = 0.0
    probe_until: float = 0.0
    touched: float = 0.0


class LocalBreaker:
    """The same circuits for one process (the embedded default), shared by its event loops."""

    def __init__(self, limits: BreakerLimits, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self.clock = clock
        self._circuits: dict[str, _Circuit] = {}
        self._lock = threading.Lock()

    def _get(self, key: str, now: float) -> _Circuit:
        circuit = self._circuits.get(key)
        if circuit is None or now - circuit.touched >= self.limits.ttl_ms / 1000:
            circuit = self._circuits[key] = _Circuit(touched=now)
        return circuit

    async def admit(self, candidate: Candidate) -> str | None:
        with self._lock:
            now = self.clock()
            circuit = self._get(circuit_key(candidate), now)
            if not circuit.open_until:
                return None
            if now < circuit.open_until:
                return _verdict("open", circuit.failures, circuit.open_until - now)
            if now < circuit.probe_until:
                return _verdict("probing", circuit.failures, circuit.probe_until - now)
            circuit.probe_until = now + self.limits.probe_s
            circuit.touched = now
            return None

    async def record(self, candidate: Candidate, *, failed: bool) -> None:
        limits = self.limits
        with self._lock:
            key = circuit_key(candidate)
            if not failed:
                self._circuits.pop(key, None)
                return
            now = self.clock()
            circuit = self._get(key, now)
            circuit.failures += 1
            circuit.touched = now
            opened = circuit.failures >= limits.failures or circuit.open_until > 0
            if opened:
                circuit.open_until = now + limits.cooldown_s
                circuit.probe_until = 0.0
        if opened:
            _opened(candidate, circuit.failures, limits)
