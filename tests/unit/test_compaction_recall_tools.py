"""The recall tools' schemas and argument checks (no I/O)."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from compactd.storage.instructions import MAX_INSTRUCTION_CHARS
from compactd.worker.compaction.recall import RecallArgumentError, checkpoint_ref, pruned_ref
from compactd.worker.compaction.recall_tools import (
    MAX_QUERY_BYTES,
    CompactArgs,
    ReadArgs,
    SearchArgs,
    check_read,
    check_search,
    check_tool_call,
    read_result_text,
    search_result_text,
    tool_schemas,
    tools_document,
)


def test_both_forms_define_the_same_three_tools() -> None:
    openai = tool_schemas("openai")
    anthropic = tool_schemas("anthropic")
    names = ["history_search", "history_read", "compact_context"]
    assert [t["function"]["name"] for t in openai] == names
    assert [t["name"] for t in anthropic] == names
    for o, a in zip(openai, anthropic, strict=True):
        assert o["type"] == "function"
        assert o["function"]["parameters"] == a["input_schema"]
        assert o["function"]["description"] == a["description"]
        jsonschema.Draft202012Validator.check_schema(a["input_schema"])
    search = anthropic[0]["input_schema"]
    assert search["required"] == ["query"]
    assert search["properties"]["limit"] | {} == {
        "type": "integer", "minimum": 1, "maximum": 100, "default": 5,
        "description": "Most hits to return."}
    assert anthropic[1]["input_schema"]["required"] == ["checkpoint"]
    assert set(anthropic[1]["input_schema"]["properties"]) == {
        "checkpoint", "offset", "cursor", "budget_tokens"}
    compact = anthropic[2]["input_schema"]
    assert compact["required"] == ["focus"]
    assert compact["properties"]["focus"]["maxLength"] == MAX_INSTRUCTION_CHARS
    assert tools_document() == {"openai": openai, "anthropic": anthropic}
    assert json.loads(json.dumps(tools_document())) == tools_document()  # plain JSON


def test_the_read_description_says_the_cursor_is_how_to_resume() -> None:
    read = tool_schemas("anthropic")[1]
    assert "cursor" in read["description"] and "next offset" not in read["description"]
    properties = read["input_schema"]["properties"]
    assert "exact place to resume" in properties["cursor"]["description"]
    assert "cursor instead" in properties["offset"]["description"]
    assert properties["budget_tokens"] | {} == {
        "type": "integer", "minimum": 64, "maximum": 100_000, "default": 2000,
        "description": "Most tokens one page holds."}


def test_the_schemas_are_fresh_copies() -> None:
    tool_schemas("openai")[0]["function"]["parameters"]["properties"].clear()
    assert "query" in tool_schemas("openai")[0]["function"]["parameters"]["properties"]
    with pytest.raises(ValueError, match="unknown tool form 'gemini'"):
        tool_schemas("gemini")


@pytest.mark.parametrize(("args", "expected"), [
    ({"query": "KeyError"}, SearchArgs("KeyError")),
    ({"query": " x ", "checkpoint": "c1-9", "limit": 100},
     SearchArgs(" x ", checkpoint_ref(1, 9), 100)),
    ({"query": "x", "checkpoint": None, "limit": "7"}, SearchArgs("x", None, 7)),
    ({"query": "é" * (MAX_QUERY_BYTES // 2)}, SearchArgs("é" * (MAX_QUERY_BYTES // 2))),
])
def test_good_search_arguments(args: dict[str, Any], expected: SearchArgs) -> None:
    assert check_search(**args) == expected


@pytest.mark.parametrize(("args", "argument", "says"), [
    ({"query": ""}, "query", "is empty"),
    ({"query": " \n\t"}, "query", "is empty"),
    ({"query": 5}, "query", "must be a string, got int"),
    ({"query": "a\x00b"}, "query", "NUL"),
    ({"query": "x" * 10_000}, "query", "is 10000 bytes; at most 8192"),
    ({"query": "é" * 4097}, "query", "is 8194 bytes"),
    ({"query": "x", "checkpoint": "nope"}, "checkpoint", "is not a checkpoint"),
    ({"query": "x", "limit": 0}, "limit", "between 1 and 100, got 0"),
    ({"query": "x", "limit": 101}, "limit", "between 1 and 100, got 101"),
    ({"query": "x", "limit": -3}, "limit", "got -3"),
    ({"query": "x", "limit": True}, "limit", "must be an integer, got True"),
    ({"query": "x", "limit": 2.5}, "limit", "must be an integer, got 2.5"),
    ({"query": "x", "limit": "٣"}, "limit", "must be an integer"),
    ({"query": "x", "limit": "9" * 100}, "limit", "must be an integer, got str"),
])
def test_bad_search_arguments_name_the_argument(args: dict[str, Any], argument: str,
                                                says: str) -> None:
    with pytest.raises(RecallArgumentError) as caught:
        check_search(**args)
    assert caught.value.argument == argument
    assert str(caught.value).startswith(f"{argument}: ") and says in str(caught.value)


@pytest.mark.parametrize(("args", "expected"), [
    ({"checkpoint": "c12-340"}, ReadArgs(checkpoint_ref(12, 340))),
    ({"checkpoint": "r57", "offset": 3}, ReadArgs(pruned_ref(57), 3)),
    ({"checkpoint": "c1-1", "offset": "0"}, ReadArgs(checkpoint_ref(1, 1), 0)),
    ({"checkpoint": "c1-9", "cursor": "hr1.abc"}, ReadArgs(checkpoint_ref(1, 9), 0, "hr1.abc")),
    ({"checkpoint": "c1-9", "offset": 0, "cursor": "hr1.abc", "budget_tokens": "64"},
     ReadArgs(checkpoint_ref(1, 9), 0, "hr1.abc", 64)),
    ({"checkpoint": "c1-9", "cursor": None, "budget_tokens": 100_000},
     ReadArgs(checkpoint_ref(1, 9), 0, None, 100_000)),
])
def test_good_read_arguments(args: dict[str, Any], expected: ReadArgs) -> None:
    assert check_read(**args) == expected


@pytest.mark.parametrize(("args", "argument", "says"), [
    ({"checkpoint": None}, "checkpoint", "is required"),
    ({"checkpoint": "12"}, "checkpoint", "is not a checkpoint"),
    ({"checkpoint": "c1-2", "offset": -1}, "offset", "must be 0 or more, got -1"),
    ({"checkpoint": "c1-2", "offset": "-5"}, "offset", "got -5"),
    ({"checkpoint": "c1-2", "offset": 2**63}, "offset", "at most"),
    ({"checkpoint": "c1-2", "offset": None}, "offset", "must be an integer, got None"),
    ({"checkpoint": "c1-2", "cursor": ""}, "cursor", "is empty"),
    ({"checkpoint": "c1-2", "cursor": 7}, "cursor", "got int"),
    ({"checkpoint": "c1-2", "cursor": "x" * 257}, "cursor", "at most 256"),
    ({"checkpoint": "c1-2", "offset": 3, "cursor": "hr1.abc"}, "cursor", "not both"),
    ({"checkpoint": "c1-2", "budget_tokens": 63}, "budget_tokens", "between 64 and 100000"),
    ({"checkpoint": "c1-2", "budget_tokens": 100_001}, "budget_tokens", "got 100001"),
    ({"checkpoint": "c1-2", "budget_tokens": None}, "budget_tokens", "must be an integer"),
])
def test_bad_read_arguments_name_the_argument(args: dict[str, Any], argument: str,
                                              says: str) -> None:
    with pytest.raises(RecallArgumentError) as caught:
        check_read(**args)
    assert caught.value.argument == argument and says in str(caught.value)


@pytest.mark.parametrize(("name", "arguments", "expected"), [
    ("history_search", '{"query": "BILL-1234", "limit": 3}', SearchArgs("BILL-1234", None, 3)),
    ("history_read", {"checkpoint": "r4"}, ReadArgs(pruned_ref(4))),
])
def test_a_models_tool_call_is_checked(name: str, arguments: Any, expected: Any) -> None:
    assert check_tool_call(name, arguments) == expected


@pytest.mark.parametrize(("name", "arguments", "argument"), [
    ("history_delete", "{}", "name"),
    ("history_search", "{not json", "arguments"),
    ("history_search", "[1]", "arguments"),
    ("history_search", "", "query"),
    ("history_search", {"query": "x", "regex": True}, "regex"),
    ("history_read", {"offset": 1}, "checkpoint"),
])
def test_a_bad_tool_call_names_what_is_wrong(name: str, arguments: Any, argument: str) -> None:
    with pytest.raises(RecallArgumentError) as caught:
        check_tool_call(name, arguments)
    assert caught.value.argument == argument


def _schema_accepts(name: str, arguments: dict[str, Any]) -> bool:
    schema = next(t["input_schema"] for t in tool_schemas("anthropic") if t["name"] == name)
    return jsonschema.Draft202012Validator(schema).is_valid(arguments)


def _checks_accept(name: str, arguments: dict[str, Any]) -> bool:
    try:
        check_tool_call(name, arguments)
    except RecallArgumentError:
        return False
    return True


@settings(max_examples=300, deadline=None)
@given(st.fixed_dictionaries({"query": st.text(alphabet="ab ", max_size=4)},
                             optional={"limit": st.integers(-5, 120),
                                       "checkpoint": st.sampled_from([None, "c1-2", "r3"])}))
def test_the_schema_and_the_checks_agree_on_search(arguments: dict[str, Any]) -> None:
    # The checks add what a schema cannot say (a blank query is empty); nothing else differs.
    blank = not arguments["query"].strip()
    assert _checks_accept("history_search", arguments) == (
        _schema_accepts("history_search", arguments) and not blank)


@settings(max_examples=300, deadline=None)
@given(st.fixed_dictionaries({"checkpoint": st.sampled_from(["c1-2", "r3"])},
                             optional={"offset": st.integers(-5, 2**64),
                                       "cursor": st.sampled_from([None, "", "hr1.x", "y" * 300]),
                                       "budget_tokens": st.integers(0, 200_000)}))
def test_the_schema_and_the_checks_agree_on_read(arguments: dict[str, Any]) -> None:
    # The checks add what a schema cannot say: an offset past the column, offset with cursor.
    in_column = arguments.get("offset", 0) < 2**63
    one_position = arguments.get("cursor") is None or arguments.get("offset", 0) == 0
    assert _checks_accept("history_read", arguments) == (
        _schema_accepts("history_read", arguments) and in_column and one_position)


def test_a_search_result_reads_as_its_json() -> None:
    result = {"hits": [{"checkpoint": "c1-9", "seq": 4, "snippet": "é ERR-1", "exact": True}],
              "scanned": {"messages": 9, "bytes": 900}}
    text = search_result_text(result)
    assert json.loads(text) == result and "é" in text and ", " not in text


def _page(**overrides: Any) -> dict[str, Any]:
    return {"checkpoint": "c1-9", "transcript": "[seq 3 tool]\nERR-1\n\n", "seqs": [3, 4],
            "offset": 2, "next_offset": 4, "cursor": "hr1.abc", "total_messages": 9,
            "tokens": 40, **overrides}


def test_a_read_page_names_what_it_shows_and_how_to_continue() -> None:
    assert read_result_text(_page()) == (
        "[c1-9 replaced 9 messages; this page: seqs 3-4]\n[seq 3 tool]\nERR-1\n\n"
        '[more: history_read(checkpoint="c1-9", cursor="hr1.abc")]')
    last = read_result_text(_page(transcript="cut mid-line", next_offset=None, cursor=None))
    assert last.endswith("cut mid-line\n[end of c1-9]")
    past = read_result_text(_page(transcript="", seqs=[], offset=50, next_offset=None,
                                  cursor=None))
    assert past == "[c1-9 replaced 9 messages; none from offset 50]\n[end of c1-9]"


def test_compact_context_takes_a_bounded_focus() -> None:
    assert check_tool_call("compact_context", {"focus": "keep the schema plan"}) == CompactArgs(
        "keep the schema plan")
    for arguments, reason in [({}, "is required"), ({"focus": "  "}, "is empty"),
                              ({"focus": "x" * (MAX_INSTRUCTION_CHARS + 1)},
                               f"at most {MAX_INSTRUCTION_CHARS}"),
                              ({"focus": 7}, "must be a string")]:
        with pytest.raises(RecallArgumentError) as caught:
            check_tool_call("compact_context", arguments)
        assert caught.value.argument == "focus" and reason in str(caught.value)
