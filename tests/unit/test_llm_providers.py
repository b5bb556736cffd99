"""Chat turns in the Messages API's shape: the Anthropic adapter's conversion of the OpenAI wire
turns a replayed range is made of, and tool schemas both ways (the replay test in
tests/acceptance/test_summary_output.py sends them through both SDKs to the fake provider)."""

from __future__ import annotations

import pytest

from compactd.worker.llm.anthropic_provider import anthropic_messages, anthropic_tool
from compactd.worker.llm.openai_provider import openai_tool

CALL = {"id": "c1", "type": "function", "function": {"name": "run", "arguments": '{"cmd": "ls"}'}}
USE = {"type": "tool_use", "id": "c1", "name": "run", "input": {"cmd": "ls"}}


@pytest.mark.parametrize(
    ("chat", "system", "messages"),
    [
        # the default prompt: a system instruction and one user turn, as before
        ([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}], "S",
         [{"role": "user", "content": "U"}]),
        # an assistant's calls after its text; None and empty text leave no text block
        ([{"role": "assistant", "content": "looking", "tool_calls": [CALL]}], "",
         [{"role": "assistant", "content": [{"type": "text", "text": "looking"}, USE]}]),
        ([{"role": "assistant", "content": None, "tool_calls": [CALL]}], "",
         [{"role": "assistant", "content": [USE]}]),
        ([{"role": "assistant", "content": "", "tool_calls": [CALL]}], "",
         [{"role": "assistant", "content": [USE]}]),
        # adjacent tool results are one user turn; a result without content has none
        ([{"role": "tool", "tool_call_id": "a", "content": "1"},
          {"role": "tool", "tool_call_id": "b", "content": None},
          {"role": "user", "content": "next"}], "",
         [{"role": "user", "content": [
             {"type": "tool_result", "tool_use_id": "a", "content": "1"},
             {"type": "tool_result", "tool_use_id": "b"}]},
          {"role": "user", "content": "next"}]),
        # consecutive user turns stay apart: the API joins them, and the prefix stays exact
        ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], "",
         [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]),
        # images by URL and inline; blocks already in this API's shape pass unchanged
        ([{"role": "user", "content": [
            {"type": "text", "text": "see"},
            {"type": "image_url", "image_url": {"url": "https://x.test/a.png"}},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
            {"type": "document", "source": {"type": "text", "data": "d"}}]}], "",
         [{"role": "user", "content": [
             {"type": "text", "text": "see"},
             {"type": "image", "source": {"type": "url", "url": "https://x.test/a.png"}},
             {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                          "data": "AAAA"}},
             {"type": "document", "source": {"type": "text", "data": "d"}}]}]),
        # arguments that are not a JSON object are kept, as text
        ([{"role": "assistant", "content": None, "tool_calls": [
            {"id": "c2", "type": "function", "function": {"name": "f", "arguments": "[1"}}]}],
         "", [{"role": "assistant", "content": [
             {"type": "tool_use", "id": "c2", "name": "f", "input": {"arguments": "[1"}}]}]),
        # a turn with nothing in it is left out (the API refuses empty content)
        ([{"role": "user", "content": "u"}, {"role": "assistant", "content": None}], "",
         [{"role": "user", "content": "u"}]),
    ],
)
def test_anthropic_messages(chat, system, messages):
    assert anthropic_messages(chat) == (system, messages)


def test_tool_schemas_convert_both_ways_and_pass_their_own_shape():
    schema = {"type": "object", "properties": {"cmd": {"type": "string"}}}
    openai = {"type": "function", "function": {"name": "run", "description": "Run it.",
                                               "parameters": schema}}
    anthropic = {"name": "run", "description": "Run it.", "input_schema": schema}
    assert anthropic_tool(openai) == anthropic and openai_tool(anthropic) == openai
    assert anthropic_tool(anthropic) == anthropic and openai_tool(openai) == openai
    bare = {"type": "function", "function": {"name": "now"}}
    assert anthropic_tool(bare) == {"name": "now",
                                    "input_schema": {"type": "object", "properties": {}}}
