"""Sessions for the scheduler's tests on a stack of real processes: the policy they compact by,
the configuration the stack's processes run with (for a client in the test's process), and many
small sessions at once for bulk recompaction.
"""

from __future__ import annotations

import asyncio

from compactd.scheduler.samples import coding_session
from compactd.storage.messages import parse_openai
from compactd.storage.store import Store
from compactd.worker.settings import Config, load_config
from tests.support.stack import Stack

TRIGGER = 2000
POLICY = {"trigger": [{"type": "tokens", "value": TRIGGER}],
          "keep": {"type": "messages", "value": 6}, "model_name": "fake-gpt"}


def config_of(stack: Stack) -> Config:
    """The configuration the stack's processes run with, for the client in this process."""
    return load_config(env=stack.env)


async def many_sessions(store: Store, n: int, *, tenants: tuple[str, ...] = ("default",),
                        steps: int = 2) -> list[str]:
    """``n`` small sessions, each a couple of tool steps a summary shrinks."""
    ids = [f"bulk-{i:04d}" for i in range(n)]
    sem = asyncio.Semaphore(8)

    async def one(i: int, sid: str) -> None:
        async with sem:
            await store.create_session(sid, tenant=tenants[i % len(tenants)],
                                       run_model="fake-gpt")
            msgs = [parse_openai(m) for m in coding_session(
                steps=steps, big_output_lines=30, seed=i, call_prefix=f"b{i}").messages]
            await store.append(sid, msgs)

    await asyncio.gather(*(one(i, sid) for i, sid in enumerate(ids)))
    return ids
