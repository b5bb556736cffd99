"""The fallback through the real openai and anthropic SDKs, over HTTP, against the fake provider.

Every scenario of issue 4's acceptance list, checked twice: by what ``summarize`` reports, and by
what the fake provider's request log says was actually sent.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import Iterator
from typing import Any

import pytest

from compactd.scheduler.samples import coding_session
from compactd.storage.messages import Message, parse_openai
from compactd.storage.tokens import counter_for
from compactd.worker.compaction.policy import Policy
from compactd.worker.compaction.sharing import CacheHints
from compactd.worker.compaction.validation import missing_sections, validate_summary
from compactd.worker.llm.candidates import Availability, Candidate, candidate_order
from compactd.worker.llm.fallback import RetryPolicy, SummaryFailed, SummaryRequest, summarize
from compactd.worker.llm.pool import ProviderPool
from compactd.worker.settings import ModelSpec
from tests.support.fake_provider import Behaviour, FakeProvider

API_KEY = "sk-test-DO-NOT-LOG-4242"
KEY_ENV = "COMPACTD_TEST_FAKE_KEY"
PROMPT_MARKER = "PROMPT-TEXT-MARKER-7731"
FAST = RetryPolicy(max_attempts=4, candidate_budget_s=10, retry_after_cap_s=0.3,
                   backoff_initial_s=0.01, backoff_max_s=0.05, jitter=False)
COUNTER = counter_for(None)
# A long agent request's messages: a coding session's turns and tool results.
LONG_REQUEST_MESSAGES = 5_000


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeProvider]:
    with FakeProvider() as provider:
        yield provider


@pytest.fixture(autouse=True)
def clean(fake: FakeProvider) -> None:
    fake.reset()
    fake.latency_s = 0.0


@pytest.fixture
async def pool() -> Any:
    providers = ProviderPool(env={KEY_ENV: API_KEY}, availability=Availability(ttl_s=300))
    yield providers
    await providers.aclose()


def spec(fake: FakeProvider, name: str, api: str = "openai", **kw: Any) -> ModelSpec:
    base_url = fake.anthropic_base_url if api == "anthropic" else fake.openai_base_url
    return ModelSpec(name=name, provider=api, model=f"{name}-model", base_url=base_url,  # type: ignore[arg-type]
                     api_key_env=KEY_ENV, **kw)


def candidates(*specs: ModelSpec, local: bool = False) -> list[Candidate]:
    out = [Candidate.from_spec(s) for s in specs]
    return [*out, Candidate.local()] if local else out


def request(steps: int = 12, seed: int = 5, max_tokens: int = 600) -> SummaryRequest:
    sample = coding_session(steps=steps, seed=seed)
    messages = [parse_openai(m) for m in sample.messages]
    return SummaryRequest.of(
        [{"role": "system", "content": f"Summarize in eight sections. {PROMPT_MARKER}"},
         {"role": "user", "content": render(messages)}],
        messages=messages, max_tokens=max_tokens)


def render(messages: list[Message]) -> str:
    """The messages as a prompt shows them: every field, tool calls included."""
    return "\n".join(json.dumps(m.to_openai(), ensure_ascii=False) for m in messages)


def shrinks(req: SummaryRequest) -> Any:
    """The policy's validation, reduced to what these tests need: strictly fewer tokens."""
    replaced = sum(COUNTER.count_message(m) for m in req.messages)

    def validate(text: str) -> str | None:
        tokens = COUNTER.count_text(text)
        return None if tokens < replaced else f"{tokens} tokens do not shrink {replaced}"
    return validate


async def run(req: SummaryRequest, cands: list[Candidate], pool: ProviderPool,
              deadline_s: float = 20, **kw: Any) -> Any:
    return await summarize(req, candidates=cands, validate=shrinks(req), deadline_s=deadline_s,
                           providers=pool, retry=kw.pop("retry", FAST), **kw)


# --------------------------------------------------------------------------------------------


