"""The fake provider itself: scripting rules, and the subprocess with its control endpoints."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from compactd.storage.tokens import counter_for
from compactd.worker.compaction.prompt import INDEX_MARK
from compactd.worker.llm.candidates import Candidate
from compactd.worker.llm.fallback import RetryPolicy, SummaryRequest, summarize
from compactd.worker.llm.pool import ProviderPool
from compactd.worker.settings import ModelSpec
from tests.support.fake_provider import (
    Behaviour,
    FakeProvider,
    RemoteFake,
    fake_index_entry,
    fake_summary,
)

ROOT = Path(__file__).resolve().parents[2]
COUNTER = counter_for(None)


@pytest.fixture
def fake() -> Iterator[FakeProvider]:
    with FakeProvider() as provider:
        yield provider


async def ask(client: openai.AsyncOpenAI, model: str) -> int:
    try:
        await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "x" * 400}])
    except openai.APIStatusError as exc:
        return exc.status_code
    return 200


async def test_behaviours_match_by_model_then_in_order(fake: FakeProvider) -> None:
    fake.script(Behaviour(model="b", status=500),
                Behaviour(status=503, times=2),
                Behaviour(model="a", status=401))
    client = openai.AsyncOpenAI(api_key="k", base_url=fake.openai_base_url, max_retries=0)
    try:
        statuses = [await ask(client, m) for m in ("a", "a", "b", "a", "b")]
    finally:
        await client.close()
    # "a": the first matching entry is the any-model 503 (twice), then its own 401.
    assert statuses == [503, 503, 500, 401, 200]
    assert fake.pending_script() == []
    assert [r.model for r in fake.requests_for(api="openai")] == ["a", "a", "b", "a", "b"]


def test_the_fake_answers_within_the_output_cap_and_an_index_call_with_one_line() -> None:
    text = ("Traceback in src/billing/tax.py: KeyError BILL-1234. " * 400)
    for cap in (20, 60, 400):
        summary = fake_summary(text, model="m", max_tokens=cap)
        assert COUNTER.count_text(summary) <= cap
        entry = fake_index_entry(f"{INDEX_MARK} ...\n{text}", model="m", max_tokens=cap)
        assert "\n" not in entry and "## " not in entry and COUNTER.count_text(entry) <= cap
    assert "src/billing/tax.py" in fake_index_entry(text, model="m", max_tokens=100)


async def test_a_behaviour_can_match_what_the_input_holds(fake: FakeProvider) -> None:
    fake.script(Behaviour(contains="needle", status=503, times=-1))
    client = openai.AsyncOpenAI(api_key="k", base_url=fake.openai_base_url, max_retries=0)
    statuses = []
    try:
        for content in ("hay", "a needle here", "hay again"):
            try:
                await client.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": content}])
                statuses.append(200)
            except openai.APIStatusError as exc:
                statuses.append(exc.status_code)
    finally:
        await client.close()
    assert statuses == [200, 503, 200]


def test_the_fake_summary_is_short_and_names_the_facts() -> None:
    text = ("Traceback in src/billing/tax.py: KeyError BILL-1234. " * 40)
    summary = fake_summary(text, model="m", max_tokens=1000)
    assert len(summary) <= len(text) // 4
    assert "src/billing/tax.py" in summary and "KeyError" in summary and "BILL-1234" in summary
    assert summary.count("## ") == 8


@pytest.fixture
def remote() -> Iterator[RemoteFake]:
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.support.fake_provider", "--port", "0", "--keep-bodies"],
        cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        url = json.loads(process.stdout.readline())["url"]
        yield RemoteFake(url)
    finally:
        process.terminate()
        process.wait(10)
        if process.stdout is not None:
            process.stdout.close()


async def test_a_fake_in_another_process_is_scripted_over_http(remote: RemoteFake) -> None:
    assert remote.health()
    remote.script(Behaviour(model="gpt-sub", status=503, times=2))
    remote.configure(latency_s=0.05)
    spec = ModelSpec(name="sub", provider="openai", model="gpt-sub",
                     base_url=remote.openai_base_url, api_key_env="K")
    pool = ProviderPool(env={"K": "k"})
    request = SummaryRequest.of([{"role": "user", "content": "Summarize src/app.py. " * 60}])
    try:
        outcome = await summarize(
            request, candidates=[Candidate.from_spec(spec)], validate=lambda text: None,
            deadline_s=10, providers=pool,
            retry=RetryPolicy(backoff_initial_s=0.01, jitter=False))
    finally:
        await pool.aclose()
    assert outcome.attempts[0].http_attempts == 3
    log = remote.requests(bodies=True)
    assert [r["status"] for r in log] == [503, 503, 200]
    assert all(r["headers"]["x-compactd-purpose"] == "compaction" for r in log)
    assert log[0]["body"]["model"] == "gpt-sub"
    assert all(r["answered_t"] - r["received_t"] >= 0.05 for r in log)
    remote.reset()
    assert remote.requests() == []


async def test_a_scripted_model_calls_named_tools_with_arguments_read_from_a_result(
        fake: FakeProvider) -> None:
    import anthropic

    result = json.dumps({"hits": [{"checkpoint": "c3-40", "seq": 7}]})
    fake.script(Behaviour(output="tool_calls", times=2, tool_calls=[
                    {"name": "history_read",
                     "arguments": {"checkpoint": {"$from_result": "hits.0.checkpoint"},
                                   "missing": {"$from_result": "hits.5.seq"}, "offset": 0}}]),
                Behaviour(output="text", times=2, text="It was {quote}.",
                          quote=r"ord_[0-9a-f]{8}"))
    client = openai.AsyncOpenAI(api_key="k", base_url=fake.openai_base_url, max_retries=0)
    claude = anthropic.AsyncAnthropic(api_key="k", base_url=fake.anthropic_base_url,
                                      max_retries=0)
    try:
        called = await client.chat.completions.create(model="m", messages=[
            {"role": "user", "content": "go"},
            {"role": "assistant", "tool_calls": [{"id": "a", "type": "function", "function": {
                "name": "history_search", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "a", "content": result}])
        used = await claude.messages.create(model="m", max_tokens=100, messages=[
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "a",
                                               "name": "history_search", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "a",
                                          "content": [{"type": "text", "text": result}]}]}])
        quoted = await client.chat.completions.create(model="m", messages=[
            {"role": "tool", "tool_call_id": "a", "content": "order ord_7f3c9a1e, twice"}])
        unquoted = await client.chat.completions.create(model="m", messages=[
            {"role": "user", "content": "order ord_7f3c9a1e"}])
    finally:
        await client.close()
        await claude.close()
    expected = {"checkpoint": "c3-40", "missing": None, "offset": 0}
    [call] = called.choices[0].message.tool_calls or []
    assert call.function.name == "history_read"  # type: ignore[union-attr]
    assert json.loads(call.function.arguments) == expected  # type: ignore[union-attr]
    assert called.choices[0].finish_reason == "tool_calls"
    [block] = used.content
    assert block.type == "tool_use" and block.name == "history_read"
    assert block.input == expected and used.stop_reason == "tool_use"
    assert quoted.choices[0].message.content == "It was ord_7f3c9a1e."
    # only a tool result is quoted, as only what a tool returned is there to copy
    assert unquoted.choices[0].message.content == "It was ."


def test_the_strict_mode_refuses_a_system_message_after_the_first() -> None:
    """As strict OpenAI-compatible servers do; off by default, as OpenAI itself."""
    late = [{"role": "system", "content": "a"}, {"role": "user", "content": "b"},
            {"role": "system", "content": "c"}]
    first = [{"role": "system", "content": "a"}, {"role": "user", "content": "b"}]
    with FakeProvider() as fake, openai.OpenAI(base_url=fake.openai_base_url, api_key="k",
                                               max_retries=0) as client:
        client.chat.completions.create(model="m", messages=late)  # type: ignore[arg-type]
        fake.strict_system = True
        client.chat.completions.create(model="m", messages=first)  # type: ignore[arg-type]
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model="m", messages=late)  # type: ignore[arg-type]
    assert [r.status for r in fake.requests] == [200, 200, 400]


async def test_a_scripted_text_names_its_request_so_answers_of_one_size_differ(
        fake: FakeProvider) -> None:
    fake.script(Behaviour(output="text", times=2, text="Summary {request}: the work so far."))
    client = openai.AsyncOpenAI(api_key="k", base_url=fake.openai_base_url, max_retries=0)
    try:
        answers = [(await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "summarize"}])
        ).choices[0].message.content or "" for _ in range(2)]
    finally:
        await client.close()
    assert answers[0] != answers[1]
    assert len(answers[0]) == len(answers[1])
    assert all(a.startswith("Summary req_fake_") and "{request}" not in a for a in answers)
