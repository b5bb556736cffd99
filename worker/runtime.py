"""Per-process async resources, and the one event loop that owns them.

Storage and model clients are async. An engine, pool, Redis connection or HTTP client must never
cross an event loop or a fork, so they are created inside the loop that uses them:

* :func:`open_deps` builds them inside the caller's running loop (the CLI's ``--inline``, the
  demo, tests) and closes them on exit.
* :class:`LoopThread` is what a Celery worker process uses: one event loop in a daemon thread,
  created lazily in the process that will use it (after any fork), serving every task thread of
  the threads pool. A task thread hands its coroutine over and waits for the result, so dozens of
  compactions wait on their models concurrently in one process.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from compactd.storage.errors import ConfigError
from compactd.storage.records import utcnow
from compactd.storage.store import Store
from compactd.worker.limits import Limiter, LocalLimiter, RedisLimiter
from compactd.worker.llm.breaker import Breaker, BreakerLimits, LocalBreaker, RedisBreaker
from compactd.worker.owners import format_owner, this_process
from compactd.worker.settings import Config

T = TypeVar("T")


def tune_gc(threshold: int) -> None:
    """Collect garbage less often in a worker process, and never rescan what startup loaded.

    A compaction allocates tens of thousands of short-lived containers (decoded payloads,
    messages, SDK request and response models) and frees nearly all of them by reference
    count. At Python's default first-generation threshold (700 allocations) the collector ran
    many times per compaction, each pass walking the live surfaces of every run in flight, and
    each full pass also the imported modules and SDKs. A higher threshold trades resident
    memory for CPU (docs/benchmarks.md gives both, and the command that measures them).
    Called before a prefork pool forks, the collector also no longer writes to the pages of the
    frozen objects in the children (reference counts still do).
    """
    if threshold <= 0:
        return
    gc.collect()
    gc.freeze()
    _, middle, oldest = gc.get_threshold()
    gc.set_threshold(threshold, middle, oldest)


def new_worker_loop(choice: str) -> Callable[[], asyncio.AbstractEventLoop]:
    """What makes a worker process's event loop, for ``worker.event_loop``.

    uvloop (libuv, in C) runs the loop's own work, its sockets and the cross-thread handoffs
    of every task with less CPU than asyncio's pure-Python selector loop. ``auto`` takes it
    when it is installed; ``uvloop`` insists on it (a worker that cannot have it does not
    start); ``asyncio`` is the standard loop.
    """
    if choice == "asyncio":
        return asyncio.new_event_loop
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise ConfigError("worker.event_loop: uvloop is not installed "
                              "(pip install uvloop, or set it to auto or asyncio)") from None
        return asyncio.new_event_loop
    return uvloop.new_event_loop


def default_owner() -> str:
    """Who holds a lease: host, pid and PID namespace (worker.owners), enough to find the
    process in an incident and for a worker of the same namespace to tell it is gone."""
    return format_owner(this_process())


@dataclass
class Deps:
    """Everything the orchestration touches, built inside one event loop."""

    config: Config
    store: Store
    limiter: Limiter
    owner: str
    redis: Any = None
    models: Any = None  # worker.llm client registry, created on first use
    breaker: Breaker | None = None  # the summary candidates' circuits (worker.llm.breaker)
    clock: Callable[[], Any] = utcnow
    # The process's recall indexer (worker.orchestration.BackgroundIndexer), made on first use.
    indexer: Any = None
    # Compaction runs in progress on this loop (the indexer defers to them).
    runs_in_flight: int = 0
    # This process's runs whose end could not be written (worker.run.UnendedRuns), made on
    # first use.
    unended: Any = None

    async def aclose(self) -> None:
        if self.indexer is not None:
            await self.indexer.aclose()
        if self.unended is not None:
            await self.unended.aclose()
        if self.models is not None and hasattr(self.models, "aclose"):
            await self.models.aclose()
        if self.redis is not None:
            await self.redis.aclose()
        await self.store.close()


@contextlib.asynccontextmanager
async def open_deps(config: Config, *, owner: str | None = None,
                    pool_size: int = 10) -> AsyncIterator[Deps]:
    deps = await build_deps(config, owner=owner, pool_size=pool_size)
    try:
        yield deps
    finally:
        await deps.aclose()


async def build_deps(config: Config, *, owner: str | None = None,
                     pool_size: int | None = None) -> Deps:
    """Without ``pool_size``, a worker process's: ``worker.db_pool_size`` connections, no more."""
    if pool_size is None:
        # Half the pool is kept for the statements every compaction runs (claim, surface
        # read, commits, loop guard, signal clear); the rest, never less than one, serves
        # the transactions (lease renewals, run ends, the reaper), which never take a kept one.
        pool = config.worker.db_pool_size
        store = Store.from_url(config.database_url, pool_size=pool, max_overflow=0,
                               kept_connections=pool // 2,
                               statement_cache=config.database.statement_cache)
    else:
        store = Store.from_url(config.database_url, pool_size=pool_size,
                               statement_cache=config.database.statement_cache)
    from compactd.storage.migrate import open_schema

    await open_schema(store.engine, config.database_url)
    redis = None
    limiter: Limiter = LocalLimiter()
    limits = BreakerLimits.from_config(config.worker)
    breaker: Breaker = LocalBreaker(limits)
    if config.redis_url:
        import redis.asyncio as aioredis

        redis = aioredis.from_url(config.redis_url, health_check_interval=30)
        limiter = RedisLimiter(redis)
        breaker = RedisBreaker(redis, limits)
    return Deps(config=config, store=store, limiter=limiter, owner=owner or default_owner(),
                redis=redis, breaker=breaker)


class EventLoopThread:
    """An event loop running in a daemon thread; other threads hand it coroutines."""

    def __init__(self, name: str = "compactd-loop", *,
                 new_loop: Callable[[], asyncio.AbstractEventLoop] = asyncio.new_event_loop
                 ) -> None:
        self.pid = os.getpid()
        self.loop = new_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self._ready.wait()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._ready.set)
        self.loop.run_forever()

    def submit(self, make: Callable[[], Awaitable[T]], timeout: float | None = None) -> T:
        """Run ``make()`` on the loop and wait for its result from this thread."""

        async def runner() -> T:
            return await make()

        future = asyncio.run_coroutine_threadsafe(runner(), self.loop)
        try:
            return future.result(timeout)
        except BaseException:
            future.cancel()
            raise

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self.loop.close()


class LoopThread(EventLoopThread):
    """The worker process's loop, with the process's :class:`Deps` inside it."""

    def __init__(self, config: Config) -> None:
        # The SDKs its models need were imported at worker start (worker.tasks), not here: the
        # first task creates this thread, and it must not wait for them.
        super().__init__(new_loop=new_worker_loop(config.worker.event_loop))
        self.config = config
        self.deps: Deps = self.submit(lambda: build_deps(config))

    def run(self, coro_fn: Callable[[Deps], Coroutine[Any, Any, T]],
            timeout: float | None = None) -> T:
        return self.submit(lambda: coro_fn(self.deps), timeout)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.submit(self.deps.aclose, timeout=10)
        self.stop()


_current: LoopThread | None = None
_current_lock = threading.Lock()


def process_loop(config: Config) -> LoopThread:
    """This process's loop thread, created on first use (so never inherited across a fork)."""
    global _current
    with _current_lock:
        if _current is None or _current.pid != os.getpid():
            _current = LoopThread(config)
        return _current


def reset_process_loop() -> None:
    """Forget the loop after a fork (Celery's ``worker_process_init``)."""
    global _current
    with _current_lock:
        _current = None