async def test_ordered_fallback_configured_then_run_model_then_local(
        fake: FakeProvider, pool: ProviderPool) -> None:
    models = [spec(fake, "summary"), spec(fake, "run", "anthropic"), spec(fake, "other")]
    order = candidate_order(run_model="run", summary_model="summary", models=models,
                            default_model=None, local_fallback=True)
    assert [c.name for c in order] == ["summary", "run", "local"]
    fake.script(Behaviour(model="summary-model", status=500, times=-1),
                Behaviour(model="run-model", status=404))
    req = request()
    outcome = await run(req, order, pool)
    assert outcome.candidate.name == "local" and outcome.model == "local"
    assert [(a.candidate, a.kind, a.http_attempts) for a in outcome.attempts] == [
        ("summary", "server", 4), ("run", "not_found", 1), ("local", None, 0)]
    assert [r.model for r in fake.requests] == ["summary-model"] * 4 + ["run-model"]
    # The local summary is the eight sections and keeps what the tool results named.
    assert outcome.text.startswith("## Primary Request and Intent")


async def test_the_first_healthy_candidate_writes_and_records_usage(
        fake: FakeProvider, pool: ProviderPool) -> None:
    fake.script(Behaviour(model="claude-model", cached_tokens=40))
    req = request()
    outcome = await run(req, candidates(spec(fake, "claude", "anthropic"), local=True), pool)
    assert outcome.candidate.name == "claude" and outcome.model == "claude-model"
    assert outcome.usage.output_tokens and outcome.usage.cached_tokens == 40
    assert outcome.usage.input_tokens and outcome.usage.input_tokens > 40
    (record,) = fake.requests
    assert outcome.request_id == f"req_fake_{record.n:06d}"
    assert outcome.failures == () and outcome.attempts[0].ok


async def test_an_auth_error_moves_on_without_a_retry(fake: FakeProvider,
                                                      pool: ProviderPool) -> None:
    fake.script(Behaviour(model="a-model", status=401))
    req = request()
    outcome = await run(req, candidates(spec(fake, "a"), spec(fake, "b", "anthropic")), pool)
    assert outcome.candidate.name == "b"
    assert [(a.candidate, a.kind, a.http_attempts, a.status) for a in outcome.attempts] == [
        ("a", "auth", 1, 401), ("b", None, 1, None)]
    assert len(fake.requests_for(model="a-model")) == 1
    # A bad key does not fix itself: the next compaction does not call it again.
    fake.reset()
    again = await run(req, candidates(spec(fake, "a"), spec(fake, "b", "anthropic")), pool)
    assert [(a.candidate, a.kind) for a in again.attempts] == [("a", "unavailable"), ("b", None)]
    assert fake.requests_for(model="a-model") == []


@pytest.mark.timed
async def test_a_call_carrying_a_long_request_is_sent_as_it_is_without_delay(
        fake: FakeProvider, pool: ProviderPool) -> None:
    """A summary call sharing the agent's cache carries the runtime's whole request, often
    thousands of messages: they reach the provider byte for byte (with the key and the cache
    key), and building the request takes a small part of a model call's time."""
    fake.script(Behaviour(model="long-model", keep_body=True, times=-1))
    chat = [{"role": "system", "content": f"Summarize. {PROMPT_MARKER}"},
            *({"role": "user" if i % 2 else "assistant", "content": f"step {i}: edited parser.py"}
              for i in range(LONG_REQUEST_MESSAGES)),
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": "call_1", "type": "function",
                "function": {"name": "read_file", "arguments": '{"path": "parser.py"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "def parse(): ..."}]
    tools = [{"type": "function", "function": {"name": "read_file", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}}}}}]
    req = SummaryRequest.of(chat, max_tokens=300, tools=tools,
                            cache=CacheHints(prompt_cache_key="agent-7"))
    cands = candidates(spec(fake, "long"))

    async def call(chat_req: SummaryRequest) -> Any:
        return await summarize(chat_req, candidates=cands, validate=lambda _text: None,
                               deadline_s=20, providers=pool, retry=FAST)

    # A first short call builds the client (the SDK's import) and opens its connection.
    await call(SummaryRequest.of(chat[:2], max_tokens=300))
    started = time.monotonic()
    outcome = await call(req)
    elapsed = time.monotonic() - started
    assert outcome.candidate.name == "long" and outcome.attempts[0].http_attempts == 1
    _, record = fake.requests
    assert record.body is not None
    assert record.body["messages"] == chat and record.body["tools"] == tools
    assert record.body["prompt_cache_key"] == "agent-7"
    assert record.headers["authorization"] == f"Bearer {API_KEY}"
    # The SDK's own request transform took seconds for this many messages.
    assert elapsed < 1.0, elapsed


