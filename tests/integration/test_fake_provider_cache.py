"""The fake provider's prefix cache, seen through the official SDKs over HTTP: cached input
tokens are the longest prefix shared with an earlier request of the same key, in 128-token
blocks past the first 1,024, as OpenAI and Anthropic report them."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import anthropic
import openai
import pytest

from tests.support.fake_provider import (
    Behaviour,
    FakeProvider,
    RemoteFake,
    cached_blocks,
    fake_provider_process,
)

MODEL = "gpt-4o"
TOOLS: Any = [{"type": "function", "function": {
    "name": "read_file", "description": "Read a file.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}]


@pytest.fixture
def caching() -> Iterator[FakeProvider]:
    with FakeProvider(prefix_cache=True) as provider:
        yield provider


def filler(tokens: int) -> str:
    """About ``tokens`` tokens of text (" data" is one o200k token)."""
    return "You are a careful agent." + " data" * tokens


def client(fake: FakeProvider, key: str = "key-a") -> openai.OpenAI:
    return openai.OpenAI(api_key=key, base_url=fake.openai_base_url, max_retries=0)


def ask(fake: FakeProvider, messages: list[dict[str, Any]], *, key: str = "key-a",
        **extra: Any) -> tuple[int, int]:
    """(prompt tokens, cached tokens) the fake reported to the OpenAI SDK."""
    with client(fake, key) as sdk:
        done = sdk.chat.completions.create(model=MODEL, messages=messages,  # type: ignore[arg-type]
                                           **extra)
    assert done.usage is not None and done.usage.prompt_tokens_details is not None
    return done.usage.prompt_tokens, done.usage.prompt_tokens_details.cached_tokens or 0


def conversation(system_tokens: int, turns: int) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": filler(system_tokens)}]
    for n in range(turns):
        messages.append({"role": "user", "content": f"step {n}: what next?"})
        messages.append({"role": "assistant", "content": f"doing step {n}"})
    return [*messages, {"role": "user", "content": "and now?"}]


def test_an_agent_loop_reads_its_previous_request_from_the_cache(
        caching: FakeProvider) -> None:
    first = conversation(3000, 1)
    prompt_a, cached_a = ask(caching, first, tools=TOOLS)
    assert cached_a == 0 and prompt_a > 3000
    # The next step resends the whole previous request and adds to it.
    second = [*first, {"role": "assistant", "content": "read it"},
              {"role": "user", "content": "go on"}]
    prompt_b, cached_b = ask(caching, second, tools=TOOLS)
    assert prompt_b > prompt_a
    assert cached_b == cached_blocks(prompt_a) == 1024 + (prompt_a - 1024) // 128 * 128
    assert prompt_a - 128 < cached_b <= prompt_a
    record = caching.requests[-1]
    assert (record.input_tokens, record.cached_tokens) == (prompt_b, cached_b)


def test_a_repeated_request_is_cached_in_whole_blocks_only(caching: FakeProvider) -> None:
    messages = conversation(2000, 0)
    prompt, _ = ask(caching, messages)
    again, cached = ask(caching, messages)
    assert again == prompt and cached == cached_blocks(prompt)
    assert cached % 128 == 0 and cached <= prompt < cached + 128


def test_a_prefix_under_1024_tokens_is_never_cached(caching: FakeProvider) -> None:
    short = conversation(800, 0)
    prompt_a, _ = ask(caching, short)
    assert prompt_a < 1024
    longer = [*short, {"role": "assistant", "content": "ok"},
              {"role": "user", "content": " data" * 2000}]
    prompt_b, cached_b = ask(caching, longer)
    assert prompt_b > 2000 and cached_b == 0


def test_the_first_block_is_1024_tokens(caching: FakeProvider) -> None:
    # Size the system prompt so the whole first request is just past 1,024 tokens.
    size = 1000
    for attempt in range(6):
        prompt, _ = ask(caching, conversation(size, 0), key=f"probe-{attempt}")
        if 1024 <= prompt < 1024 + 128:
            break
        size += 1024 + 40 - prompt
    assert 1024 <= prompt < 1024 + 128
    first = conversation(size, 0)
    ask(caching, first)
    _, cached = ask(caching, [*first, {"role": "assistant", "content": "x"},
                              {"role": "user", "content": "y" * 3000}])
    assert cached == 1024


def test_a_different_key_shares_nothing(caching: FakeProvider) -> None:
    messages = conversation(3000, 2)
    ask(caching, messages, key="key-a")
    assert ask(caching, messages, key="key-b")[1] == 0
    # A named cache key overrides the API key: same key, same cache.
    ask(caching, messages, key="key-a", extra_body={"prompt_cache_key": "agent-1"})
    assert ask(caching, messages, key="key-c",
               extra_body={"prompt_cache_key": "agent-2"})[1] == 0
    assert ask(caching, messages, key="key-c",
               extra_body={"prompt_cache_key": "agent-1"})[1] > 0
    # And per model: another model's cache is another cache.
    with client(caching) as sdk:
        other = sdk.chat.completions.create(model="gpt-4.1", messages=messages)  # type: ignore[arg-type]
    assert other.usage is not None and other.usage.prompt_tokens_details is not None
    assert other.usage.prompt_tokens_details.cached_tokens == 0


def test_a_change_near_the_head_invalidates_what_follows(caching: FakeProvider) -> None:
    messages = conversation(3000, 3)
    prompt, _ = ask(caching, messages, tools=TOOLS)
    changed_tools = [{**TOOLS[0], "function": {**TOOLS[0]["function"], "description": "Read."}}]
    assert ask(caching, messages, tools=changed_tools)[1] == 0
    edited = [{"role": "system", "content": "X" + messages[0]["content"]}, *messages[1:]]
    assert ask(caching, edited, tools=TOOLS)[1] == 0
    # A change after the system prompt keeps the system prompt's blocks.
    late = [*messages[:1], {"role": "user", "content": "a compaction changed this"},
            *messages[2:]]
    cached = ask(caching, late, tools=TOOLS)[1]
    assert 3000 - 128 <= cached < prompt


def test_anthropic_reports_cache_reads_apart_from_input(caching: FakeProvider) -> None:
    sdk = anthropic.Anthropic(api_key="key-a", base_url=caching.anthropic_base_url,
                              max_retries=0)
    system: Any = [{"type": "text", "text": filler(4000), "cache_control": {"type": "ephemeral"}}]
    first: Any = [{"role": "user", "content": "step one"}]
    try:
        a = sdk.messages.create(model="claude-sonnet-4-5", max_tokens=100, system=system,
                                messages=first)
        b = sdk.messages.create(model="claude-sonnet-4-5", max_tokens=100, system=system,
                                messages=[*first, {"role": "assistant", "content": "done"},
                                          {"role": "user", "content": "step two"}])
    finally:
        sdk.close()
    assert a.usage.cache_read_input_tokens == 0 and a.usage.input_tokens > 4000
    assert b.usage.cache_read_input_tokens == cached_blocks(a.usage.input_tokens)
    total_b = b.usage.input_tokens + b.usage.cache_read_input_tokens
    assert total_b > a.usage.input_tokens and 0 < b.usage.input_tokens < 200


def test_the_cache_is_off_unless_asked_for(fake: FakeProvider) -> None:
    messages = conversation(3000, 1)
    ask(fake, messages)
    prompt, cached = ask(fake, messages)
    assert cached == 0
    assert prompt == math.ceil(fake.requests[-1].body_bytes / 4)  # the numbers of old
    fake.prefix_cache = True
    ask(fake, messages)
    assert ask(fake, messages)[1] > 1024


def test_a_scripted_cached_count_still_wins(caching: FakeProvider) -> None:
    caching.script(Behaviour(model=MODEL, cached_tokens=40))
    assert ask(caching, conversation(3000, 0))[1] == 40


def test_a_fake_process_caches_when_told() -> None:
    with fake_provider_process(prefix_cache=True) as url:
        remote = RemoteFake(url)
        messages = conversation(3000, 1)
        sdk = openai.OpenAI(api_key="k", base_url=remote.openai_base_url, max_retries=0)
        try:
            def cached() -> int:
                done = sdk.chat.completions.create(model=MODEL, messages=messages)  # type: ignore[arg-type]
                assert done.usage is not None and done.usage.prompt_tokens_details is not None
                return done.usage.prompt_tokens_details.cached_tokens or 0

            assert [cached(), cached()][1] > 1024
            assert remote.requests()[-1]["cached_tokens"] > 1024
            remote.configure(prefix_cache=False)
            assert cached() == 0
        finally:
            sdk.close()


def test_the_request_log_holds_the_usage_each_answer_reported(caching: FakeProvider) -> None:
    # Benchmarks total a summarizer's tokens from the log (its process is not theirs).
    with client(caching) as sdk:
        done = sdk.chat.completions.create(model=MODEL, messages=conversation(1500, 2))  # type: ignore[arg-type]
    assert done.usage is not None and done.usage.prompt_tokens_details is not None
    record = caching.requests[-1]
    assert record.input_tokens == done.usage.prompt_tokens
    assert record.cached_tokens == done.usage.prompt_tokens_details.cached_tokens == 0
    assert record.output_tokens == done.usage.completion_tokens > 0
