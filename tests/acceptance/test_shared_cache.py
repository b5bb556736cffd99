"""A summary call that reads the agent's prompt cache, through a real worker: the runtime reads
its surface from compactd and sends its request to the fake provider (prefix cache on) with the
official SDK; then a queued run's summary call, made with the session's own run model, begins
with that request (envelope, tools, the served surface, the cache key or breakpoints), the
instruction last, and the run records the cached tokens the provider billed. With the switch
off, or a different summary model, no call begins with it and nothing is read from the cache."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from typing import Any

import anthropic
import openai
import pytest

from compactd.scheduler.client import CompactdClient
from compactd.worker.compaction.sharing import WIRE_KEYS
from compactd.worker.settings import load_config
from tests.support.db import Db
from tests.support.fake_provider import FakeProvider, RequestRecord
from tests.support.stack import Stack

pytestmark = pytest.mark.slow

KEY = "sk-fake-test-key"  # the stack's: the worker calls the fake with it too
AGENT = "x-test-agent"  # marks the runtime's own requests in the fake's log
SYSTEM = "You are a careful coding agent. Work in small, tested steps."
SCHEMA = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}
TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file.",
                                           "parameters": SCHEMA}}]
ANTHROPIC_TOOLS = [{"name": "read_file", "description": "Read a file.", "input_schema": SCHEMA}]
SOURCE = "".join(f"def rule_{i}(tokens):\n    return tokens[{i}:]  # rule {i}\n"
                 for i in range(90))
MESSAGES: list[dict[str, Any]] = [
    {"role": "user", "content": "Fix the failing test in src/app/parser.py."},
    {"role": "assistant", "content": "I will read the parser first."},
    {"role": "user", "content": "Go on: " + SOURCE},
    {"role": "assistant", "content": "The parser drops the last token in rule_89."},
    {"role": "user", "content": "Fix the slice, then run the suite."},
    {"role": "assistant", "content": "Fixed; the suite passes."},
]
KEEP = 2
BREAKPOINT = {"type": "ephemeral"}


@pytest.fixture
def db(clean_pg: str) -> Iterator[Db]:
    with Db(clean_pg) as handle:
        yield handle


def _create(db: Db, sid: str, run_model: str, envelope: dict[str, Any]) -> None:
    db.run(lambda s: s.create_session(sid, run_model=run_model, context_window=128_000,
                                      envelope=envelope))
    db.ingest(sid, MESSAGES, run_model=run_model)


async def _served(stack: Stack, sid: str) -> list[dict[str, Any]]:
    """The surface as compactd serves it to the runtime, with the keys a provider is sent."""
    async with CompactdClient(load_config(env=stack.env)) as client:
        handle = await client.get_session(sid)
        return [{k: m[k] for k in WIRE_KEYS if k in m} for m in await handle.surface()]


async def _openai_request(fake: FakeProvider, served: list[dict[str, Any]], cache_key: str
                          ) -> None:
    messages: list[Any] = [{"role": "system", "content": SYSTEM}, *served]
    tools: list[Any] = TOOLS
    async with openai.AsyncOpenAI(api_key=KEY, base_url=fake.openai_base_url, max_retries=0,
                                  default_headers={AGENT: "1"}) as sdk:
        await sdk.chat.completions.create(model="fake-gpt", messages=messages, tools=tools,
                                          prompt_cache_key=cache_key, max_completion_tokens=16)


async def _anthropic_request(fake: FakeProvider, served: list[dict[str, Any]]) -> None:
    # An Anthropic runtime's request, written out here: its breakpoints on the system prompt and
    # on the last block of its last message.
    messages: list[dict[str, Any]] = [{"role": m["role"], "content": m["content"]}
                                      for m in served]
    last = messages[-1]
    messages[-1] = {**last, "content": [{"type": "text", "text": last["content"],
                                         "cache_control": BREAKPOINT}]}
    system: list[Any] = [{"type": "text", "text": SYSTEM, "cache_control": BREAKPOINT}]
    sent: list[Any] = messages
    tools: list[Any] = ANTHROPIC_TOOLS
    async with anthropic.AsyncAnthropic(api_key=KEY, base_url=fake.anthropic_base_url,
                                        max_retries=0, default_headers={AGENT: "1"}) as sdk:
        await sdk.messages.create(model="fake-claude", max_tokens=16, tools=tools,
                                  system=system, messages=sent)


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def _begins_with(summary: dict[str, Any], runtime: dict[str, Any]) -> bool:
    """Whether the summary call's body is the runtime's, every key but the output cap the same
    and its messages the runtime's followed by more (the instruction)."""
    for key, value in runtime.items():
        if key in ("max_tokens", "max_completion_tokens"):
            continue
        if key == "messages":
            got = summary.get("messages") or []
            if len(got) <= len(value) or _canonical(got[:len(value)]) != _canonical(value):
                return False
        elif _canonical(summary.get(key)) != _canonical(value):
            return False
    return True


