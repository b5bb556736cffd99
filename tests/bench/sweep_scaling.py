"""How the pressure sweep grows with the table: 10^3, 10^4 and 10^5 sessions, 100 over their
trigger in each.

    python tests/bench/sweep_scaling.py --json OUT.json [--repeat 15] [--no-sqlite]

Each size is a table of sessions whose cached totals are written directly (the sweep reads only
the sessions row, never the surface): all but ``HOT`` of them at 1000 tokens under a 5000-token
trigger, ``HOT`` at 6000. Then:

* ``resolve_ms``: the first sweep, which stores every session's thresholds (what a new
  configuration costs once; afterwards only new or changed sessions are resolved).
* ``sweep_ms``: ``sweep_pressure`` with the thresholds stored, enqueueing the ``HOT`` sessions
  (a recording enqueuer: the broker is not what is measured), ``--repeat`` times with the
  signal marks cleared in between; the median. ``sweep_p90_ms`` its 90th percentile.
* ``explain``: PostgreSQL's plan of the sweep's batch query (the index it reads).

The goal (issue 15, item 20): ``sweep_ms`` follows the sessions over their trigger, not the table,
so its ratio 10^5 over 10^3 stays near 1. PostgreSQL is the headline (database
``compactd_bench_sweep_scaling`` on ``COMPACTD_BENCH_DATABASE_URL``, created, migrated and emptied;
``ANALYZE`` after each fill, ``VACUUM ANALYZE`` after the first sweep, as autovacuum would); the
embedded SQLite file is measured the same way under ``sqlite``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import sqlalchemy as sa

from compactd.storage import schema as t
from compactd.storage.records import utcnow
from compactd.storage.store import Store
from compactd.worker.settings import Config, Settings, build_config
from compactd.worker.sweeps import sweep_pressure
from tests.bench.common import (
    analyze,
    machine,
    machine_line,
    percentile,
    pg_url,
    prepare_pg,
    prepare_sqlite,
    print_table,
    write_json,
)
from tests.support.enqueuer import RecordingEnqueuer

SIZES = (1_000, 10_000, 100_000)
HOT = 100
TRIGGER_TOKENS = 5000
CHUNK = 5000


def config_for(url: str) -> Config:
    raw = {"summarization": {"trigger": {"type": "tokens", "value": TRIGGER_TOKENS}},
           "worker": {"metrics_port": 0, "sweep_batch": 200}}
    return build_config(raw, settings=Settings(database_url=url, broker_url="memory://"))


async def fill(store: Store, size: int) -> None:
    now = utcnow()
    async with store.engine.begin() as conn:
        await conn.execute(t.sessions.delete())
        for start in range(0, size, CHUNK):
            await conn.execute(t.sessions.insert(), [
                {"id": f"s{i:06d}", "tenant": "bench", "run_model": "gpt-4o",
                 "envelope_tokens": 0, "surface_version": 1,
                 "surface_tokens": 6000 if i % (size // HOT) == 0 else 1000,
                 "surface_messages": 10, "last_seq": 10, "last_position": 10, "lease_fence": 0,
                 "created_at": now} for i in range(start, min(size, start + CHUNK))])


async def vacuum(url: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(urlparse(url)._replace(scheme="postgresql").geturl())
    try:
        await conn.execute("VACUUM ANALYZE sessions")
    finally:
        await conn.close()


async def explain(store: Store) -> list[str]:
    c = t.sessions.c
    stmt = (sa.select(c.id).where(t.OVER_SWEEP_THRESHOLD, c.id > "")
            .order_by(c.id).limit(200).with_for_update(skip_locked=True))
    compiled = stmt.compile(store.engine.sync_engine, compile_kwargs={"literal_binds": True})
    async with store.engine.connect() as conn:
        return [row[0] for row in await conn.execute(sa.text(f"EXPLAIN {compiled}"))]


async def run_backend(url: str, repeat: int, *, pg: bool) -> dict[str, Any]:
    store = Store.from_url(url, pool_size=2) if pg else Store.from_url(url)
    config = config_for(url)
    rows: dict[str, dict[str, Any]] = {}
    try:
        for size in SIZES:
            await fill(store, size)
            if pg:
                await analyze(url)
            started = time.perf_counter()
            first = await sweep_pressure(store, config, RecordingEnqueuer())
            resolve_ms = (time.perf_counter() - started) * 1000
            assert first.resolved == size and len(first.enqueued) == HOT, first
            if pg:
                # Storing the thresholds rewrote every row: what autovacuum would clean up
                # before the next interval, done now so the steady state is what is timed.
                await vacuum(url)
            times = []
            for _ in range(repeat):
                async with store.engine.begin() as conn:
                    await conn.execute(t.sessions.update().where(
                        t.sessions.c.signal_at.is_not(None)).values(signal_at=None))
                started = time.perf_counter()
                result = await sweep_pressure(store, config, RecordingEnqueuer())
                times.append((time.perf_counter() - started) * 1000)
                assert result.resolved == 0 and len(result.enqueued) == HOT, result
            rows[str(size)] = {
                "sessions": size, "over_trigger": HOT, "resolve_ms": round(resolve_ms, 1),
                "sweep_ms": round(statistics.median(times), 2),
                "sweep_p90_ms": round(percentile(times, 90), 2),
                "batches": result.scanned_batches,
            }
            if pg:
                rows[str(size)]["explain"] = await explain(store)
    finally:
        await store.close()
    low, high = str(SIZES[0]), str(SIZES[-1])
    return {"sweep_ms": {size: rows[size]["sweep_ms"] for size in rows},
            "ratio_100000_over_1000": round(rows[high]["sweep_ms"] / rows[low]["sweep_ms"], 2),
            "by_size": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--repeat", type=int, default=15, help="timed sweeps per size")
    parser.add_argument("--no-sqlite", action="store_true", help="PostgreSQL only")
    args = parser.parse_args(argv)
    info = machine()
    url = prepare_pg(pg_url("sweep_scaling"))
    report: dict[str, Any] = {"machine": info, "sizes": list(SIZES), "over_trigger": HOT,
                              "trigger_tokens": TRIGGER_TOKENS}
    report["postgres"] = asyncio.run(run_backend(url, args.repeat, pg=True))
    if not args.no_sqlite:
        with tempfile.TemporaryDirectory(prefix="compactd-bench-") as tmp:
            sqlite = prepare_sqlite(Path(tmp))
            report["sqlite"] = asyncio.run(run_backend(sqlite, args.repeat, pg=False))
    print(f"machine: {machine_line(info)}")
    table = []
    for backend in ("postgres", "sqlite"):
        if backend in report:
            for size, r in report[backend]["by_size"].items():
                table.append([backend, size, r["over_trigger"], r["resolve_ms"], r["sweep_ms"],
                              r["sweep_p90_ms"], r["batches"]])
    print_table(["backend", "sessions", "over trigger", "first sweep (resolve) ms",
                 "sweep ms", "sweep p90 ms", "batches"], table)
    for backend in ("postgres", "sqlite"):
        if backend in report:
            print(f"{backend}: sweep 10^5 over 10^3: "
                  f"{report[backend]['ratio_100000_over_1000']}")
    if "postgres" in report:
        print("postgres plan at 10^5:", " / ".join(
            line.strip() for line in report["postgres"]["by_size"][str(SIZES[-1])]["explain"]))
    write_json(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
