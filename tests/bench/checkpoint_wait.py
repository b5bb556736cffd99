"""How soon a runtime waiting with ``wait_for_checkpoint`` hears of a commit: the time from the
commit's statement returning to the committer to the waiter's return, and from the commit's start.

    python tests/bench/checkpoint_wait.py --database-url postgresql://... [--commits 200]
    python tests/bench/checkpoint_wait.py --database-url sqlite:///tmp/bench.sqlite3

The committer and the waiter are two stores (two engines, two connection pools) in one process,
as a worker and a runtime are two processes: each round the waiter starts
``SessionHandle.wait_for_checkpoint``, the committer claims the session and commits a checkpoint
over its two oldest messages, and the waiter's return is timed. On PostgreSQL the waiter is woken
by the commit's NOTIFY; on SQLite it reads the version every ``storage.events.POLL_S``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from compactd.client import CompactdClient
from compactd.storage.database import normalize_url
from compactd.storage.kinds import NodeKind
from compactd.storage.migrate import ensure_schema
from compactd.storage.records import Claim, Replacement, RunEnd
from compactd.storage.store import Store
from compactd.worker.settings import load_config
from tests.support.enqueuer import RecordingEnqueuer

SESSION = "bench-wait"


def checkpoint(seqs: tuple[int, ...]) -> Replacement:
    return Replacement(seqs=seqs, kind=NodeKind.CHECKPOINT, tokens=7,
                       payload={"role": "user", "content": "summary",
                                "meta": {"checkpoint": True, "summary": "summary"}},
                       journal_kind="compaction/summary", journal={"text": "summary"})


async def commit_once(store: Store) -> tuple[float, float]:
    """Claim, then commit a checkpoint over the two oldest surface nodes: when the commit
    started and when it returned (perf_counter)."""
    claim = await store.claim(SESSION, owner="bench", trigger="manual", lease_s=30)
    assert isinstance(claim, Claim), claim
    surface = await store.read_surface(SESSION)
    first, second = surface.nodes[0], surface.nodes[1]
    started = time.perf_counter()
    await store.commit(SESSION, run_id=claim.run_id, fence=claim.fence,
                       replacements=[checkpoint((first.seq, second.seq))],
                       expected=[(first.position, first.seq), (second.position, second.seq)],
                       end=RunEnd(outcome="committed"))
    return started, time.perf_counter()


def quantiles_ms(values: list[float]) -> tuple[float, float]:
    values = sorted(values)
    return values[len(values) // 2] * 1e3, values[int(len(values) * 0.99)] * 1e3


async def bench(url: str, commits: int) -> None:
    config = load_config(env={"COMPACTD_DATABASE_URL": url})
    committer = Store.from_url(normalize_url(url))
    await ensure_schema(committer.engine, url)
    async with CompactdClient(config, enqueuer=RecordingEnqueuer()) as client:
        session = await client.create_session(SESSION)
        await session.append([{"role": "user", "content": f"message {i}"}
                              for i in range(2 * commits + 4)])
        from_return: list[float] = []
        from_start: list[float] = []
        try:
            for _ in range(commits):
                waiting = asyncio.create_task(session.wait_for_checkpoint(timeout_s=10))
                await asyncio.sleep(0.01)  # the waiter is listening
                started, returned = await commit_once(committer)
                version = await waiting
                woke = time.perf_counter()
                assert version is not None, "the wait timed out"
                session.version = version
                from_return.append(woke - returned)
                from_start.append(woke - started)
        finally:
            await client.delete(SESSION)
            await committer.close()
    for name, values in (("commit returned -> wait returned", from_return),
                         ("commit started  -> wait returned", from_start)):
        p50, p99 = quantiles_ms(values)
        print(f"{name}: median {p50:6.2f} ms  p99 {p99:6.2f} ms  ({len(values)} commits)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--database-url", required=True)
    parser.add_argument("--commits", type=int, default=200)
    args = parser.parse_args()
    asyncio.run(bench(args.database_url, args.commits))


if __name__ == "__main__":
    main()