@pytest.mark.timed
@pytest.mark.parametrize("api", ["openai", "anthropic"])
async def test_429_with_retry_after_waits_capped_then_succeeds(
        fake: FakeProvider, pool: ProviderPool, api: str) -> None:
    # A first call builds the client: the SDK's import takes seconds at load, and the bound
    # below is on the retry's wait.
    await run(request(), candidates(spec(fake, "r", api)), pool)
    fake.reset()
    fake.script(Behaviour(model="r-model", status=429, retry_after=30))
    started = time.monotonic()
    outcome = await run(request(), candidates(spec(fake, "r", api)), pool)
    elapsed = time.monotonic() - started
    assert outcome.candidate.name == "r" and outcome.attempts[0].http_attempts == 2
    first, second = fake.requests
    waited = second.received_t - first.received_t
    assert 0.3 <= waited < 1.5  # Retry-After said 30 s; the cap is 0.3 s
    assert elapsed < 3


@pytest.mark.parametrize(("api", "status"), [("openai", 503), ("anthropic", 503),
                                             ("anthropic", 529), ("openai", 500)])
async def test_three_transient_errors_then_success_within_one_candidate(
        fake: FakeProvider, pool: ProviderPool, api: str, status: int) -> None:
    fake.script(Behaviour(model="t-model", status=status, times=3))
    outcome = await run(request(), candidates(spec(fake, "t", api), local=True), pool)
    assert outcome.candidate.name == "t"
    assert [(a.candidate, a.kind, a.http_attempts) for a in outcome.attempts] == [
        ("t", None, 4)]
    assert [r.status for r in fake.requests] == [status, status, status, 200]


async def test_no_doubled_retries(fake: FakeProvider, pool: ProviderPool) -> None:
    """SDK retries are off: each tenacity attempt is exactly one HTTP request."""
    fake.script(Behaviour(model="x-model", status=503, times=-1),
                Behaviour(model="y-model", status=529, times=-1),
                Behaviour(model="z-model", status=429, retry_after=0, times=2))
    outcome = await run(request(), candidates(spec(fake, "x"), spec(fake, "y", "anthropic"),
                                              spec(fake, "z")), pool)
    assert outcome.candidate.name == "z"
    sent = sum(a.http_attempts for a in outcome.attempts)
    assert sent == len(fake.requests) == 4 + 4 + 3
    assert {r.header("x-stainless-retry-count") for r in fake.requests} == {"0"}


async def test_whitespace_only_output_falls_through_to_the_second(
        fake: FakeProvider, pool: ProviderPool) -> None:
    fake.script(Behaviour(model="w-model", output="whitespace"))
    outcome = await run(request(), candidates(spec(fake, "w"), spec(fake, "s", "anthropic")),
                        pool)
    assert outcome.candidate.name == "s"
    assert [(a.candidate, a.kind) for a in outcome.attempts] == [("w", "empty"), ("s", None)]
    assert outcome.text.strip() == outcome.text and outcome.text


async def test_non_shrinking_output_is_refused(fake: FakeProvider, pool: ProviderPool) -> None:
    fake.script(Behaviour(model="echo-model", output="echo"))
    outcome = await run(request(), candidates(spec(fake, "echo"), local=True), pool)
    assert outcome.candidate.name == "local"
    refused = outcome.attempts[0]
    assert (refused.candidate, refused.kind, refused.http_attempts) == ("echo", "refused", 1)
    assert "do not shrink" in refused.reason


@pytest.mark.parametrize(("output", "api", "kind"), [
    ("tool_calls", "openai", "non_text"), ("tool_calls", "anthropic", "non_text"),
    ("reasoning_only", "openai", "non_text"), ("reasoning_only", "anthropic", "non_text"),
    ("image", "anthropic", "non_text"), ("refusal", "openai", "refused"),
    ("refusal", "anthropic", "refused"), ("content_filter", "openai", "refused"),
    ("truncated", "openai", "truncated"), ("truncated", "anthropic", "truncated")])
