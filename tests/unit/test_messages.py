from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from compactd.storage.errors import InvalidMessage
from compactd.storage.messages import (
    BatchLinks,
    Message,
    ToolLinks,
    from_payload,
    parse,
    parse_anthropic,
    parse_langchain,
    parse_openai,
    read_jsonl,
)


def call(cid: str, name: str = "bash", args: str = "{}") -> dict:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}


def test_openai_shapes_round_trip() -> None:
    raw = {"role": "assistant", "content": "checking",
           "tool_calls": [call("c1", "grep", '{"q":1}')], "meta": {"pinned": True, "free": [1, 2]}}
    m = parse_openai(raw)
    assert m.tool_calls[0].name == "grep" and m.tool_calls[0].arguments == '{"q":1}'
    assert m.to_openai() == {**raw, "tool_calls": [call("c1", "grep", '{"q":1}')]}
    assert from_payload(m.to_payload()) == m


def test_content_blocks_keep_images_and_unknown_blocks_in_order() -> None:
    blocks = [{"type": "text", "text": "see"}, {"type": "image_url", "image_url": {"url": "x"}},
              {"type": "audio", "data": "zz"}, "plain"]
    m = parse_openai({"role": "user", "content": blocks})
    assert isinstance(m.content, list)
    assert [b["type"] for b in m.content] == ["text", "image_url", "audio", "text"]
    assert m.text == "see\nplain"


def test_arguments_given_as_object_become_json_text() -> None:
    m = parse_openai({"role": "assistant", "content": None, "tool_calls": [
        {"id": "a", "function": {"name": "f", "arguments": {"k": "é"}}}]})
    assert json.loads(m.tool_calls[0].arguments) == {"k": "é"}


def test_openai_passthrough_fields_are_kept_in_meta() -> None:
    m = parse_openai({"role": "assistant", "content": "x", "refusal": None,
                      "reasoning_content": "thinking"})
    assert m.meta == {"reasoning_content": "thinking"}


@pytest.mark.parametrize(("raw", "field", "reason"), [
    ({"role": "robot", "content": "x"}, "role", "unknown role"),
    ({"content": "x"}, "role", "unknown role"),
    ({"role": "tool", "content": "x"}, "tool_call_id", "needs the id"),
    ({"role": "user", "content": "x", "tool_call_id": "a"}, "tool_call_id", "only tool results"),
    ({"role": "user", "content": "x", "tool_calls": [call("a")]}, "tool_calls", "only assistant"),
    ({"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f"}}]},
     "tool_calls[0].id", "non-empty string id"),
    ({"role": "assistant", "content": None, "tool_calls": [call("a"), call("a")]},
     "tool_calls[1].id", "used twice"),
    ({"role": "user", "content": 5}, "content", "text or a list"),
    ({"role": "user", "content": [{"text": "no type"}]}, "content[0]", "string 'type'"),
    ({"role": "user", "content": "bad \ud800 surrogate"}, "content", "not valid UTF-8"),
    ({"role": "user", "content": [{"type": "text", "text": "\udfff"}]}, "content[0].text",
     "not valid UTF-8"),
    ({"role": "user", "content": "x", "meta": {"k": "\ud800"}}, "meta.k", "not valid UTF-8"),
    ({"role": "user", "content": "x", "meta": 3}, "meta", "must be an object"),
    ({"role": "user", "content": "x", "colour": "red"}, "colour", "unknown field"),
])
def test_openai_rejections_name_the_field(raw: dict, field: str, reason: str) -> None:
    with pytest.raises(InvalidMessage) as err:
        parse_openai(raw)
    assert err.value.field == field
    assert reason in str(err.value)


