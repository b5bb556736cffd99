"""Recall over compacted sessions: byte-exact reads, dropped facts found, search cost by size.

    python tests/bench/recall.py --json OUT.json [--sizes 100,1000,10000] [--queries 200]
        [--layout merge|recallable]

For each size, one session of that many messages (user asks, the assistant calls a tool, the
tool answers, the assistant reports; every tenth tool result holds a planted fact: a unique
order id, a path and a value) is appended to PostgreSQL and compacted by the orchestration a
worker runs, inline, with the local summarizer, until a run has nothing to do. Then:

* ``read_exact_fraction``: of the messages compaction replaced, the share that
  ``history_read`` gives back byte-exact (every live checkpoint and pruned result read page by
  page with a 2,000-token budget, the pages joined and compared with the originals rendered).
* ``dropped_facts_found_top5``: of the planted facts no longer on the surface, the share whose
  message is among ``history_search``'s first five hits for the fact's order id.
* ``search_p99_ms``: by session size, p99 of ``history_search`` (dropped order ids, then
  words of the sessions' vocabulary for fuzzy searches, half of them scoped to a checkpoint),
  timed in the client around the call.

Sessions of all sizes share the tables, as tenants share a server.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import random
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from storage.messages import parse_openai  # noqa: E402
from storage.recall import render_original  # noqa: E402
from storage.store import Store  # noqa: E402
from tests.bench.common import (  # noqa: E402
    machine,
    machine_line,
    percentile,
    pg_url,
    prepare_pg,
    print_table,
    summary_ms,
    write_json,
)
from worker.orchestration import compact  # noqa: E402
from worker.runtime import open_deps  # noqa: E402
from worker.settings import Settings, build_config  # noqa: E402

POLICY = {"trigger": [{"type": "tokens", "value": 2_000}],
          "keep": {"type": "messages", "value": 12}}
WORDS = ["ledger", "invoice", "currency", "rounding", "balance", "payload", "retry", "window",
         "cursor", "batch", "schema", "column", "index", "record", "warehouse", "shipment"]
# The recallable layout at this trigger: chunks large enough to be worth an index checkpoint,
# and the index checkpoints and the state together kept well under the trigger.
RECALLABLE = {"layout": "recallable", "chunk_tokens": 600, "index_summary_tokens": 60,
              "index_max_tokens": 800, "max_summary_tokens": 600}
READ_BUDGET = 2000
MAX_ROUNDS = 200


def session_messages(size: int, seed: int) -> tuple[list[dict[str, Any]], dict[int, str]]:
    """``size`` messages and the planted facts by their seq (1-based)."""
    rng = random.Random(seed)
    out: list[dict[str, Any]] = [{"role": "system", "content": "You are a fulfilment agent."}]
    facts: dict[int, str] = {}
    turn = 0
    while len(out) < size:
        turn += 1
        call = f"call_{seed}_{turn}"
        words = " ".join(rng.choice(WORDS) for _ in range(60))
        body = f"rows for query {turn}:\n{words}"
        if turn % 10 == 0:
            order = f"ORD-{rng.getrandbits(40):010x}"
            fact = (f"{order} shipped from /srv/warehouse/{rng.randint(1, 99)}/manifest.csv "
                    f"weight {rng.randint(1, 900)} kg")
            body += f"\n{fact}\n" + " ".join(rng.choice(WORDS) for _ in range(40))
            facts[len(out) + 3] = order
        out += [{"role": "user", "content": f"Check batch {turn} for {rng.choice(WORDS)}."},
                {"role": "assistant", "content": None, "tool_calls": [{
                    "id": call, "type": "function",
                    "function": {"name": "query", "arguments": f'{{"batch": {turn}}}'}}]},
                {"role": "tool", "tool_call_id": call, "name": "query", "content": body},
                {"role": "assistant", "content": f"Batch {turn} checked."}]
    out = out[:size]
    if out[-1]["role"] == "assistant" and out[-1].get("tool_calls"):
        out.pop()
    return out, {seq: order for seq, order in facts.items() if seq <= len(out)}


async def build(url: str, size: int, policy: dict[str, Any]
                ) -> tuple[str, list[dict[str, Any]], dict[int, str], int]:
    config = build_config({}, settings=Settings(database_url=url, broker_url="memory://"))
    session_id = f"bench-{size}"
    messages, facts = session_messages(size, seed=size)
    rounds = 0
    async with open_deps(config, owner="bench-recall") as deps:
        await deps.store.create_session(session_id, context_window=128_000, policy=policy)
        batch = 500
        for i in range(0, len(messages), batch):
            await deps.store.append(session_id,
                                    [parse_openai(m) for m in messages[i:i + batch]])
        while rounds < MAX_ROUNDS:
            rounds += 1
            outcome = await compact(deps, session_id, trigger="pressure")
            if outcome.outcome != "committed":
                break
        assert (await deps.store.verify(session_id)).ok
    return session_id, messages, facts, rounds


async def measure(store: Store, session_id: str, messages: list[dict[str, Any]],
                  facts: dict[int, str], queries: int) -> dict[str, Any]:
    surface = await store.read_surface(session_id)
    on_surface = {n.seq for n in surface.nodes if n.kind == "message"}
    replaced = [seq for seq in range(1, len(messages) + 1) if seq not in on_surface]
    refs = [n.message.meta["recall"]["ref"] for n in surface.nodes
            if isinstance(n.message.meta.get("recall"), dict)]
    payloads = {i + 1: parse_openai(m).to_payload() for i, m in enumerate(messages)}
    # The bench's own copies of every message stay alive; moved out of the collector's way, a
    # full collection they would trigger mid-call does not land in the timings.
    gc.collect()
    gc.freeze()

    exact_seqs: set[int] = set()
    read_ms: list[float] = []
    for ref in refs:
        pages: list[str] = []
        seqs: list[int] = []
        offset: int | str = 0
        while True:
            started = time.perf_counter()
            page = await store.history_read(session_id, ref, offset, budget_tokens=READ_BUDGET)
            read_ms.append((time.perf_counter() - started) * 1000)
            pages.append(page.transcript)
            seqs += [s for s in page.seqs if not seqs or s != seqs[-1]]
            if page.cursor is None:
                break
            offset = page.cursor
        expected = "".join(render_original(s, payloads[s]) for s in seqs)
        if "".join(pages) == expected:
            exact_seqs.update(seqs)
    read_exact = sum(1 for s in replaced if s in exact_seqs) / len(replaced) if replaced else 1.0

    surface_text = "\n".join(str(n.message.content) for n in surface.nodes)
    dropped = {seq: order for seq, order in facts.items() if order not in surface_text}
    found = 0
    timings: list[float] = []
    by_kind: dict[str, list[float]] = {"needle": [], "one word": [], "two words": [],
                                       "scoped": []}
    for seq, order in dropped.items():
        started = time.perf_counter()
        result = await store.history_search(session_id, order)
        timings.append((time.perf_counter() - started) * 1000)
        by_kind["needle"].append(timings[-1])
        if seq in [h.seq for h in result.hits[:5]]:
            found += 1
    rng = random.Random(len(messages))
    scanned = 0
    while len(timings) < queries:
        two = bool(len(timings) % 3)
        query = " ".join(rng.sample(WORDS, 2)) if two else rng.choice(WORDS)
        scope = rng.choice(refs) if refs and len(timings) % 2 else None
        started = time.perf_counter()
        result = await store.history_search(session_id, query, checkpoint=scope)
        timings.append((time.perf_counter() - started) * 1000)
        kind = "scoped" if scope else "two words" if two else "one word"
        by_kind[kind].append(timings[-1])
        scanned = max(scanned, result.scanned_messages)
    gc.unfreeze()
    return {"messages": len(messages), "replaced": len(replaced), "nodes_read": len(refs),
            "read_exact_fraction": round(read_exact, 4), "facts_planted": len(facts),
            "facts_dropped": len(dropped),
            "dropped_found_top5": found, "search": summary_ms(timings),
            "search_p99_ms": round(percentile(timings, 99), 3),
            "search_by_kind": {k: summary_ms(v) for k, v in by_kind.items()},
            "read": summary_ms(read_ms),
            "most_scanned_messages": scanned}


async def vacuum(url: str) -> None:
    """What autovacuum would have done to a server in its steady state: statistics, and the
    freshly written rows marked visible."""
    from urllib.parse import urlparse

    import asyncpg

    conn = await asyncpg.connect(urlparse(url)._replace(scheme="postgresql").geturl())
    try:
        await conn.execute("VACUUM ANALYZE")
    finally:
        await conn.close()


async def run(url: str, sizes: list[int], queries: int, policy: dict[str, Any]
              ) -> dict[str, Any]:
    built = []
    for size in sizes:
        started = time.perf_counter()
        session_id, messages, facts, rounds = await build(url, size, policy)
        built.append((size, session_id, messages, facts,
                      {"rounds": rounds, "build_s": round(time.perf_counter() - started, 1)}))
    await vacuum(url)
    store = Store.from_url(url)
    try:
        by_size = {}
        for size, session_id, messages, facts, extra in built:
            await store.history_search(session_id, "warm up")
            by_size[str(size)] = {**extra, **await measure(store, session_id, messages, facts,
                                                           queries)}
    finally:
        await store.close()
    replaced = sum(r["replaced"] for r in by_size.values())
    exact = sum(r["read_exact_fraction"] * r["replaced"] for r in by_size.values())
    dropped = sum(r["facts_dropped"] for r in by_size.values())
    found = sum(r["dropped_found_top5"] for r in by_size.values())
    return {"read_exact_fraction": round(exact / replaced, 4) if replaced else 1.0,
            "dropped_facts_found_top5": round(found / dropped, 4) if dropped else 1.0,
            "search_p99_ms": {size: r["search_p99_ms"] for size, r in by_size.items()},
            "by_size": by_size}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--sizes", default="100,1000,10000",
                        help="messages per session, comma-separated")
    parser.add_argument("--queries", type=int, default=200, help="timed searches per size")
    parser.add_argument("--layout", choices=("merge", "recallable"), default="merge",
                        help="summarization.layout of the sessions")
    args = parser.parse_args(argv)
    info = machine()
    recallable = args.layout == "recallable"
    url = prepare_pg(pg_url("recall_recallable" if recallable else "recall"))
    sizes = [int(s) for s in args.sizes.split(",")]
    policy = {**POLICY, **RECALLABLE} if recallable else POLICY
    report: dict[str, Any] = {"machine": info, "layout": args.layout,
                              **asyncio.run(run(url, sizes, args.queries, policy))}
    print(f"machine: {machine_line(info)}")
    print_table(["messages", "rounds", "replaced", "read exact", "dropped facts",
                 "found top 5", "search p50 ms", "search p99 ms", "most scanned"],
                [[size, r["rounds"], r["replaced"], r["read_exact_fraction"], r["facts_dropped"],
                  r["dropped_found_top5"], r["search"]["p50_ms"], r["search_p99_ms"],
                  r["most_scanned_messages"]] for size, r in report["by_size"].items()])
    print(f"read_exact_fraction {report['read_exact_fraction']}, dropped_facts_found_top5 "
          f"{report['dropped_facts_found_top5']}, search_p99_ms {report['search_p99_ms']}")
    write_json(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