async def test_an_answer_refused_as_it_is_read_is_that_candidates_failure_and_keeps_its_usage(
        fake: FakeProvider, pool: ProviderPool, output: str, api: str, kind: str) -> None:
    fake.script(Behaviour(model="n-model", output=output))
    outcome = await run(request(), candidates(spec(fake, "n", api), local=True), pool)
    assert [(a.candidate, a.kind) for a in outcome.attempts] == [("n", kind), ("local", None)]
    # The provider billed the answer: its usage is the attempt's, as it reported it.
    [billed] = fake.requests
    usage = outcome.attempts[0].usage
    assert usage is not None and billed.input_tokens and billed.output_tokens
    assert (usage.input_tokens, usage.output_tokens) == (billed.input_tokens,
                                                         billed.output_tokens)


async def test_malformed_json_moves_on(fake: FakeProvider, pool: ProviderPool) -> None:
    fake.script(Behaviour(model="m-model", output="malformed"))
    outcome = await run(request(), candidates(spec(fake, "m"), local=True), pool)
    assert [(a.candidate, a.kind, a.http_attempts) for a in outcome.attempts] == [
        ("m", "malformed", 1), ("local", None, 0)]


@pytest.mark.timed
async def test_a_hanging_candidate_does_not_pass_the_overall_deadline(
        fake: FakeProvider, pool: ProviderPool) -> None:
    fake.script(Behaviour(model="h-model", hang=True, times=-1))
    hanging = spec(fake, "h", timeout_s=600)  # its own timeout would never save us
    patient = RetryPolicy(candidate_budget_s=600, backoff_initial_s=0.01, jitter=False)
    # The clients are built first: the SDK's import takes seconds at load, and the bound below
    # is on the deadline.
    for candidate in candidates(hanging, spec(fake, "never")):
        pool.get(candidate)
    started = time.monotonic()
    outcome = await run(request(), candidates(hanging, spec(fake, "never"), local=True), pool,
                        deadline_s=1.0, retry=patient)
    elapsed = time.monotonic() - started
    assert 1.0 <= elapsed < 2.0
    # The remote candidates end at the deadline; local, which makes no call, still writes.
    assert [(a.candidate, a.kind) for a in outcome.attempts] == [
        ("h", "deadline"), ("never", "deadline"), ("local", None)]
    assert fake.requests_for(model="never-model") == []

    started = time.monotonic()
    with pytest.raises(SummaryFailed) as failed:
        await run(request(), candidates(hanging), pool, deadline_s=0.5, retry=patient)
    assert time.monotonic() - started < 1.5
    assert [a.kind for a in failed.value.attempts] == ["deadline"]


async def test_a_slow_candidate_is_cut_by_its_budget_and_the_next_one_runs(
        fake: FakeProvider, pool: ProviderPool) -> None:
    fake.script(Behaviour(model="slow-model", hang=True, times=-1))
    budget = RetryPolicy(candidate_budget_s=0.5, backoff_initial_s=0.01, jitter=False)
    outcome = await run(request(), candidates(spec(fake, "slow"), spec(fake, "quick")), pool,
                        deadline_s=10, retry=budget)
    assert outcome.candidate.name == "quick"
    assert outcome.attempts[0].kind == "timeout"
    assert "budget" in outcome.attempts[0].reason


@pytest.mark.parametrize("api", ["openai", "anthropic"])
async def test_a_request_timeout_is_retried(fake: FakeProvider, pool: ProviderPool,
                                            api: str) -> None:
    fake.script(Behaviour(model="rt-model", latency_s=2.0))
    outcome = await run(request(), candidates(spec(fake, "rt", api, timeout_s=0.3)), pool)
    assert [(a.kind, a.http_attempts) for a in outcome.attempts] == [(None, 2)]


@pytest.mark.parametrize("api", ["openai", "anthropic"])
async def test_context_length_asks_once_for_a_smaller_request(
        fake: FakeProvider, pool: ProviderPool, api: str) -> None:
    fake.script(Behaviour(model="c-model", status=400, code="context_length_exceeded"))
    big = request(steps=20)
    small = request(steps=6)
    asked: list[str] = []

    async def shrink(req: SummaryRequest, candidate: Candidate) -> SummaryRequest:
        asked.append(candidate.name)
        return small

    outcome = await summarize(big, candidates=candidates(spec(fake, "c", api)),
                              validate=shrinks(big), deadline_s=20, providers=pool, retry=FAST,
                              on_context_length=shrink)
    assert asked == ["c"] and outcome.request is small
    assert [(a.kind, a.http_attempts) for a in outcome.attempts] == [(None, 2)]
    first, second = fake.requests
    assert second.body_bytes < first.body_bytes