def test_anthropic_tool_use_and_results() -> None:
    assistant = parse_anthropic({"role": "assistant", "content": [
        {"type": "text", "text": "running"},
        {"type": "tool_use", "id": "tu1", "name": "bash", "input": {"cmd": "ls"}},
        {"type": "tool_use", "id": "tu2", "name": "bash", "input": {"cmd": "pwd"}}]})
    assert len(assistant) == 1
    assert [c.id for c in assistant[0].tool_calls] == ["tu1", "tu2"]
    assert assistant[0].content == [{"type": "text", "text": "running"}]
    user = parse_anthropic({"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "tu1", "content": "a.txt"},
        {"type": "tool_result", "tool_use_id": "tu2", "content": "/repo", "is_error": True},
        {"type": "text", "text": "thanks"}]})
    assert [(m.role, m.tool_call_id) for m in user] == [("tool", "tu1"), ("tool", "tu2"),
                                                        ("user", None)]
    assert user[1].meta == {"is_error": True}


def test_anthropic_rejections() -> None:
    with pytest.raises(InvalidMessage, match="tool_use blocks belong to assistant"):
        parse_anthropic({"role": "user", "content": [{"type": "tool_use", "id": "x", "name": "f"}]})
    with pytest.raises(InvalidMessage) as err:
        parse_anthropic({"role": "tool", "content": "x"})
    assert err.value.field == "role"


def test_langchain_dicts_both_shapes() -> None:
    ai = parse_langchain({"type": "ai", "content": "", "tool_calls": [
        {"id": "t1", "name": "search", "args": {"q": "x"}}]})
    assert ai.role == "assistant" and ai.tool_calls[0].arguments == '{"q":"x"}'
    tool = parse_langchain({"type": "tool", "data": {"content": "r", "tool_call_id": "t1",
                                                     "name": "search", "status": "error"}})
    assert tool.role == "tool" and tool.meta["is_error"] is True
    human = parse_langchain({"type": "human", "content": "hi",
                             "additional_kwargs": {"pinned": True}})
    assert human.role == "user" and human.flag("pinned")
    with pytest.raises(InvalidMessage) as err:
        parse_langchain({"type": "function", "content": "x"})
    assert err.value.field == "type"


def test_parse_unknown_format() -> None:
    with pytest.raises(InvalidMessage, match="unknown format"):
        parse({}, "gemini")


def lines(*objs: object) -> list[bytes]:
    return [o if isinstance(o, bytes) else json.dumps(o).encode() for o in objs]


def test_read_jsonl_skips_blank_lines_and_keeps_line_numbers() -> None:
    out = read_jsonl(lines({"role": "user", "content": "a"}, b"", b"  ",
                           {"role": "assistant", "content": "b"}))
    assert [n for n, _ in out] == [1, 4]


@pytest.mark.parametrize(("data", "line", "reason"), [
    (lines({"role": "user", "content": "a"}, b"{not json"), 2, "invalid JSON"),
    (lines({"role": "user", "content": "a"}, {"role": "bot", "content": "b"}), 2, "unknown role"),
    (lines({"role": "user", "content": "a"}, b'{"role":"user","content":"\xff\xfe"}'), 2,
     "not valid UTF-8"),
    (lines(b'{"role":"user","content":"\\ud800"}'), 1, "not valid UTF-8"),
    (lines([1, 2]), 1, "JSON object"),
])
def test_read_jsonl_errors_name_the_line(data: list[bytes], line: int, reason: str) -> None:
    with pytest.raises(InvalidMessage) as err:
        read_jsonl(data)
    assert err.value.line == line
    assert f"line {line}" in str(err.value) and reason in str(err.value)


def _tool(cid: str) -> Message:
    return parse_openai({"role": "tool", "tool_call_id": cid, "content": "r"})


def _asst(*ids: str) -> Message:
    return parse_openai({"role": "assistant", "content": None,
                         "tool_calls": [call(i) for i in ids]})


