"""How many summary calls per second the fake provider sustains, through the real SDK.

    python tests/bench/fake_provider_throughput.py [--concurrency 100] [--requests 1000]
        [--latency 1.0] [--api openai|anthropic] [--json OUT.json]

Starts the fake as a subprocess (so the client and the server do not share a GIL), then keeps
``concurrency`` calls in flight through ``worker.llm`` providers until ``requests`` are done. With
latency L the ideal is concurrency / L calls per second; the report says how close the fake (and
the client) come, so a throughput benchmark built on it knows its own ceiling.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from compactd.worker.llm.candidates import Candidate  # noqa: E402
from compactd.worker.llm.pool import ProviderPool  # noqa: E402
from compactd.worker.settings import ModelSpec  # noqa: E402
from tests.support.fake_provider import RemoteFake, fake_provider_process  # noqa: E402


async def drive(url: str, api: str, concurrency: int, total: int) -> dict[str, float]:
    base = url if api == "anthropic" else f"{url}/v1"
    spec = ModelSpec(name="bench", provider=api, model="bench-model",  # type: ignore[arg-type]
                     base_url=base, api_key_env="BENCH_KEY", timeout_s=120)
    pool = ProviderPool(env={"BENCH_KEY": "bench"})
    provider = pool.get(Candidate.from_spec(spec))
    chat = [{"role": "system", "content": "Summarize."},
            {"role": "user", "content": "src/app/main.py raised KeyError. " * 400}]
    latencies: list[float] = []
    remaining = total

    async def worker() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            started = time.monotonic()
            await provider.complete(chat, max_tokens=500)
            latencies.append(time.monotonic() - started)

    started = time.monotonic()
    try:
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    finally:
        await pool.aclose()
    elapsed = time.monotonic() - started
    latencies.sort()
    return {"elapsed_s": round(elapsed, 3), "per_s": round(total / elapsed, 1),
            "latency_p50_s": round(statistics.median(latencies), 3),
            "latency_p99_s": round(latencies[int(len(latencies) * 0.99) - 1], 3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--concurrency", type=int, default=100)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--latency", type=float, default=1.0)
    parser.add_argument("--api", choices=("openai", "anthropic"), default="openai")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    with fake_provider_process(args.latency) as url:
        result = asyncio.run(drive(url, args.api, args.concurrency, args.requests))
        served = len(RemoteFake(url).requests())
    ideal = args.concurrency / args.latency if args.latency else None
    report = {"api": args.api, "concurrency": args.concurrency, "requests": args.requests,
              "latency_s": args.latency, "served": served, **result,
              "ideal_per_s": ideal,
              "efficiency": round(result["per_s"] / ideal, 3) if ideal else None}
    print(json.dumps(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 0 if served == args.requests else 1


if __name__ == "__main__":
    sys.exit(main())
