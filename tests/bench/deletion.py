"""Another session's append latency while ``compactd delete`` removes a session of 10^5 messages.

    python tests/bench/deletion.py [--backend postgres|sqlite] [--messages 100000]
        [--rate 100] [--idle 3.0] [--database-url URL] [--json OUT.json]

The deleted session is filled with ``--messages`` messages (a quarter of them assistant tool calls
with their results, 300 to 2,000 characters each, so its log, surface and tool-call rows are
all there). An agent appends to another session at ``--rate`` appends per second, one short
message at a time, through the store (on PostgreSQL one call of ``compactd_append``): first for
``--idle`` seconds with nothing else running, then while ``compactd delete`` (a subprocess, the
operator's path) deletes the big session. Each append's latency runs from when it was due, so
an append that waits holds back those due after it and they count the wait too.

Reported: the appends at rest and during the deletion (p50 / p99 / max), the deletion's wall
time and the rows it removed. Goal (issue 29): the p99 during the deletion under 50 ms. On
PostgreSQL it uses a database of its own (``compactd_bench_deletion``); on SQLite a file in a
temporary directory.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from compactd.storage.messages import Message, ToolCall  # noqa: E402
from compactd.storage.store import Store  # noqa: E402
from tests.bench.common import (  # noqa: E402
    machine,
    machine_line,
    pg_url,
    prepare_pg,
    prepare_sqlite,
    summary_ms,
    write_json,
)

FILL_BATCH = 2000
GOAL_P99_MS = 50.0


def step(i: int) -> list[Message]:
    """Four messages of one agent step: a request, a tool call, its result, an answer."""
    call = f"call_{i}"
    return [
        Message(role="user", content=f"step {i}: check the build log " + "x" * 300),
        Message(role="assistant", content=None,
                tool_calls=(ToolCall(id=call, name="read_file",
                                     arguments=json.dumps({"path": f"/srv/{i}.log"})),)),
        Message(role="tool", tool_call_id=call, content=f"line {i} " * 250),
        Message(role="assistant", content=f"step {i} done: the build is green " + "y" * 400),
    ]


async def fill(store: Store, session_id: str, messages: int) -> None:
    await store.create_session(session_id, run_model="gpt-4o")
    batch: list[Message] = []
    for i in range(messages // 4):
        batch.extend(step(i))
        if len(batch) >= FILL_BATCH:
            await store.append(session_id, batch)
            batch = []
    if batch:
        await store.append(session_id, batch)


async def appends(store: Store, session_id: str, rate: float, until: asyncio.Event,
                  took: list[float]) -> None:
    """Append one message per 1/rate seconds until ``until`` is set; latency from when due."""
    interval = 1.0 / rate
    due = time.perf_counter()
    n = 0
    while not until.is_set():
        now = time.perf_counter()
        if now < due:
            await asyncio.sleep(due - now)
        await store.append(session_id, [Message(role="user", content=f"tick {n}")])
        took.append((time.perf_counter() - due) * 1000)
        n += 1
        due += interval


def prepare(backend: str, database_url: str | None) -> str:
    if backend == "postgres":
        return prepare_pg(database_url or pg_url("deletion"))
    return prepare_sqlite(Path(tempfile.mkdtemp(prefix="compactd-bench-deletion-")))


async def run(args: argparse.Namespace, url: str) -> dict[str, Any]:
    store = Store.from_url(url)
    try:
        started = time.perf_counter()
        await fill(store, "big", args.messages)
        fill_s = time.perf_counter() - started
        await store.create_session("agent", run_model="gpt-4o")
        await store.append("agent", [Message(role="user", content="warm")])

        idle: list[float] = []
        stop = asyncio.Event()
        task = asyncio.create_task(appends(store, "agent", args.rate, stop, idle))
        await asyncio.sleep(args.idle)
        stop.set()
        await task

        during: list[float] = []
        stop = asyncio.Event()
        task = asyncio.create_task(appends(store, "agent", args.rate, stop, during))
        env = {**os.environ, "COMPACTD_DATABASE_URL": url, "PYTHONPATH": str(ROOT)}
        started = time.perf_counter()
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "compactd.scheduler.cli", "delete", "big", "--json", env=env,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, err = await proc.communicate()
        delete_s = time.perf_counter() - started
        stop.set()
        await task
        if proc.returncode != 0:
            raise SystemExit(f"compactd delete failed: {err.decode()}")
        deleted = json.loads(out)
        verified = (await store.verify("agent")).ok
    finally:
        await store.close()
    during_summary = summary_ms(during)
    return {"benchmark": "deletion", "backend": args.backend, "messages": args.messages,
            "rate_per_s": args.rate, "fill_s": round(fill_s, 1),
            "delete_s": round(delete_s, 2), "rows_deleted": deleted["rows"],
            "appends_idle": summary_ms(idle), "appends_during_delete": during_summary,
            "goal_p99_ms": GOAL_P99_MS,
            "goal_met": during_summary.get("p99_ms", 1e9) < GOAL_P99_MS,
            "agent_session_verified": verified, "machine": machine()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=("postgres", "sqlite"), default="postgres")
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--rate", type=float, default=100.0)
    parser.add_argument("--idle", type=float, default=3.0)
    parser.add_argument("--database-url",
                        help="PostgreSQL: this database (emptied) instead of the bench's own")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    report = asyncio.run(run(args, prepare(args.backend, args.database_url)))
    print(machine_line(report["machine"]))
    print(f"{args.backend}: deleted {args.messages} messages in {report['delete_s']} s "
          f"(fill {report['fill_s']} s)")
    for name in ("appends_idle", "appends_during_delete"):
        s = report[name]
        print(f"  {name:<22} n={s['n']:<5} p50 {s['p50_ms']} ms  p99 {s['p99_ms']} ms  "
              f"max {s['max_ms']} ms")
    print(f"  goal p99 < {GOAL_P99_MS} ms during the deletion: "
          f"{'met' if report['goal_met'] else 'NOT met'}")
    write_json(args.json, report)


if __name__ == "__main__":
    main()
