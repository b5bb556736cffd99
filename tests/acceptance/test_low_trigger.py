"""A trigger below what a compaction can bring the session under, on the user's path: a runtime
appends an SWE-agent-like session through the client, a real worker (Celery, PostgreSQL,
Redis) summarizes through the fake provider over HTTP.

The trigger is 4,000 tokens and the keep 12 messages; one observation of about 6,000 tokens
arrives, and for the 12 messages after it the kept tail alone is over the trigger: no
compaction can bring the session under it until the observation leaves the keep. The agent
steps on at its own pace meanwhile, every append over the trigger. No summary is asked for
that could only replace the last checkpoint and a step or two, leaving the session over its
trigger (a summary call and a break of the agent's cache for a few dozen tokens each): the
checkpoints written are those that bring the session under its trigger. Nor does every append
fire a run that changes nothing: the run that found nothing worth doing named the growth after
which one could (the observation out of the keep), and the appends until then fired none.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from compactd.scheduler.client import CompactdClient
from compactd.worker.settings import load_config
from tests.support.db import Db
from tests.support.fake_provider import Behaviour, FakeProvider
from tests.support.stack import Stack, wait_until

pytestmark = pytest.mark.slow

MakeStack = Callable[..., Stack]

TRIGGER = 4_000
KEEP = 12
POLICY = {"trigger": {"type": "tokens", "value": TRIGGER},
          "keep": {"type": "messages", "value": KEEP}, "model_name": "fake-gpt",
          "trim_tokens_to_summarize": 16_000}
STEP_S = 0.4
WORDS = 8  # about 40 tokens a message
BIG_WORDS = 1_200  # about 6,000 tokens: one observation
HEAD_STEPS = 20  # about 1,600 tokens before the observation
AFTER_STEPS = 16  # the observation leaves the keep of 12 after 6 steps of 2 messages
# A summary of about 300 tokens, the same size every call (a model's varies; the test's point
# is the runs, not the summary).
SUMMARY = "Summary {request}\n" + " ".join(f"point{i} carried forward" for i in range(100))


def message(role: str, i: int, words: int = WORDS) -> dict[str, str]:
    return {"role": role, "content": f"{role} {i}: " + " ".join(
        f"w{i}x{j}" for j in range(words))}


def step(i: int, big: bool = False) -> list[dict[str, str]]:
    """An action and its observation (SWE-agent's: a user message)."""
    return [message("assistant", i), message("user", i, BIG_WORDS if big else WORDS)]


async def replay(stack: Stack, session_id: str) -> list[tuple[int, bool, bool]]:
    """The session step by step at the agent's pace; after each append its pressure, whether
    it fired and whether it signalled."""
    tokens: list[tuple[int, bool, bool]] = []
    async with CompactdClient(load_config(env=stack.env)) as client:
        handle = await client.create_session(session_id, run_model="fake-gpt",
                                             context_window=128_000)
        steps = [step(i) for i in range(HEAD_STEPS)]
        steps.append(step(HEAD_STEPS, big=True))
        steps += [step(HEAD_STEPS + 1 + i) for i in range(AFTER_STEPS)]
        for messages in steps:
            await handle.poll()
            done = await handle.append(messages)
            tokens.append((done.tokens, done.fired, done.signalled))
            await asyncio.sleep(STEP_S)
        await client.drain()
    return tokens


def test_a_session_the_keep_holds_over_its_trigger_is_not_compacted_on_every_append(
        make_stack: MakeStack, clean_pg: str, fake: FakeProvider) -> None:
    fake.script(Behaviour(model="fake-gpt", output="text", text=SUMMARY, times=-1,
                          latency_s=0.05))
    stack = make_stack(summarization={**POLICY, "lead": 0})
    stack.start_worker("w1", concurrency=2)
    tokens = asyncio.run(replay(stack, "swe"))
    with Db(clean_pg) as db:
        wait_until(lambda: not db.run(lambda s: s.get_session("swe")).lease_owner,
                   timeout=30, interval=0.2, what="the last run's end")
        runs = db.runs("swe")
    # The session was over its trigger from the observation on, until a run could replace it.
    assert max(t for t, _fired, _signalled in tokens) > TRIGGER
    assert tokens[-1][0] < TRIGGER, tokens
    committed = [r for r in runs if r.status == "committed"]
    # Every checkpoint brought the session under its trigger: none was written only to be
    # rewritten a step later for the few tokens the keep had let go of.
    assert committed and all(r.tokens_after is not None and r.tokens_after < TRIGGER
                             for r in committed), [(r.status, r.tokens_before, r.tokens_after)
                                                   for r in runs]
    # One summary call per checkpoint: no call was made whose summary was thrown away.
    assert len(fake.requests) == len(committed), [r.model for r in fake.requests]
    # And not a run on every append meanwhile: the run that found nothing worth doing named
    # the growth after which one could, and the appends until then fired none.
    assert len([r for r in runs if r.status == "nothing_to_do"]) <= 1, [
        (r.status, r.tokens_before, r.tokens_after, r.error) for r in runs]
