"""The store from a synchronous test or benchmark: one :class:`Store` in a private event loop
thread, so a test that drives subprocesses can also seed and inspect PostgreSQL directly (much
faster than a CLI subprocess per step) without an engine ever crossing event loops.

    db = Db(pg_url)
    db.ingest("s1", coding_session(steps=10).messages, run_model="fake-gpt")
    db.journal("s1")            # Counter of event kinds
    db.close()
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

from compactd.storage.messages import parse_openai
from compactd.storage.records import RunRecord, SessionInfo, VerifyResult
from compactd.storage.store import Store
from compactd.storage.surface import Surface
from compactd.worker.runtime import EventLoopThread

T = TypeVar("T")


class Db:
    def __init__(self, url: str, *, pool_size: int = 4) -> None:
        self.loop = EventLoopThread(name="test-db")

        async def open_store() -> Store:
            return Store.from_url(url, pool_size=pool_size)

        self.store: Store = self.loop.submit(open_store)

    def run(self, fn: Callable[[Store], Awaitable[T]], timeout: float | None = 60.0) -> T:
        return self.loop.submit(lambda: fn(self.store), timeout)

    def close(self) -> None:
        self.loop.submit(self.store.close, timeout=10)
        self.loop.stop()

    def __enter__(self) -> Db:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------ helpers

    def ingest(self, session_id: str, messages: Sequence[Mapping[str, Any]], *,
               run_model: str | None = "fake-gpt", context_window: int | None = 128_000,
               policy: dict[str, Any] | None = None) -> SessionInfo:
        parsed = [parse_openai(dict(m)) for m in messages]

        async def go(store: Store) -> SessionInfo:
            await store.create_session(session_id, run_model=run_model,
                                       context_window=context_window, policy=policy)
            return (await store.append(session_id, parsed)).session

        return self.run(go)

    def session(self, session_id: str) -> SessionInfo:
        return self.run(lambda s: s.get_session(session_id))

    def surface(self, session_id: str) -> Surface:
        return self.run(lambda s: s.read_surface(session_id))

    def runs(self, session_id: str) -> list[RunRecord]:
        """The session's runs, oldest first."""
        return list(reversed(self.run(lambda s: s.session_runs(session_id, limit=500))))

    def journal(self, session_id: str) -> Counter[str]:
        events = self.run(lambda s: s.read_events(session_id))
        return Counter(e.kind for e in events)

    def events(self, session_id: str, kinds: Sequence[str] | None = None) -> list[Any]:
        return self.run(lambda s: s.read_events(session_id, kinds=kinds))

    def verify(self, session_id: str) -> VerifyResult:
        return self.run(lambda s: s.verify(session_id))
