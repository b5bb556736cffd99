"""A range the latest user request splits, compacted through a real worker: the work before the
request and the work done on it go in one checkpoint, from one summary call at the fake
provider, committed once; the request stays verbatim and the checkpoint follows it, so the
runtime is served ``[the request, the summary, the kept tail]`` and the log replays."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from compactd.scheduler.client import CompactdClient
from compactd.worker.settings import load_config
from tests.support.db import Db
from tests.support.fake_provider import FakeProvider
from tests.support.stack import Stack

pytestmark = pytest.mark.slow

SYSTEM = "You are a careful airline support agent."
REQUEST = "Also move my return flight to Friday, same fare class please."
# An earlier turn, the latest request, the work on it, and a tail of two messages.
BEFORE = [m for i in range(3) for m in (
    {"role": "user", "content": f"Turn {i}: check reservation R{i} " + "and its segments " * 60},
    {"role": "assistant", "content": f"Reservation R{i} is confirmed; " + "segment ok " * 60})]
WORK = [{"role": "assistant", "content": f"Work {i} on the return flight: " + "fare rules " * 60}
        for i in range(4)]
TAIL = [{"role": "assistant", "content": "Friday has two options in that fare class."},
        {"role": "assistant", "content": "Booking the 09:40 one now."}]


@pytest.fixture
def db(clean_pg: str) -> Iterator[Db]:
    with Db(clean_pg) as handle:
        yield handle


async def _served(stack: Stack, sid: str) -> list[dict[str, Any]]:
    async with CompactdClient(load_config(env=stack.env)) as client:
        handle = await client.get_session(sid)
        return list(await handle.surface())


def test_a_range_the_latest_request_splits_is_summarized_whole_in_one_commit(
        make_stack: Callable[..., Stack], fake: FakeProvider, db: Db) -> None:
    fake.prefix_cache = True
    stack = make_stack(summarization={"keep": {"type": "messages", "value": len(TAIL)}},
                       worker={"local_fallback": False})
    sid = "split"
    db.run(lambda s: s.create_session(sid, run_model="fake-gpt", context_window=128_000,
                                      envelope={"system": SYSTEM,
                                                "prompt_cache_key": "agent-split"}))
    db.ingest(sid, [*BEFORE, {"role": "user", "content": REQUEST}, *WORK, *TAIL],
              run_model="fake-gpt")
    stack.start_worker("w1", concurrency=1)
    result = stack.cli_json("compact", sid, "--wait", "--keep", f"messages:{len(TAIL)}")
    assert result["outcome"] == "committed", result

    # One checkpoint replaced both sides of the request, in one run, and follows it.
    served = asyncio.run(_served(stack, sid))
    checkpoints = [m for m in served if (m.get("meta") or {}).get("checkpoint")]
    assert len(checkpoints) == 1, [m["content"][:60] for m in served]
    assert [m["content"] for m in served] == [REQUEST, checkpoints[0]["content"],
                                              *(m["content"] for m in TAIL)]
    [run] = stack.cli_json("status", sid)["runs"]
    assert run["status"] == "committed"
    assert stack.cli("verify", sid).returncode == 0

    # From one summary call, reading the whole range (it shares the agent's request), whose
    # instruction says the request stays.
    [summary] = fake.requests
    assert summary.body is not None and summary.model == "fake-gpt"
    instruction = summary.body["messages"][-1]["content"]
    assert "stay in the conversation word for word, before your summary" in instruction
    assert REQUEST[:40] in instruction
