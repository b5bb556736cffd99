"""An agent loop on compactd: append each step, poll, pick the checkpoint up, report usage.

    celery -A compactd.worker.app worker &   # compacts in the background (same COMPACTD_* settings)
    python ops/examples/agent_loop.py [--steps 40] [--think 0.1] [--timeout 120]

It uses the COMPACTD_* settings (none set: the embedded default, a SQLite file in the current
directory). The model is simulated: each step's reply and tool results come from a generated
coding-agent session (scheduler.samples), so no API key is needed; where this loop "calls the
model", a runtime calls its own and reports the provider's usage. Exit status 0 once a checkpoint
summary a worker committed was picked up, 1 when none arrived within --timeout seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import uuid
from typing import Any

from compactd.client import CompactdClient
from compactd.scheduler.samples import coding_session

# Low enough that the generated session (about 60k tokens at 40 steps) crosses it a few times.
POLICY = {"trigger": [{"type": "tokens", "value": 20_000}],
          "keep": {"type": "messages", "value": 12}}


def steps_of(messages: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The transcript cut into steps: what precedes the first reply, then each assistant message
    with the tool results that answer it."""
    steps: list[list[dict[str, Any]]] = [[]]
    for message in messages:
        if message["role"] == "assistant" and steps[-1]:
            steps.append([])
        steps[-1].append(message)
    return steps


def is_checkpoint(message: dict[str, Any]) -> bool:
    return bool((message.get("meta") or {}).get("checkpoint"))


async def run(steps: int, think_s: float, timeout_s: float) -> int:
    sample = coding_session(steps=steps)
    system, *transcript = sample.messages
    async with CompactdClient() as compactd:
        session = await compactd.create_session(
            f"agent-loop-{uuid.uuid4().hex[:8]}", run_model="gpt-4o", context_window=128_000,
            envelope={"system": system["content"]}, policy=POLICY)
        print(f"session {session.id} on {compactd.config.database_url.split('://')[0]}")
        request: list[dict[str, Any]] = []   # what the next model call sends
        picked_up = 0                        # new surfaces a worker committed
        summarized = False                   # one of them holds a summary checkpoint
        for n, step_messages in enumerate(steps_of(transcript), 1):
            sent_tokens = session.info.surface_tokens
            # The model call would go here, with [system, *request]; its reply (and the tools'
            # results) are the step's messages.
            step = await session.append(step_messages)          # one round trip
            request += step_messages
            await session.report_usage(sent_tokens, 0)          # the provider's usage: input,
                                                                # output (a real runtime's)
            if await session.poll() is not None:                # a worker committed
                request = await session.surface()               # the new surface
                picked_up += 1
                summarized = summarized or any(map(is_checkpoint, request))
                print(f"step {n}: picked up a new surface: {len(request)} messages, "
                      f"{sum(map(is_checkpoint, request))} summary checkpoint(s)")
            elif step.signalled:
                print(f"step {n}: {step.tokens} tokens, over the trigger: a worker is compacting")
            await asyncio.sleep(think_s)
        deadline = time.monotonic() + timeout_s
        while not summarized and time.monotonic() < deadline:
            if await session.poll() is not None:
                request = await session.surface()
                picked_up += 1
                summarized = any(map(is_checkpoint, request))
                print(f"after the last step: picked up a new surface, {len(request)} messages")
            else:
                await asyncio.sleep(0.5)
        if not summarized:
            print(f"no summary checkpoint within {timeout_s:.0f} s: is a worker running "
                  "(celery -A compactd.worker.app worker) with the same COMPACTD_* settings?",
                  file=sys.stderr)
            return 1
        # A detail the summary may have dropped stays reachable from the replaced originals.
        fact = next(f for facts in sample.facts.values() for f in facts)
        found = await session.history_search(fact, limit=1)
        where = found.hits[0].checkpoint if found.hits else "not replaced (still on the surface)"
        print(f"history_search({fact!r}): {where}")
        print(f"done: {picked_up} new surface(s) picked up; no step waited for a compaction")
        return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="agent steps to replay")
    parser.add_argument("--think", type=float, default=0.1,
                        help="seconds the simulated model takes per step")
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="seconds to wait for a checkpoint after the last step")
    args = parser.parse_args()
    sys.exit(asyncio.run(run(args.steps, args.think, args.timeout)))


if __name__ == "__main__":
    main()
