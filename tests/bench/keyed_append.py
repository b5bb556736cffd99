"""What an idempotency key adds to an append (PostgreSQL): latency and CPU per append.

    python tests/bench/keyed_append.py --json OUT.json [--rounds 300] [--as-is]

The LangChain middleware keys every step it appends, and ``CompactdClient.append(retry=True)``
makes a key of its own, so the keyed append is the runtime's critical path as often as the
plain one. Each round makes three appends of one user message (about 60 o200k tokens) through
``Store.append`` on one session, in a rotating order so that machine noise falls on each alike:
``plain`` (no key), ``keyed`` (a new key: appended and recorded) and ``replayed`` (the key just
used, with the same message: answered from the key's row, nothing stored). Each is timed from
the call to its return: wall time (``perf_counter``) and this process's CPU
(``process_time``: the client's side; the server's CPU is not counted). Twenty rounds of
warm-up come first (the kept connection, asyncpg's prepared statements). Medians, p90 and p99
per kind are reported.

To compare two versions of the code, run this script alternately with each on ``PYTHONPATH``
(a tree holding ``compactd/storage`` etc. extracted by ``git archive``) against one database
migrated by the newer: ``--as-is`` uses the database as it is (no migration, no emptying; a
new session per run), which the older code's migrations would refuse.

The database is ``compactd_bench_keyed_append`` on ``COMPACTD_BENCH_DATABASE_URL``, or the one
``--database-url`` names.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import compactd.storage.store as store_module
from compactd.storage.messages import Message
from compactd.storage.store import Store
from tests.bench.common import (
    calibrate_pg,
    machine,
    machine_line,
    pg_url,
    prepare_pg,
    print_table,
    summary_ms,
    write_json,
)

KINDS = ("plain", "keyed", "replayed")
WARMUP_ROUNDS = 20
STEP_TEXT = ("Run the failing test again with the verbose flag and show me the full traceback, "
             "then check whether the fixture's database URL points at the right server. ")


async def run(url: str, rounds: int) -> dict[str, Any]:
    store = Store.from_url(url)
    session = f"keyed-{uuid.uuid4().hex[:8]}"
    wall: dict[str, list[float]] = {k: [] for k in KINDS}
    cpu: dict[str, list[float]] = {k: [] for k in KINDS}
    try:
        await store.create_session(session)
        for index in range(WARMUP_ROUNDS + rounds):
            key = f"step-{index}"
            order = KINDS[index % 3:] + KINDS[:index % 3]
            # A replay needs its key's first append: this round's keyed one when it came
            # first, else the one of a key appended before the round.
            if order.index("replayed") < order.index("keyed"):
                await store.append(session, [Message(role="user", content=STEP_TEXT + key)],
                                   idempotency_key=key)
                key_for = {"keyed": f"{key}-late", "replayed": key}
            else:
                key_for = {"keyed": key, "replayed": key}
            for kind in order:
                content = STEP_TEXT + (key if kind == "replayed" else key_for.get(kind, key))
                messages = [Message(role="user", content=content)]
                t0, c0 = time.perf_counter(), time.process_time()
                result = await store.append(session, messages,
                                            idempotency_key=key_for.get(kind))
                c1, t1 = time.process_time(), time.perf_counter()
                assert result.replayed == (kind == "replayed"), (kind, index)
                if index >= WARMUP_ROUNDS:
                    wall[kind].append((t1 - t0) * 1000)
                    cpu[kind].append((c1 - c0) * 1000)
    finally:
        await store.close()
    return {"code": store_module.__file__, "session": session,
            **{kind: {"wall": summary_ms(wall[kind]), "cpu": summary_ms(cpu[kind])}
               for kind in KINDS},
            "keyed_over_plain_wall": round(statistics.median(wall["keyed"])
                                           / statistics.median(wall["plain"]), 3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--rounds", type=int, default=300, help="timed rounds (3 appends each)")
    parser.add_argument("--database-url", help="the database (default: the script's own)")
    parser.add_argument("--as-is", action="store_true",
                        help="use the database as it is: no migration, no emptying")
    args = parser.parse_args(argv)
    info = machine()
    url = args.database_url or pg_url("keyed_append")
    if not args.as_is:
        prepare_pg(url)
    report: dict[str, Any] = {"machine": info, "rounds": args.rounds,
                              "pg_calibration": calibrate_pg(url)}
    report.update(asyncio.run(run(url, args.rounds)))
    print(f"machine: {machine_line(info)}")
    print(f"code: {report['code']}")
    print_table(["append", "wall p50 ms", "p90 ms", "p99 ms", "CPU p50 ms", "CPU p90 ms"],
                [[kind, report[kind]["wall"]["p50_ms"], report[kind]["wall"]["p90_ms"],
                  report[kind]["wall"]["p99_ms"], report[kind]["cpu"]["p50_ms"],
                  report[kind]["cpu"]["p90_ms"]] for kind in KINDS])
    print(f"keyed / plain (wall p50): {report['keyed_over_plain_wall']:.2f}x")
    write_json(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