@pytest.mark.parametrize(("open_ids", "closed", "batch", "index", "reason"), [
    ((), (), [_tool("x")], 0, "matches no earlier tool call"),
    ((), (), [_asst("a"), _tool("a"), _tool("a")], 2, "already has a result"),
    (("a",), (), [_asst("a")], 0, "reused while its earlier call has no result"),
    ((), ("a",), [_tool("a")], 0, "already has a result"),
    ((), (), [_asst("a"), _asst("a")], 1, "reused while its earlier call has no result"),
    ((), (), [_asst("a", "b"), _tool("a"), _asst("b")], 2, "reused while"),
])
def test_tool_links(open_ids: tuple, closed: tuple, batch: list[Message], index: int,
                    reason: str) -> None:
    with pytest.raises(InvalidMessage) as err:
        ToolLinks(open_ids, closed).check(batch)
    assert err.value.index == index and reason in str(err.value)


@pytest.mark.parametrize(("batch", "index", "reason"), [
    ([_asst("a"), _tool("a"), _tool("a")], 2, "already has a result"),
    ([_asst("a"), _asst("a")], 1, "reused while its earlier call has no result"),
    ([_tool("x"), _tool("x")], 1, "already has a result"),
])
def test_batch_links_check_within_the_batch(batch: list[Message], index: int,
                                            reason: str) -> None:
    with pytest.raises(InvalidMessage) as err:
        BatchLinks(batch)
    assert err.value.index == index and reason in str(err.value)


def test_tool_links_accept_a_valid_session() -> None:
    links = ToolLinks()
    links.check([_asst("a", "b"), _tool("b"), _tool("a")])
    links.check([_asst("c"), _tool("c")])
    assert links.open == set() and links.closed == {"a", "b", "c"}


def test_an_answered_id_may_be_issued_again() -> None:
    """Real transcripts reuse ids sequentially; each result answers the nearest earlier call."""
    links = ToolLinks()
    links.check([_asst("a"), _tool("a"), _asst("a"), _tool("a")])
    assert links.closed == {"a"}
    batch = BatchLinks([_tool("x"), _asst("x"), _tool("x"), _asst("y")])
    assert batch.external == [("x", 0)]
    assert batch.calls == [("x", 1, 2), ("y", 3, None)]


@pytest.mark.parametrize("payload", [
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": None,
     "tool_calls": [["c1", "bash", '{"cmd": "ls"}'], ["c2", "read", "{}"]]},
    {"role": "tool", "content": [{"type": "text", "text": "out"}, {"type": "image_url"}],
     "tool_call_id": "c1", "name": "bash", "meta": {"pruned": True}},
    {"role": "system", "content": "", "meta": {"pinned": True, "n": 2**70}},
])
def test_a_stored_message_is_rebuilt_as_model_construct_would(payload: dict[str, Any]) -> None:
    """from_payload skips model_construct's per-field loop; the result must not differ."""
    from compactd.storage.messages import ToolCall

    rebuilt = from_payload(payload)
    calls = tuple(ToolCall.model_construct(id=c[0], name=c[1], arguments=c[2])
                  for c in payload.get("tool_calls") or ())
    expected = Message.model_construct(
        role=payload["role"], content=payload.get("content"), tool_calls=calls,
        tool_call_id=payload.get("tool_call_id"), name=payload.get("name"),
        meta=dict(payload.get("meta") or {}))
    assert rebuilt == expected and rebuilt.model_fields_set == expected.model_fields_set
    assert [c.model_fields_set for c in rebuilt.tool_calls] == [
        c.model_fields_set for c in expected.tool_calls]
    assert rebuilt.model_dump() == expected.model_dump()
    assert rebuilt.to_payload() == expected.to_payload()
    assert Message.model_validate(rebuilt.model_dump()) == rebuilt
    copy = rebuilt.model_copy(update={"meta": {"pruned": True}})
    assert copy.meta == {"pruned": True} and copy.role == rebuilt.role
    with pytest.raises(ValidationError):
        rebuilt.role = "user"  # frozen, as a validated message is
