"""A runtime on ``compactd serve`` as the README documents it, with a real worker compacting
and the real OpenAI SDK calling the fake provider in its strict mode (a system message
anywhere but first is a 400, as on strict OpenAI-compatible servers): read the surface (its
ETag), call the model, append the reply, report the usage tagged with the ETag. The report is
recorded until a compaction commits after that version, and the request after a
``durable_context`` compaction holds one system message, first."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from compactd.worker.compaction.render import AUTHORITY_CONTRACT
from tests.support.api import TOKEN_A, bearer, start_api
from tests.support.deerflow import LOADED_SKILL, active_skills, conversation
from tests.support.fake_provider import FakeProvider

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.redis]

RUNTIME_MODEL = "runtime-gpt"
SYSTEM = "You are a careful agent."
WIRE_KEYS = ("role", "content", "tool_calls", "tool_call_id", "name")


def etag_version(response: httpx.Response) -> int:
    return int(response.headers["etag"].strip('W/"'))


def call_model(fake: FakeProvider, surface: list[dict[str, Any]]) -> Any:
    """The runtime's call: its own system prompt, then the surface."""
    messages = [{"role": "system", "content": SYSTEM},
                *({k: m[k] for k in WIRE_KEYS if m.get(k) is not None} for m in surface)]
    with openai.OpenAI(base_url=fake.openai_base_url, api_key="sk-fake", max_retries=0) as llm:
        return llm.chat.completions.create(model=RUNTIME_MODEL, messages=messages)  # type: ignore[call-overload]


def test_the_documented_http_flow_keeps_its_usage_and_sends_one_system_message(
        make_stack, fake: FakeProvider) -> None:  # type: ignore[no-untyped-def]
    fake.strict_system = True
    stack = make_stack(summarization={"trigger": [{"type": "tokens", "value": 10**9}],
                                      "render": "durable_context"})
    url = start_api(stack)
    stack.start_worker()
    api = f"{url}/v1/sessions/flow"
    auth = bearer(TOKEN_A)
    with httpx.Client(headers=auth, timeout=120) as http:
        http.put(api, json={"run_model": "fake-gpt",
                            "envelope": {"system": SYSTEM}}).raise_for_status()
        http.post(f"{api}/messages", json={
            "format": "langchain",
            "messages": [m.model_dump() for m in conversation()]}).raise_for_status()

        read = http.get(f"{api}/surface")
        built_on = etag_version(read)
        response = call_model(fake, read.json()["messages"])
        http.post(f"{api}/messages", json={"messages": [
            {"role": "assistant", "content": response.choices[0].message.content}]}
                  ).raise_for_status()
        usage = http.post(f"{api}/usage", json={
            "input_tokens": response.usage.prompt_tokens,
            "output_tokens": response.usage.completion_tokens,
            "surface_version": built_on}).json()
        assert usage["applied"] is True, usage
        assert usage["reported_input_tokens"] == response.usage.prompt_tokens

        run = http.post(f"{api}/compact", json={"force": True, "wait": True, "timeout_s": 90})
        assert run.status_code == 200 and run.json()["outcome"] == "committed", run.text
        stale = http.post(f"{api}/usage", json={
            "input_tokens": response.usage.prompt_tokens, "surface_version": built_on}).json()
        assert stale["applied"] is False and stale["reported_input_tokens"] is None

        read = http.get(f"{api}/surface", headers={"If-None-Match": read.headers["etag"]})
        assert read.status_code == 200
        assert active_skills(read.json()) == [LOADED_SKILL]
        response = call_model(fake, read.json()["messages"])  # a 400 if a system came late
        body = fake.requests_for(model=RUNTIME_MODEL)[-1].body
        assert body is not None
        assert [i for i, m in enumerate(body["messages"]) if m["role"] == "system"] == [0]
        assert "<durable_context_data>" in json.dumps(body)
        assert json.dumps(body).count("never as instructions") == 1
        [data] = [m for m in body["messages"] if "<durable_context_data>" in json.dumps(m)]
        assert data["role"] == "user" and AUTHORITY_CONTRACT in json.dumps(data)
        usage = http.post(f"{api}/usage", json={
            "input_tokens": response.usage.prompt_tokens, "response_appended": False,
            "surface_version": etag_version(read)}).json()
        assert usage["applied"] is True, usage
    assert [r.status for r in fake.requests_for(model=RUNTIME_MODEL)] == [200, 200]
