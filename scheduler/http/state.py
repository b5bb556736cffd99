"""What the routes of one server process share (``Api``): the client with its engine and pool,
the tenants of the sessions seen, and the CPU processes that decode large append bodies."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import multiprocessing
import threading
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Annotated

from fastapi import Depends, Request
from starlette.exceptions import HTTPException as StarletteHTTPException

from compactd.scheduler.client import CompactdClient, SessionHandle
from compactd.scheduler.http.bodies import decode_append, decode_plain, raise_plain
from compactd.scheduler.http.errors import RETRY_AFTER_S
from compactd.storage.errors import SessionNotFound
from compactd.storage.records import SessionInfo
from compactd.storage.store import PreparedAppend, Store
from compactd.worker.settings import Config

logger = logging.getLogger(__name__)

_SESSION_CACHE_MAX = 100_000
# An append body over this is decoded, parsed and counted in the API's CPU processes (see
# Api.offload); under it the hop costs more than the work it moves.
OFFLOAD_BYTES = 32 * 1024
_WARM_BODY = b'{"messages": [{"role": "user", "content": "warm"}]}'
# How long a starting server waits for its CPU processes to start before it listens anyway.
CPU_WARM_S = 60.0
# How long a stopping server waits for its CPU processes to finish the bodies they are decoding
# before it kills them.
CPU_STOP_S = 5.0


class Api:
    """What the routes share: one client (one engine and pool) and the tenants of sessions."""

    def __init__(self, config: Config, client: CompactdClient) -> None:
        self.config = config
        self.client = client
        # A session's tenant never changes, so the check on the hot path (append, poll) reads
        # the database only the first time a process sees a session.
        self._sessions: dict[str, SessionInfo] = {}
        # The event loop answers every tenant: a 4 MB append decoded and counted on it held
        # every other request for seconds, and on a thread of this process it still shared the
        # GIL with the loop (docs/benchmarks.md, "Another tenant"). In a process of its own it
        # takes nothing from the loop but the bytes sent and the strings and numbers sent back.
        # 'spawn': a child inherits no event loop, connection or lock of this process.
        # The backend says how its batches are prepared, and whether they are worth preparing
        # in another process (one that holds the parsed messages costs the loop more to
        # unpickle than to build); with none, the thread below prepares them.
        self._prepare = client.store.db.prepare_append
        self._cpu_processes = client.store.db.append_processes(config.api.cpu_processes)
        self._processes: ProcessPoolExecutor | None = None
        if self._cpu_processes:
            self._processes = _process_pool(self._cpu_processes)
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compactd-api-cpu")
        self._warming: asyncio.Task[None] | None = None

    async def start(self, *, within_s: float = CPU_WARM_S,
                    stopping: asyncio.Event | None = None) -> None:
        """Start the CPU processes and wait, up to ``within_s``, until each has imported
        compactd and decoded a body: the lifespan awaits this before the server listens, so
        the first large append does not wait seconds for them. Past the bound the server
        listens anyway and they go on starting (the log says so). ``stopping`` set (the
        server got SIGTERM or SIGINT) ends the wait at once: the server is told to stop, not
        to serve, and a supervisor waits only so long."""
        self.start_in_background()
        if self._warming is None:
            return
        waits: set[asyncio.Future[object]] = {asyncio.shield(self._warming)}
        if stopping is not None:
            waits.add(asyncio.ensure_future(stopping.wait()))
        try:
            done, _ = await asyncio.wait(waits, timeout=within_s,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
        if stopping is not None and stopping.is_set():
            logger.info("stopping before the API's CPU processes were ready",
                        extra={"action": "api_cpu_start_stopped"})
        elif not done:
            logger.warning("the API's CPU processes were not ready within %g s; serving, and "
                           "the first large appends wait for them", within_s,
                           extra={"action": "api_cpu_slow_start"})

    def start_in_background(self) -> None:
        """Start the CPU processes without waiting for them (a pool that replaced a dead one)."""
        if self._processes is not None:
            self._warming = asyncio.get_running_loop().create_task(self._warm(self._processes))

    async def _warm(self, pool: ProcessPoolExecutor) -> None:
        loop = asyncio.get_running_loop()
        # One task each: the pool starts a process for each task no idle process takes.
        warm = functools.partial(decode_plain, _WARM_BODY, "application/json", None,
                                 self._prepare)
        with contextlib.suppress(BrokenProcessPool, RuntimeError):
            await asyncio.gather(*(loop.run_in_executor(pool, warm)
                                   for _ in range(self._cpu_processes)))

    def close(self) -> None:
        # Processes still warming up are not waited for: they are importing, not decoding a body.
        starting = self._warming is not None and not self._warming.done()
        if self._warming is not None:
            self._warming.cancel()
        if self._processes is not None:
            _stop_pool(self._processes, finish_s=0.0 if starting else CPU_STOP_S)
        self._thread.shutdown(wait=False, cancel_futures=True)

    def decode(self, raw: bytes, content_type: str | None,
               run_model: str | None) -> PreparedAppend:
        """An append body decoded, validated, parsed and counted (see ``decode_append``) as
        the store's backend takes it, on the event loop: for small bodies."""
        return decode_append(raw, content_type, run_model, prepare=self._prepare)

    async def offload(self, raw: bytes, content_type: str | None,
                      run_model: str | None) -> PreparedAppend:
        """``decode`` off the event loop."""
        loop = asyncio.get_running_loop()
        pool = self._processes
        if pool is None:
            return await loop.run_in_executor(self._thread, functools.partial(
                decode_append, raw, content_type, run_model, prepare=self._prepare))
        try:
            outcome = await loop.run_in_executor(
                pool, functools.partial(decode_plain, raw, content_type, run_model,
                                        self._prepare))
        except BrokenProcessPool:
            # A CPU process died (killed, out of memory): the next request gets a new pool.
            if self._processes is pool:
                logger.warning("an API CPU process died; starting new ones",
                               extra={"action": "api_cpu_restart"})
                self._processes = _process_pool(self._cpu_processes)
                self.start_in_background()
            raise StarletteHTTPException(
                503, "the body could not be processed; retry",
                headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        return raise_plain(outcome)

    @property
    def store(self) -> Store:
        return self.client.store

    def wait_s(self, asked: float | None) -> float:
        limit = self.config.api.max_wait_s
        return limit if asked is None else min(asked, limit)

    async def owned(self, session_id: str, tenant: str, *, fresh: bool = False) -> SessionInfo:
        """The session, if ``tenant`` owns it; another tenant's is not found, like a missing one."""
        info = None if fresh else self._sessions.get(session_id)
        if info is None:
            info = await self.store.get_session(session_id)
            self.remember(info)
        if info.tenant != tenant:
            raise SessionNotFound(session_id)
        return info

    def remember(self, info: SessionInfo) -> None:
        if len(self._sessions) >= _SESSION_CACHE_MAX:
            self._sessions.clear()
        self._sessions[info.id] = info

    def forget(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)

    def handle(self, info: SessionInfo) -> SessionHandle:
        return SessionHandle(self.client, info)


def _process_pool(processes: int) -> ProcessPoolExecutor:
    return ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn"))


def _stop_pool(pool: ProcessPoolExecutor, *, finish_s: float = CPU_STOP_S) -> None:
    """End the CPU processes before the server's process ends, giving the bodies they are
    decoding ``finish_s`` to finish.

    uvicorn ends a server stopped by SIGTERM by raising the signal again once the lifespan has
    shut down, so the process dies at once: a pool shut down without waiting never delivers its
    stop messages (a feeder thread writes them), and the processes it started wait for work
    forever, each holding multiprocessing's resource tracker open. Waiting here, bounded, ends
    them; the tracker ends when the last of them and the server are gone."""
    stopping = threading.Thread(target=pool.shutdown, kwargs={"cancel_futures": True},
                                name="compactd-api-cpu-stop", daemon=True)
    stopping.start()
    stopping.join(finish_s)
    if stopping.is_alive():
        # A process stuck in a body (or stopped): the pool notices it die and finishes.
        for child in multiprocessing.active_children():
            child.kill()
        stopping.join(CPU_STOP_S)


def api_of(request: Request) -> Api:
    api: Api = request.app.state.api
    return api


ApiDep = Annotated[Api, Depends(api_of)]
