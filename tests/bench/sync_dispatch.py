"""What a synchronous client's call costs before any I/O: the hand-written loop thread
(``worker.runtime.EventLoopThread.submit``, which ``scheduler.client.Client`` uses) against anyio's
blocking portal (``BlockingPortal.call``), each handing a coroutine that awaits nothing to a loop
in another thread. Alternating pairs in one process; no service needed.

    python tests/bench/sync_dispatch.py [--calls 1000] [--pairs 5]

The portal spawns each call as a task of its task group, from this thread, and waits for the
spawn before it waits for the result: two hand-offs between threads where the loop thread has one.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from anyio.from_thread import start_blocking_portal

from compactd.worker.runtime import EventLoopThread


async def nothing() -> None:
    return None


def quantiles_us(call: Callable[[], object], calls: int) -> tuple[float, float]:
    took = []
    for _ in range(calls):
        start = time.perf_counter()
        call()
        took.append(time.perf_counter() - start)
    took.sort()
    return took[calls // 2] * 1e6, took[int(calls * 0.99)] * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--pairs", type=int, default=5)
    args = parser.parse_args()
    loop = EventLoopThread(name="bench-loop-thread")
    try:
        with start_blocking_portal(name="bench-portal") as portal:
            quantiles_us(lambda: loop.submit(nothing), 200)
            quantiles_us(lambda: portal.call(nothing), 200)
            for pair in range(args.pairs):
                # Alternate which goes first, so neither always meets a warmer machine.
                runs = [("loop thread", lambda: loop.submit(nothing)),
                        ("portal", lambda: portal.call(nothing))]
                if pair % 2:
                    runs.reverse()
                for name, call in runs:
                    p50, p99 = quantiles_us(call, args.calls)
                    print(f"pair {pair} {name:<11} p50 {p50:6.0f} us  p99 {p99:6.0f} us")
    finally:
        loop.stop()


if __name__ == "__main__":
    main()