async def test_context_length_without_a_smaller_request_moves_on(
        fake: FakeProvider, pool: ProviderPool) -> None:
    fake.script(Behaviour(model="c1-model", status=400, code="context_length_exceeded"),
                Behaviour(model="c2-model", status=400, code="context_length_exceeded"))
    calls: list[str] = []

    def no_smaller(req: SummaryRequest, candidate: Candidate) -> None:
        calls.append(candidate.name)

    req = request()
    outcome = await summarize(req, candidates=candidates(spec(fake, "c1", "anthropic"),
                                                         spec(fake, "c2"), local=True),
                              validate=shrinks(req), deadline_s=20, providers=pool, retry=FAST,
                              on_context_length=no_smaller)
    assert calls == ["c1"]  # asked once per call, not once per candidate
    assert [(a.candidate, a.kind) for a in outcome.attempts] == [
        ("c1", "context_length"), ("c2", "context_length"), ("local", None)]


async def test_every_call_carries_the_attribution_header_and_an_unchanged_body(
        fake: FakeProvider) -> None:
    from compactd.worker.llm.provider import Attribution

    pool = ProviderPool(env={KEY_ENV: API_KEY},
                        attribution=Attribution("x-team-purpose", "nightly-compaction"))
    try:
        req = request(max_tokens=321)
        for name, api in (("h1", "openai"), ("h2", "anthropic")):
            await run(req, candidates(spec(fake, name, api)), pool)
    finally:
        await pool.aclose()
    openai_call, anthropic_call = fake.requests
    for record in fake.requests:
        assert record.header("x-team-purpose") == "nightly-compaction"
        assert record.max_tokens == 321
        assert record.body is not None and "nightly-compaction" not in str(record.body)
    assert openai_call.body is not None and anthropic_call.body is not None
    assert openai_call.body["messages"] == [dict(m) for m in req.chat]
    assert "max_completion_tokens" in openai_call.body  # OpenAI's current name for the cap
    assert anthropic_call.body["system"] == req.chat[0]["content"]
    assert anthropic_call.body["messages"] == [dict(req.chat[1])]


async def test_openai_compatible_uses_max_tokens_and_the_spec_cap(
        fake: FakeProvider, pool: ProviderPool) -> None:
    compat = ModelSpec(name="vllm", provider="openai-compatible", model="llama-3",
                       base_url=fake.openai_base_url, max_output_tokens=128)
    await run(request(max_tokens=600), candidates(compat), pool)
    (record,) = fake.requests
    assert record.body is not None and record.body["max_tokens"] == 128
    assert "max_completion_tokens" not in record.body


async def test_an_anthropic_model_caps_its_output_at_the_spec_cap(
        fake: FakeProvider, pool: ProviderPool) -> None:
    await run(request(max_tokens=600),
              candidates(spec(fake, "capped", "anthropic", max_output_tokens=128)), pool)
    (record,) = fake.requests
    assert record.body is not None and record.body["max_tokens"] == 128


async def test_all_candidates_failing_raises_with_every_attempt(
        fake: FakeProvider, pool: ProviderPool) -> None:
    fake.script(Behaviour(model="f1-model", status=403),
                Behaviour(model="f2-model", status=400))
    missing = ModelSpec(name="nokey", provider="anthropic", api_key_env="COMPACTD_TEST_NONE")
    with pytest.raises(SummaryFailed) as failed:
        await run(request(), candidates(spec(fake, "f1"), missing, spec(fake, "f2")), pool)
    assert [(a.candidate, a.kind) for a in failed.value.attempts] == [
        ("f1", "auth"), ("nokey", "unavailable"), ("f2", "bad_request")]
    assert "f1=auth" in str(failed.value)


