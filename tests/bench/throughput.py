"""Compactions per second of real worker processes against a slow model.

    python tests/bench/throughput.py --json OUT.json [--workers 1,2,4] [--sessions 600]
        [--concurrency 64] [--latency 1.0] [--layout merge|recallable] [--recall-index on|off]

The fake provider runs as a subprocess (``python -m tests.support.fake_provider --latency 1.0``),
so the workers talk to it over real HTTP through the real SDKs and do not share its CPU with the
measurement. For each worker count the benchmark empties the database (PostgreSQL:
``COMPACTD_TEST_DATABASE_URL``, which it TRUNCATEs, so never point it at real data) and the Redis
database (``COMPACTD_TEST_REDIS_URL``, flushed), ingests ``--sessions`` generated coding sessions of
about 20k tokens each through the store, starts the workers (``celery -A compactd.worker.app
worker``, the threads pool, ``--concurrency`` each), enqueues one pressure run per session at
once, and waits for every run to end.

Reported per worker count:

* ``compactions_per_s``: committed runs per second over the middle 80% of completions (ramp-up
  and the tail excluded); ``compactions_per_s_overall`` counts from the first enqueue to the last
  completion.
* ``in_flight``: the most model requests the fake held at once; ``efficiency`` is
  ``compactions_per_s / (in_flight / latency)``, how close the workers come to what that many
  concurrent calls allow.
* ``cpu_ms_per_compaction``: the workers' CPU time (user + system, from /proc) over the run,
  divided by the compactions. The model's own work happens in the fake's process, so this is all
  compactd: Celery, storage, planning, prompt building and the SDK's request handling.
* ``recall_pending_at_end``: replaced originals not yet indexed when the last run ended (the
  workers index after each run, in the background, deferring to their runs while half their
  slots hold one); ``recall_index_lag_s``: how long after that until none is left;
  ``cpu_ms_per_compaction_indexed`` counts the workers' CPU until then.
* ``worker_rss_mb``: the largest resident set of one worker process, sampled during the run.

``--recall-index off`` turns off the indexing of what the runs replaced (``worker.recall_index``;
the commits still record it): run it in alternating pairs with ``on`` to see what recall's index
costs the worker.

Every session uses one summary call (``trim_tokens_to_summarize`` above the range) after a prune,
so with latency L and C slots a worker's ceiling is C / L compactions per second (under
``--layout recallable`` a compaction is a pass: one index call per chunk of the range and the
state call, all at once, so the same ceiling with more calls in flight and several commits
each). The top-level
keys repeat the one-worker run; ``by_workers`` holds every run. Goals (issue 5): one worker >= 30
compactions/s with >= 30 in flight, < 15 ms CPU per compaction, < 400 MB RSS.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import sqlalchemy as sa  # noqa: E402

from compactd.scheduler.samples import coding_session  # noqa: E402
from compactd.storage.messages import Message, parse_openai  # noqa: E402
from compactd.storage.store import Store  # noqa: E402
from compactd.worker.app import make_app  # noqa: E402
from compactd.worker.enqueue import Enqueuer, RunRequest  # noqa: E402
from compactd.worker.settings import load_config  # noqa: E402
from tests.support.fake_provider import RemoteFake, fake_provider_process  # noqa: E402
from tests.support.services import flush_redis, reset_database  # noqa: E402
from tests.support.stack import Stack, wait_until  # noqa: E402

# About 22k tokens: a prune (six large tool results cut) that leaves it over the trigger, then
# one summary call replacing ~16k tokens.
POLICY = {"trigger": [{"type": "tokens", "value": 10_000}],
          "keep": {"type": "messages", "value": 6}, "model_name": "fake-gpt",
          "trim_tokens_to_summarize": 64_000}
TEMPLATES = 8
GOALS = {"compactions_per_s": 30.0, "in_flight": 30, "cpu_ms_per_compaction": 15.0,
         "worker_rss_mb": 400.0}


# ------------------------------------------------------------------------------------------
# setup


def templates() -> list[list[Message]]:
    return [[parse_openai(m) for m in coding_session(steps=30, big_output_lines=150,
                                                     seed=11 + i).messages]
            for i in range(TEMPLATES)]


async def ingest(url: str, count: int, prefix: str) -> list[str]:
    """``count`` sessions, written concurrently (the store counts tokens once per message)."""
    shapes = templates()
    store = Store.from_url(url, pool_size=8)
    ids = [f"{prefix}-{i:05d}" for i in range(count)]
    sem = asyncio.Semaphore(8)

    async def one(i: int, sid: str) -> None:
        async with sem:
            await store.create_session(sid, run_model="fake-gpt", context_window=128_000)
            await store.append(sid, shapes[i % TEMPLATES])

    try:
        await asyncio.gather(*(one(i, sid) for i, sid in enumerate(ids)))
    finally:
        await store.close()
    return ids


async def pending_originals(url: str) -> int:
    """Replaced originals whose text is not indexed yet."""
    store = Store.from_url(url, pool_size=1)
    try:
        async with store.engine.connect() as conn:
            return int((await conn.execute(sa.text(
                "SELECT count(*) FROM recall_originals WHERE body IS NULL"))).scalar_one())
    finally:
        await store.close()


async def run_rows(url: str) -> list[tuple[str, float, float]]:
    """(status, started, finished) of every finished run, as epoch seconds."""
    store = Store.from_url(url, pool_size=1)
    try:
        runs = await store.recent_runs(limit=1_000_000)
    finally:
        await store.close()
    return [(r.status, r.started_at.timestamp(), r.finished_at.timestamp())
            for r in runs if r.finished_at is not None]


# ------------------------------------------------------------------------------------------
# measuring


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks  # utime, stime


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class RssSampler(threading.Thread):
    def __init__(self, pids: list[int], interval_s: float = 0.25) -> None:
        super().__init__(daemon=True)
        self.pids = pids
        self.interval_s = interval_s
        self.peak = 0.0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            for pid in self.pids:
                with contextlib.suppress(OSError):
                    self.peak = max(self.peak, rss_mb(pid))
            self.stop.wait(self.interval_s)


def max_in_flight(requests: list[dict[str, Any]]) -> int:
    edges: list[tuple[float, int]] = []
    for r in requests:
        if r.get("answered_t") is None:
            continue
        edges.append((r["received_t"], 1))
        edges.append((r["answered_t"], -1))
    edges.sort(key=lambda e: (e[0], e[1]))
    depth = peak = 0
    for _, step in edges:
        depth += step
        peak = max(peak, depth)
    return peak


def steady_rate(finished: list[float]) -> float:
    """Completions per second between the 10th and the 90th percentile completion."""
    finished = sorted(finished)
    if len(finished) < 10:
        span = finished[-1] - finished[0] if len(finished) > 1 else 0.0
        return len(finished) / span if span > 0 else 0.0
    lo, hi = int(len(finished) * 0.1), int(len(finished) * 0.9)
    span = finished[hi] - finished[lo]
    return (hi - lo) / span if span > 0 else 0.0


def measure(args: argparse.Namespace, fake_url: str, workers: int, home: Path
            ) -> dict[str, Any]:
    pg, broker = args.database_url, args.redis_url
    asyncio.run(reset_database(pg))
    flush_redis(broker)
    sessions = args.sessions * workers if args.scale_sessions else args.sessions
    t = time.monotonic()
    ids = asyncio.run(ingest(pg, sessions, f"w{workers}"))
    print(f"[{workers} worker(s)] ingested {len(ids)} sessions in {time.monotonic() - t:.1f} s",
          file=sys.stderr)
    fake = RemoteFake(fake_url)
    fake.reset()
    stack = Stack(pg, broker, home / f"workers{workers}", fake_url=fake_url,
                  summarization={**POLICY, "layout": args.layout},
                  worker={"concurrency": args.concurrency, "sweep_interval_s": 3600,
                          "reap_interval_s": 3600, "lease_s": 120,
                          "recall_index": args.recall_index == "on"})
    try:
        procs = [stack.start_worker(f"w{i}", concurrency=args.concurrency, ready_timeout=60)
                 for i in range(workers)]
        pids = [p.pid for p in procs]
        app = make_app(load_config(env=stack.env))
        try:
            enqueuer = Enqueuer(app)
            cpu_before = sum(cpu_s(pid) for pid in pids)
            sampler = RssSampler(pids)
            sampler.start()
            started = time.time()
            for sid in ids:
                enqueuer.send(RunRequest(sid, "sweep"))
            wait_until(lambda: len(asyncio.run(run_rows(pg))) >= len(ids),
                       timeout=args.timeout, interval=1.0,
                       what=f"{len(ids)} runs with {workers} worker(s)")
            cpu_after = sum(cpu_s(pid) for pid in pids)
            pending_at_end = asyncio.run(pending_originals(pg))
            lag_started = time.monotonic()
            if args.recall_index == "on":
                # The workers index in the background: wait until they have caught up.
                wait_until(lambda: asyncio.run(pending_originals(pg)) == 0,
                           timeout=args.timeout, interval=0.5,
                           what="the recall index to catch up")
            index_lag_s = time.monotonic() - lag_started if pending_at_end else 0.0
            cpu_indexed = sum(cpu_s(pid) for pid in pids)
            sampler.stop.set()
            sampler.join()
        finally:
            app.close()
        rows = asyncio.run(run_rows(pg))
        requests = fake.requests()
    finally:
        stack.close()
    committed = [r for r in rows if r[0] == "committed"]
    finished = [r[2] for r in committed]
    rate = steady_rate(finished)
    in_flight = max_in_flight(requests)
    ideal = in_flight / args.latency if args.latency else None
    cpu_ms = (cpu_after - cpu_before) * 1000 / max(1, len(committed))
    return {
        "workers": workers, "layout": args.layout, "recall_index": args.recall_index,
        "concurrency": args.concurrency,
        "latency_s": args.latency,
        "sessions": len(ids), "committed": len(committed),
        "other_outcomes": len(rows) - len(committed),
        "model_requests": len(requests),
        "compactions_per_s": round(rate, 2),
        "compactions_per_s_overall": round(len(committed) / (max(finished) - started), 2)
        if finished else 0.0,
        "in_flight": in_flight,
        "efficiency": round(rate / ideal, 3) if ideal else None,
        "cpu_ms_per_compaction": round(cpu_ms, 2),
        "cpu_ms_per_compaction_indexed": round(
            (cpu_indexed - cpu_before) * 1000 / max(1, len(committed)), 2),
        "recall_pending_at_end": pending_at_end,
        "recall_index_lag_s": round(index_lag_s, 2),
        "worker_rss_mb": round(sampler.peak, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--json", required=True, help="where to write the report")
    parser.add_argument("--workers", default="1,2,4", help="worker process counts to run")
    parser.add_argument("--sessions", type=int, default=600,
                        help="pending sessions per run (per worker with --scale-sessions)")
    parser.add_argument("--scale-sessions", action="store_true",
                        help="multiply --sessions by the worker count")
    parser.add_argument("--concurrency", type=int, default=64, help="threads per worker")
    parser.add_argument("--latency", type=float, default=1.0, help="the fake's seconds per call")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per run, at most")
    parser.add_argument("--layout", choices=("merge", "recallable"), default="merge",
                        help="summarization.layout of every session")
    parser.add_argument("--recall-index", choices=("on", "off"), default="on",
                        help="index what the runs replaced for history_search after each run")
    parser.add_argument("--database-url", default=os.environ.get(
        "COMPACTD_TEST_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/compactd_bench"))
    parser.add_argument("--redis-url", default=os.environ.get(
        "COMPACTD_TEST_REDIS_URL", "redis://127.0.0.1:6379/14"))
    args = parser.parse_args(argv)
    counts = [int(x) for x in args.workers.split(",") if x.strip()]
    by_workers: dict[str, dict[str, Any]] = {}
    with fake_provider_process(args.latency) as url, \
            tempfile.TemporaryDirectory(prefix="compactd-throughput-") as tmp:
        for n in counts:
            result = measure(args, url, n, Path(tmp))
            by_workers[str(n)] = result
            print(json.dumps(result), file=sys.stderr)
    first = by_workers[str(counts[0])]
    report = {**first, "goals": GOALS, "by_workers": by_workers}
    if "1" in by_workers:
        one = by_workers["1"]
        report["meets_goals"] = (one["compactions_per_s"] >= GOALS["compactions_per_s"]
                                 and one["in_flight"] >= GOALS["in_flight"]
                                 and one["cpu_ms_per_compaction"]
                                 < GOALS["cpu_ms_per_compaction"]
                                 and one["worker_rss_mb"] < GOALS["worker_rss_mb"])
    print(json.dumps(report, indent=2))
    Path(args.json).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