def _calls(fake: FakeProvider) -> tuple[RequestRecord, list[RequestRecord]]:
    runtime = [r for r in fake.requests if r.header(AGENT)]
    summary = [r for r in fake.requests if not r.header(AGENT)]
    assert len(runtime) == 1, [r.behaviour for r in fake.requests]
    return runtime[0], summary


def _run_usage(stack: Stack, sid: str) -> dict[str, Any]:
    result = stack.cli_json("compact", sid, "--wait")
    assert result["outcome"] == "committed", result
    [run] = stack.cli_json("status", sid)["runs"]
    usage: dict[str, Any] = run["usage"]
    return usage


@pytest.mark.parametrize("api", ["openai", "anthropic"])
def test_the_summary_call_begins_with_the_runtimes_last_request_and_reads_its_cache(
        make_stack: Callable[..., Stack], fake: FakeProvider, db: Db, api: str) -> None:
    fake.prefix_cache = True
    stack = make_stack(claude=api == "anthropic",
                       summarization={"keep": {"type": "messages", "value": KEEP}},
                       worker={"local_fallback": False})
    sid, run_model = f"shared-{api}", {"openai": "fake-gpt", "anthropic": "fake-claude"}[api]
    hints = ({"prompt_cache_key": "agent-7"} if api == "openai"
             else {"cache_control": BREAKPOINT})
    _create(db, sid, run_model, {"system": SYSTEM, "tools": TOOLS, **hints})
    served = asyncio.run(_served(stack, sid))
    assert [m["content"] for m in served] == [m["content"] for m in MESSAGES]
    if api == "openai":
        asyncio.run(_openai_request(fake, served, "agent-7"))
    else:
        asyncio.run(_anthropic_request(fake, served))
    stack.start_worker("w1", concurrency=1)
    usage = _run_usage(stack, sid)

    runtime, [summary] = _calls(fake)
    assert runtime.body is not None and summary.body is not None
    assert summary.model == run_model and summary.status == 200
    assert _begins_with(summary.body, runtime.body), _canonical(summary.body)[:2000]
    instruction = summary.body["messages"][-1]
    text = instruction["content"] if isinstance(instruction["content"], str) else "".join(
        b["text"] for b in instruction["content"])
    assert instruction["role"] == "user" and "Summarize the conversation above" in text
    assert f"The last {KEEP} messages above stay" in text
    # billed at the cached rate, and recorded on the run
    assert summary.cached_tokens is not None and summary.cached_tokens >= 1024
    assert usage["cached_tokens"] == summary.cached_tokens
    assert usage["by_candidate"][run_model]["cached_tokens"] == summary.cached_tokens


@pytest.mark.parametrize("policy", [{"share_cache": False}, {"model_name": "fake-mini"}],
                         ids=["switched-off", "summary-model"])
def test_no_call_shares_the_cache_when_switched_off_or_another_model_summarizes(
        make_stack: Callable[..., Stack], fake: FakeProvider, db: Db,
        policy: dict[str, Any]) -> None:
    fake.prefix_cache = True
    stack = make_stack(summarization={"keep": {"type": "messages", "value": KEEP}, **policy},
                       worker={"local_fallback": False})
    sid = "unshared"
    _create(db, sid, "fake-gpt", {"system": SYSTEM, "tools": TOOLS,
                                  "prompt_cache_key": "agent-7"})
    served = asyncio.run(_served(stack, sid))
    asyncio.run(_openai_request(fake, served, "agent-7"))
    stack.start_worker("w1", concurrency=1)
    usage = _run_usage(stack, sid)

    runtime, summaries = _calls(fake)
    assert runtime.body is not None and summaries
    for summary in summaries:
        assert summary.body is not None and summary.status == 200
        assert not _begins_with(summary.body, runtime.body)
        assert "prompt_cache_key" not in summary.body and "tools" not in summary.body
        assert summary.cached_tokens == 0
    assert {s.model for s in summaries} == {policy.get("model_name", "fake-gpt")}
    assert usage["cached_tokens"] == 0
