"""Does an append cost the same at the 10,000th message as at the 100th?

    python tests/bench/append_scaling.py --json OUT.json [--repeat 21] [--no-sqlite]

What is measured: ``Store.append`` of ONE message (an assistant message with one tool call, about
65 tokens), timed from the call to its return, so it includes everything the runtime pays:
token counting, payload building, the round trip (on PostgreSQL one call of the
``compactd_append`` SQL function) and the commit. Then the append of that call's tool result is
timed the same way (reported as ``result_ms``).

How: for every size N in 100, 1,000 and 10,000 there are ``--repeat`` sessions pre-filled with
N-1 messages (steps of an assistant tool call, its result and a short reply, about 65 tokens each,
appended in batches of up to 1,000; then ``ANALYZE``, as autovacuum would do on a live
database). The timed appends then go round-robin over the sizes (100, 1,000, 10,000, 100, ...),
so machine noise falls on every size alike; each timed append is the exact Nth message of its
session. Medians of the ``--repeat`` samples per size are the headline; p90 and max are in the
JSON. Five warm-up appends on a separate session come first. Before it all, the PostgreSQL
floor is measured (``pg_calibration``: a ``SELECT 1`` round trip and a one-row INSERT commit):
on a machine whose disk is busy the WAL flush alone can cost milliseconds, which moves every
size alike and leaves the ratio meaningful.

Acceptance (issue 2): on PostgreSQL, the median at 10,000 is at most 2x the median at 100. The
SQLite numbers (the embedded default, a file in a temporary directory) are reported separately
and are not comparable with PostgreSQL's: no network round trip, but a file lock and an fsync
policy of its own (WAL, synchronous=NORMAL).

The database is ``compactd_bench_append`` on ``COMPACTD_BENCH_DATABASE_URL`` (default
``postgresql://postgres@127.0.0.1:5432``), created, migrated and emptied by the script.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from compactd.storage.messages import Message, ToolCall
from compactd.storage.store import Store
from tests.bench.common import (
    analyze,
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
FILL_BATCH = 1_000
RATIO_GOAL = 2.0
WARMUP = 5
# About 60 o200k tokens of ordinary agent prose.
TEXT = ("Checked src/billing/invoice.py around line 42: the rounding happens before the tax is "
        "applied, so the total drifts by a cent on some invoices. Running the focused tests "
        "next to confirm the InvoiceMismatchError and then editing the quantization step. ")


def call(session: str, n: int) -> Message:
    return Message(role="assistant", content=TEXT, tool_calls=(ToolCall(
        id=f"{session}_c{n}", name="bash",
        arguments=json.dumps({"command": f"pytest -x tests/test_invoice.py -k case_{n}"})),))


def result(session: str, n: int) -> Message:
    return Message(role="tool", content=TEXT, tool_call_id=f"{session}_c{n}", name="bash")


def filler(session: str, count: int) -> list[Message]:
    """``count`` messages in steps of call, result, reply."""
    out: list[Message] = []
    step = 0
    while len(out) < count:
        step += 1
        out += [call(session, step), result(session, step),
                Message(role="assistant", content=TEXT)]
    return out[:count]


async def fill(store: Store, session: str, count: int) -> None:
    await store.create_session(session)
    messages = filler(session, count)
    for start in range(0, len(messages), FILL_BATCH):
        await store.append(session, messages[start:start + FILL_BATCH])


async def timed(store: Store, session: str, message: Message) -> float:
    started = time.perf_counter()
    await store.append(session, [message])
    return (time.perf_counter() - started) * 1000


async def prepare_sessions(store: Store, url: str, sizes: Sequence[int], repeat: int, *,
                           pg: bool, poll: bool = False) -> float:
    """Fill ``repeat`` sessions ``n{size}r{rep}`` per size to one message short of it, refresh
    PostgreSQL's statistics, and warm the connections up (with polls too when ``poll``).
    Returns the seconds the fill took."""
    started = time.perf_counter()
    for size in sizes:
        for rep in range(repeat):
            await fill(store, f"n{size}r{rep}", size - 1)
    fill_s = time.perf_counter() - started
    if pg:
        await analyze(url)
    await fill(store, "warmup", 10)
    for i in range(WARMUP):
        await timed(store, "warmup", call("warmup", 1000 + i))
        await timed(store, "warmup", result("warmup", 1000 + i))
        if poll:
            await store.poll("warmup", None)
    return fill_s


async def run_backend(url: str, repeat: int, sizes: tuple[int, ...], *, pg: bool
                      ) -> dict[str, Any]:
    store = Store.from_url(url, pool_size=2)
    try:
        fill_s = await prepare_sessions(store, url, sizes, repeat, pg=pg)
        calls: dict[int, list[float]] = {n: [] for n in sizes}
        results: dict[int, list[float]] = {n: [] for n in sizes}
        for rep in range(repeat):
            for size in sizes:
                sid = f"n{size}r{rep}"
                calls[size].append(await timed(store, sid, call(sid, 99_999)))
            for size in sizes:
                sid = f"n{size}r{rep}"
                results[size].append(await timed(store, sid, result(sid, 99_999)))
        # Sanity: every timed session ended with exactly N+1 messages.
        for size in sizes:
            info = await store.get_session(f"n{size}r0")
            assert info.surface_messages == size + 1, (size, info.surface_messages)
    finally:
        await store.close()
    rows: dict[str, dict[str, Any]] = {}
    for size in sizes:
        rows[str(size)] = {
            "append_ms": round(statistics.median(calls[size]), 3),
            "append_p90_ms": round(percentile(calls[size], 90), 3),
            "append_max_ms": round(max(calls[size]), 3),
            "result_ms": round(statistics.median(results[size]), 3),
            "samples_ms": [round(x, 3) for x in calls[size]],
        }
    low, high = str(sizes[0]), str(sizes[-1])
    ratio = rows[high]["append_ms"] / rows[low]["append_ms"]
    out: dict[str, Any] = {f"append_ms_at_{n}": rows[n]["append_ms"] for n in rows}
    out.update({"ratio_10000_over_100": round(ratio, 3), "by_size": rows,
                "fill_s": round(fill_s, 1), "repeat": repeat})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--repeat", type=int, default=21, help="timed appends per size")
    parser.add_argument("--no-sqlite", action="store_true", help="PostgreSQL only")
    args = parser.parse_args(argv)
    info = machine()
    url = prepare_pg(pg_url("append"))
    report: dict[str, Any] = {"machine": info, "sizes": list(SIZES), "goal_ratio": RATIO_GOAL,
                              "pg_calibration": calibrate_pg(url)}
    report["postgres"] = asyncio.run(run_backend(url, args.repeat, SIZES, pg=True))
    if not args.no_sqlite:
        with tempfile.TemporaryDirectory(prefix="compactd-bench-") as tmp:
            sqlite = prepare_sqlite(Path(tmp))
            report["sqlite"] = asyncio.run(run_backend(sqlite, args.repeat, SIZES, pg=False))
    pg = report["postgres"]
    report.update({k: pg[k] for k in pg if k.startswith("append_ms_at_")})
    report["ratio"] = pg["ratio_10000_over_100"]
    report["ok"] = pg["ratio_10000_over_100"] <= RATIO_GOAL
    cal = report["pg_calibration"]
    print(f"machine: {machine_line(info)}")
    print(f"PostgreSQL {cal['server_version']}: SELECT 1 {cal['select1_ms']} ms, one-row INSERT "
          f"commit {cal['insert_commit_ms']} ms (median; the floor under any append)")
    rows = []
    for backend in ("postgres", "sqlite"):
        if backend not in report:
            continue
        for size, r in report[backend]["by_size"].items():
            rows.append([backend, size, r["append_ms"], r["append_p90_ms"], r["append_max_ms"],
                         r["result_ms"]])
    print_table(["backend", "messages", "append median ms", "p90 ms", "max ms",
                 "result median ms"], rows)
    for backend in ("postgres", "sqlite"):
        if backend in report:
            print(f"{backend}: 10,000th / 100th = {report[backend]['ratio_10000_over_100']:.2f}x"
                  + (f" (goal <= {RATIO_GOAL:g}x: {'ok' if report['ok'] else 'MISSED'})"
                     if backend == "postgres" else ""))
    write_json(args.json, report)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
