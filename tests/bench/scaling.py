"""How append, poll and planning grow with the session: 10^2, 10^3 and 10^4 messages.

    python tests/bench/scaling.py --json OUT.json [--repeat 15] [--no-sqlite]

Sessions are filled like ``append_scaling.py`` (steps of an assistant tool call, its result and a
short reply, about 64 o200k tokens each, so 10^4 messages are about 640k tokens), then:

* ``append_ms``: ``Store.append`` of one message (an assistant tool call) as the exact Nth
  message of its session, ``--repeat`` sessions per size, timed round-robin over the sizes so
  machine noise falls on every size alike; the median. (``append_scaling.py`` is the same
  measurement with the acceptance check of issue 2.)
* ``poll_ms``: ``Store.poll(session, since_version=current)`` (the runtime's per-step check, one
  primary-key read; it answers None), 200 times per size, round-robin; the median.
* ``plan_ms``: ``worker.compaction.planner.plan`` over the stored surface (read once with
  ``Store.read_surface``, which is timed on its own as ``read_ms``), with trigger tokens 5000,
  keep messages 20 and the default summarizer budget (4000 tokens, chunked: every replaced
  message reaches a call, so a 640k-token range plans several hundred calls), ``--plan-repeat``
  times; the median. ``plan_calls`` is how many summarizer calls the plan holds.

PostgreSQL is the headline (database ``compactd_bench_scaling`` on
``COMPACTD_BENCH_DATABASE_URL``, created, migrated and emptied; ``ANALYZE`` after the fill); the
SQLite file of the embedded default is measured the same way and reported under ``sqlite``
(different storage, not comparable with PostgreSQL). Ratios are 10^4 over 10^2: append and poll
should stay flat; planning is linear in the surface, so its time per message should stay flat.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from compactd.storage.store import Store
from compactd.worker.compaction.planner import plan
from compactd.worker.compaction.policy import parse_policy
from tests.bench.append_scaling import call, prepare_sessions, result, timed
from tests.bench.common import (
    calibrate_pg,
    machine,
    machine_line,
    percentile,
    pg_url,
    prepare_pg,
    prepare_sqlite,
    print_table,
    write_json,
)

SIZES = (100, 1_000, 10_000)
POLLS = 200
POLICY = {"trigger": ["tokens", 5000], "keep": ["messages", 20]}
NOW = datetime(2026, 11, 30, tzinfo=UTC)


async def run_backend(url: str, repeat: int, plan_repeat: int, *, pg: bool) -> dict[str, Any]:
    store = Store.from_url(url, pool_size=2)
    rows: dict[str, dict[str, Any]] = {}
    try:
        await prepare_sessions(store, url, SIZES, repeat, pg=pg, poll=True)
        appends: dict[int, list[float]] = {n: [] for n in SIZES}
        for rep in range(repeat):
            for size in SIZES:
                sid = f"n{size}r{rep}"
                appends[size].append(await timed(store, sid, call(sid, 99_999)))
            for size in SIZES:
                sid = f"n{size}r{rep}"
                await store.append(sid, [result(sid, 99_999)])
        versions = {n: await store.poll(f"n{n}r0", None) for n in SIZES}
        polls: dict[int, list[float]] = {n: [] for n in SIZES}
        for _ in range(POLLS):
            for size in SIZES:
                started = time.perf_counter()
                moved = await store.poll(f"n{size}r0", versions[size])
                polls[size].append((time.perf_counter() - started) * 1000)
                assert moved is None
        policy = parse_policy(POLICY).resolve(None)
        for size in SIZES:
            started = time.perf_counter()
            surface = await store.read_surface(f"n{size}r0")
            read_ms = (time.perf_counter() - started) * 1000
            nodes = list(surface.nodes)
            result_plan = plan(nodes, policy=policy, now=NOW)  # warm the caches
            plans = []
            for _ in range(plan_repeat):
                started = time.perf_counter()
                result_plan = plan(nodes, policy=policy, now=NOW)
                plans.append((time.perf_counter() - started) * 1000)
            step = result_plan.summarize
            plan_median = statistics.median(plans)
            rows[str(size)] = {
                "messages": len(nodes), "tokens": sum(n.tokens for n in nodes),
                "append_ms": round(statistics.median(appends[size]), 3),
                "append_p90_ms": round(percentile(appends[size], 90), 3),
                "poll_ms": round(statistics.median(polls[size]), 3),
                "poll_p99_ms": round(percentile(polls[size], 99), 3),
                "read_ms": round(read_ms, 1),
                "plan_ms": round(plan_median, 3),
                "plan_us_per_message": round(plan_median * 1000 / len(nodes), 2),
                "plan_calls": len(step.calls) if step else 0,
                "plan_replaced": len(step.replace_seqs) if step else 0,
            }
    finally:
        await store.close()
    low, high = str(SIZES[0]), str(SIZES[-1])
    out: dict[str, Any] = {
        metric: {size: rows[size][metric] for size in rows}
        for metric in ("append_ms", "poll_ms", "plan_ms", "read_ms", "plan_calls")}
    out["ratios_10000_over_100"] = {
        "append": round(rows[high]["append_ms"] / rows[low]["append_ms"], 2),
        "poll": round(rows[high]["poll_ms"] / rows[low]["poll_ms"], 2),
        "plan_per_message": round(rows[high]["plan_us_per_message"]
                                  / rows[low]["plan_us_per_message"], 2)}
    out["by_size"] = rows
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--repeat", type=int, default=15, help="timed appends per size")
    parser.add_argument("--plan-repeat", type=int, default=5, help="timed plans per size")
    parser.add_argument("--no-sqlite", action="store_true", help="PostgreSQL only")
    args = parser.parse_args(argv)
    info = machine()
    url = prepare_pg(pg_url("scaling"))
    report: dict[str, Any] = {"machine": info, "sizes": list(SIZES), "policy": POLICY,
                              "pg_calibration": calibrate_pg(url)}
    report["postgres"] = asyncio.run(run_backend(url, args.repeat, args.plan_repeat, pg=True))
    if not args.no_sqlite:
        with tempfile.TemporaryDirectory(prefix="compactd-bench-") as tmp:
            sqlite = prepare_sqlite(Path(tmp))
            report["sqlite"] = asyncio.run(run_backend(sqlite, args.repeat, args.plan_repeat,
                                                       pg=False))
    for metric in ("append_ms", "poll_ms", "plan_ms"):
        report[metric] = report["postgres"][metric]
    cal = report["pg_calibration"]
    print(f"machine: {machine_line(info)}")
    print(f"PostgreSQL {cal['server_version']}: SELECT 1 {cal['select1_ms']} ms, one-row INSERT "
          f"commit {cal['insert_commit_ms']} ms (median)")
    table = []
    for backend in ("postgres", "sqlite"):
        if backend in report:
            for size, r in report[backend]["by_size"].items():
                table.append([backend, size, r["tokens"], r["append_ms"], r["poll_ms"],
                              r["read_ms"], r["plan_ms"], r["plan_us_per_message"],
                              r["plan_calls"]])
    print_table(["backend", "messages", "tokens", "append ms", "poll ms", "read surface ms",
                 "plan ms", "plan us/msg", "plan calls"], table)
    for backend in ("postgres", "sqlite"):
        if backend in report:
            print(f"{backend}: 10^4 over 10^2: {report[backend]['ratios_10000_over_100']}")
    write_json(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
