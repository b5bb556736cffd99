"""The recall footer on the user's path: a real worker commits each session's checkpoint, and the
runtime is served it with the line naming ``history_read`` only when its registered envelope
offers the model a recall tool (or it registered none); the checkpoint is readable back by its
name either way."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from compactd.scheduler.client import CompactdClient
from compactd.worker.compaction.recall_tools import tool_schemas
from compactd.worker.settings import load_config
from tests.support.db import Db
from tests.support.fake_provider import FakeProvider
from tests.support.stack import Stack

pytestmark = pytest.mark.slow

SYSTEM = "You are a careful coding agent."
BASH = {"type": "function", "function": {"name": "bash", "description": "Run a command.",
                                         "parameters": {"type": "object", "properties": {}}}}
ENVELOPES: dict[str, dict[str, Any] | None] = {
    "recall-tools": {"system": SYSTEM, "tools": [BASH, *tool_schemas("openai")]},
    "anthropic-recall-tools": {"system": SYSTEM, "tools": tool_schemas("anthropic")},
    "no-envelope": None,
    "other-tools": {"system": SYSTEM, "tools": [BASH]},
    "system-only": {"system": SYSTEM},
}
OFFERED = {"recall-tools", "anthropic-recall-tools", "no-envelope"}
MESSAGES = [m for i in range(4) for m in (
    {"role": "user", "content": f"Step {i}: look at module_{i}.py " + "and its callers " * 60},
    {"role": "assistant", "content": f"module_{i}.py is read; " + "the callers agree " * 60})]


@pytest.fixture
def db(clean_pg: str) -> Iterator[Db]:
    with Db(clean_pg) as handle:
        yield handle


async def _checkpoints(stack: Stack) -> dict[str, tuple[str, str]]:
    """Each session's served checkpoint (its content) and the transcript history_read gives for
    its name."""
    out: dict[str, tuple[str, str]] = {}
    async with CompactdClient(load_config(env=stack.env)) as client:
        for sid in ENVELOPES:
            handle = await client.get_session(sid)
            [checkpoint] = [m for m in await handle.surface()
                            if (m.get("meta") or {}).get("checkpoint")]
            ref = checkpoint["meta"]["recall"]["ref"]
            out[sid] = (str(checkpoint["content"]), (await handle.history_read(ref)).transcript)
    return out


def test_the_footer_names_history_read_only_where_the_runtime_offers_it(
        make_stack: Callable[..., Stack], fake: FakeProvider, db: Db) -> None:
    stack = make_stack(summarization={"keep": {"type": "messages", "value": 2}},
                       worker={"local_fallback": False})
    for sid, envelope in ENVELOPES.items():
        db.run(lambda s, sid=sid, envelope=envelope: s.create_session(
            sid, run_model="fake-gpt", context_window=128_000, envelope=envelope))
        db.ingest(sid, MESSAGES, run_model="fake-gpt")
    stack.start_worker("w1", concurrency=2)
    for sid in ENVELOPES:
        assert stack.cli_json("compact", sid, "--wait")["outcome"] == "committed"

    served = asyncio.run(_checkpoints(stack))
    assert set(served) == set(ENVELOPES)
    for sid, (content, originals) in served.items():
        assert ("history_read(checkpoint=" in content) is (sid in OFFERED), (sid, content)
        assert "<durable_context_data>" in content
        # recall works whether or not the model was told how
        assert "Step 0: look at module_0.py" in originals, (sid, originals[:300])