async def test_connection_errors_are_retried_then_move_on(pool: ProviderPool) -> None:
    dead = ModelSpec(name="dead", provider="openai-compatible", model="x",
                     base_url="http://127.0.0.1:9/v1", timeout_s=1)
    req = request()
    outcome = await run(req, [Candidate.from_spec(dead), Candidate.local()], pool)
    assert [(a.candidate, a.kind, a.http_attempts) for a in outcome.attempts] == [
        ("dead", "connection", 4), ("local", None, 0)]


@pytest.mark.parametrize("api", ["openai", "anthropic"])
@pytest.mark.parametrize(("server", "kind"), [("hangs up", "connection"),
                                              ("never answers", "timeout")])
async def test_a_dropped_connection_is_a_connection_error_and_silence_a_timeout(
        pool: ProviderPool, api: str, server: str, kind: str) -> None:
    """The SDKs' aiohttp transport reports every dropped connection as a connect timeout; a
    server that closes the connection on a request is still a connection failure, and only a
    server that keeps silent past the read timeout is a timeout."""
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        if server == "never answers":
            await asyncio.sleep(5)
        writer.close()

    listener = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    base_url = f"http://127.0.0.1:{port}" + ("/v1" if api == "openai" else "")
    lost = ModelSpec(name="lost", provider=api, model="x", base_url=base_url,  # type: ignore[arg-type]
                     api_key_env=KEY_ENV, timeout_s=0.3)
    try:
        outcome = await run(request(), [Candidate.from_spec(lost), Candidate.local()], pool,
                            retry=dataclasses.replace(FAST, max_attempts=2))
    finally:
        listener.close()
    assert [(a.candidate, a.kind) for a in outcome.attempts] == [("lost", kind), ("local", None)]


async def test_logs_of_a_full_fallback_carry_no_key_body_or_prompt(
        fake: FakeProvider, pool: ProviderPool, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)  # every logger, SDKs and HTTP stack included
    fake.script(Behaviour(model="l1-model", status=401),
                Behaviour(model="l2-model", status=429, retry_after=0),
                Behaviour(model="l2-model", status=400, code="context_length_exceeded"),
                Behaviour(model="l3-model", output="echo"),
                Behaviour(model="l4-model", output="whitespace"),
                Behaviour(model="l5-model", status=503, times=-1))
    req = request()
    outcome = await run(req, candidates(spec(fake, "l1"), spec(fake, "l2", "anthropic"),
                                        spec(fake, "l3"), spec(fake, "l4", "anthropic"),
                                        spec(fake, "l5"), spec(fake, "l6", "anthropic")),
                        pool)
    assert outcome.candidate.name == "l6"
    assert [a.kind for a in outcome.attempts] == [
        "auth", "context_length", "refused", "empty", "server", None]
    captured = "\n".join(
        f"{r.getMessage()} {r.__dict__}" for r in caplog.records)
    assert caplog.records
    forbidden = [API_KEY, PROMPT_MARKER, "Incorrect API key provided",  # a response body
                 "prompt is too long: 210000",                            # another one
                 "summarized by l6-model",                                # a summary body
                 '"content": "Running the tests."']                       # the prompt again
    for secret in forbidden:
        assert secret not in captured, secret
    assert any(getattr(r, "action", "") == "llm.attempt" for r in caplog.records)


@pytest.mark.timed
async def test_many_summaries_in_flight_against_one_fake(fake: FakeProvider) -> None:
    """The fake stays cheap with hundreds of requests in flight (the benchmark relies on it)."""
    fake.latency_s = 0.5
    pool = ProviderPool(env={KEY_ENV: API_KEY})
    req = request(steps=4)
    specs = [spec(fake, f"p{i}", "openai" if i % 2 else "anthropic") for i in range(2)]
    try:
        # Both clients are built first: the SDKs' imports take seconds at load, and the bound
        # below is on the requests in flight.
        for candidate in candidates(*specs):
            pool.get(candidate)
        started = time.monotonic()
        outcomes = await asyncio.gather(*(
            run(req, candidates(specs[i % 2]), pool) for i in range(200)))
        elapsed = time.monotonic() - started
    finally:
        await pool.aclose()
    assert all(o.attempts[-1].ok for o in outcomes)
    assert len(fake.requests) == 200
    assert elapsed < 10.0, elapsed  # serially it would take 100 s


