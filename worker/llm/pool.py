"""The providers built for one event loop: :class:`ProviderPool`.

Scope: an SDK client owns an HTTP connection pool, and connections belong to the event loop and
the process that opened them. A :class:`ProviderPool` therefore serves one event loop in one
process and refuses to be used from another. A worker process keeps one, in its one event loop
(``worker.runtime``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Mapping

from compactd.worker.llm.candidates import Availability, Candidate
from compactd.worker.llm.errors import Unavailable
from compactd.worker.llm.provider import Attribution, BuildError, Provider
from compactd.worker.llm.providers import build_provider
from compactd.worker.settings import WorkerConfig

logger = logging.getLogger(__name__)


class ProviderPool:
    """Built providers for one event loop, by candidate name.

    Building is lazy and guarded: a candidate whose client cannot be built is marked in
    ``availability`` (one WARNING per unavailability window) and raises :class:`Unavailable`;
    while it stays marked it raises at once without trying again. Call :meth:`aclose` before the
    loop ends; the pool is unusable on any other loop or in a forked child.
    """

    def __init__(self, *, attribution: Attribution | None = None,
                 availability: Availability | None = None,
                 env: Mapping[str, str] | None = None,
                 build: Callable[..., Provider] = build_provider) -> None:
        self.attribution = attribution or Attribution()
        self.availability = availability or Availability()
        self._env = env
        self._build = build
        self._providers: dict[str, Provider] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pid = os.getpid()
        self._closed = False

    @classmethod
    def from_config(cls, worker: WorkerConfig, *, env: Mapping[str, str] | None = None,
                    clock: Callable[[], float] = time.monotonic) -> ProviderPool:
        """The pool a worker process keeps: its attribution header, its unavailability
        window."""
        return cls(attribution=Attribution.from_config(worker),
                   availability=Availability(worker.unavailable_model_s, clock=clock), env=env)

    def get(self, candidate: Candidate) -> Provider:
        self._check_scope()
        reason = self.availability.reason(candidate.name)
        if reason is not None:
            logger.debug("model %s is remembered as unavailable", candidate.name,
                         extra={"action": "llm.unavailable", "candidate": candidate.name})
            raise Unavailable(reason)
        provider = self._providers.get(candidate.name)
        if provider is not None:
            return provider
        try:
            provider = self._build(candidate, attribution=self.attribution,
                                   env=os.environ if self._env is None else self._env)
        except (BuildError, ValueError) as exc:
            reason = exc.args[0] if isinstance(exc, BuildError) else (
                f"the client cannot be built ({type(exc).__name__})")
            self.mark_broken(candidate, reason)
            raise Unavailable(reason) from None
        self._providers[candidate.name] = provider
        return provider

    def mark_broken(self, candidate: Candidate, reason: str) -> None:
        """Remember ``candidate`` as unavailable; warn the first time in its window."""
        if self.availability.mark(candidate.name, reason):
            logger.warning("model %s is unavailable for %.0f s: %s", candidate.name,
                           self.availability.ttl_s, reason,
                           extra={"action": "llm.unavailable", "candidate": candidate.name,
                                  "reason": reason})

    async def aclose(self) -> None:
        self._closed = True
        providers, self._providers = list(self._providers.values()), {}
        if os.getpid() != self._pid:
            return  # the sockets belong to the parent process
        for provider in providers:
            await provider.aclose()

    def _check_scope(self) -> None:
        if self._closed:
            raise RuntimeError("this ProviderPool is closed")
        if os.getpid() != self._pid:
            raise RuntimeError("a ProviderPool cannot be used in a forked child; build a new one")
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
        elif loop is not self._loop:
            raise RuntimeError("a ProviderPool serves one event loop; build one per loop")