# --------------------------------------------------------------------------------------------
# what a summary may be: not cut off, and (with the default instruction) in its sections


@pytest.mark.parametrize(("api", "stop"), [("openai", "length"), ("anthropic", "max_tokens")])
async def test_a_summary_cut_off_at_its_cap_is_that_candidates_failure(
        fake: FakeProvider, pool: ProviderPool, api: str, stop: str) -> None:
    fake.script(Behaviour(model="cut-model", output="truncated"))
    other = "anthropic" if api == "openai" else "openai"
    outcome = await run(request(), candidates(spec(fake, "cut", api), spec(fake, "whole", other),
                                              local=True), pool)
    assert [(a.candidate, a.kind, a.http_attempts) for a in outcome.attempts] == [
        ("cut", "truncated", 1), ("whole", None, 1)]
    assert stop in outcome.attempts[0].reason and "600" in outcome.attempts[0].reason
    assert missing_sections(outcome.text) == []  # the whole summary, its last section too
    assert [r.model for r in fake.requests] == ["cut-model", "whole-model"]  # not retried


@pytest.mark.parametrize("api", ["openai", "anthropic"])
async def test_a_summary_without_its_sections_is_refused_with_the_default_prompt(
        fake: FakeProvider, pool: ProviderPool, api: str) -> None:
    fake.script(Behaviour(model="prose-model", output="text",
                          text="We fixed the parser in src/parse.py and the tests pass."),
                Behaviour(model="half-model", output="text",
                          text="## Primary Request and Intent\nFix the parser.\n"
                               "## Key Technical Concepts\n(none)"))

    def default(text: str) -> str | None:
        return validate_summary(text, replaced_tokens=None, policy=Policy(), run_model=None)

    outcome = await summarize(
        request(), candidates=candidates(spec(fake, "prose", api), spec(fake, "half", api),
                                         spec(fake, "sections", api)),
        validate=default, deadline_s=20, providers=pool, retry=FAST)
    assert [(a.candidate, a.kind) for a in outcome.attempts] == [
        ("prose", "refused"), ("half", "refused"), ("sections", None)]
    assert "lacks 8 of the 8 section headings" in outcome.attempts[0].reason
    assert "lacks 6 of the 8" in outcome.attempts[1].reason
    assert "Files and Code" in outcome.attempts[1].reason
    # A custom prompt sets its own format: the same prose is a summary there.
    fake.script(Behaviour(model="prose-model", output="text", text="We fixed the parser."))
    custom = Policy(summary_prompt="Summarize briefly.\n{messages}")
    outcome = await summarize(
        request(), candidates=candidates(spec(fake, "prose", api)),
        validate=lambda t: validate_summary(t, replaced_tokens=None, policy=custom,
                                            run_model=None),
        deadline_s=20, providers=pool, retry=FAST)
    assert outcome.text == "We fixed the parser."


@pytest.mark.parametrize("api", ["openai", "anthropic"])
async def test_a_requests_tools_are_sent_and_the_fake_refuses_a_wrong_prefix(
        fake: FakeProvider, pool: ProviderPool, api: str) -> None:
    schema = {"type": "object", "properties": {"cmd": {"type": "string"}}}
    tool = {"type": "function", "function": {"name": "run", "parameters": schema}}
    prefix = ({"tools": [tool], "messages": [{"role": "system", "content": "S"}]}
              if api == "openai" else
              {"system": "S", "tools": [{"name": "run", "input_schema": schema}]})
    fake.script(Behaviour(model="p-model", expect_prefix=prefix, times=2))
    chat = [{"role": "system", "content": "S"}, {"role": "user", "content": "U " * 400}]
    without = SummaryRequest.of(chat)
    with pytest.raises(SummaryFailed) as failed:
        await run(without, candidates(spec(fake, "p", api)), pool)
    assert [a.kind for a in failed.value.attempts] == ["bad_request"]
    with_tools = SummaryRequest.of(chat, tools=[tool])
    outcome = await summarize(with_tools, candidates=candidates(spec(fake, "p", api)),
                              validate=lambda _text: None, deadline_s=20, providers=pool,
                              retry=FAST)
    assert outcome.attempts[0].ok
    assert [(r.prefix_ok, r.status) for r in fake.requests] == [(False, 400), (True, 200)]
