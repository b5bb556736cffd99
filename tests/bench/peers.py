"""The in-band peer's side of the benchmarks: LangChain messages and the middleware's hook.

Not a benchmark itself. Converts compactd's OpenAI-shape messages to LangChain messages and back,
and runs one agent step of LangChain 1.x the way its agent graph does before each model call:
the step's messages are added to the state with LangGraph's own ``add_messages`` reducer, then
the middleware's ``before_model`` hook runs on the state and its update is applied with the same
reducer. The graph's other per-step costs (checkpointer writes, channel bookkeeping) are not
included, which favours the peer.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from langchain_core.messages import (
    AIMessage,
    AnyMessage,
    BaseMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
    convert_to_openai_messages,
)
from langgraph.graph.message import add_messages

from compactd.storage.messages import Message, parse

SUMMARY_SOURCE = "summarization"  # additional_kwargs["lc_source"] of the peer's summary message
SUMMARY_PREFIX = "Here is a summary of the conversation to date:\n\n"


def to_langchain(messages: Iterable[Mapping[str, Any]], *, ids: Iterable[str] | None = None
                 ) -> list[AnyMessage]:
    """LangChain messages from OpenAI chat dicts (``meta`` is compactd's and is dropped)."""
    out: list[AnyMessage] = []
    id_list = list(ids) if ids is not None else None
    for n, m in enumerate(messages):
        mid = id_list[n] if id_list is not None else None
        content = m.get("content")
        text: Any = "" if content is None else content
        role = m["role"]
        msg: AnyMessage
        if role == "system":
            msg = SystemMessage(content=text, id=mid)
        elif role == "user":
            msg = HumanMessage(content=text, id=mid)
        elif role == "assistant":
            calls = [{"name": c["function"]["name"], "args": _args(c["function"]["arguments"]),
                      "id": c["id"], "type": "tool_call"} for c in m.get("tool_calls") or ()]
            msg = AIMessage(content=text, tool_calls=calls, id=mid)
        elif role == "tool":
            msg = ToolMessage(content=text, tool_call_id=m["tool_call_id"], name=m.get("name"),
                              id=mid)
        else:
            raise ValueError(f"unknown role {role!r}")
        out.append(msg)
    return out


def _args(raw: str) -> dict[str, Any]:
    try:
        value = json.loads(raw)
    except (TypeError, ValueError):
        return {"input": raw}
    return value if isinstance(value, dict) else {"input": value}


def to_openai(messages: Sequence[BaseMessage]) -> list[dict[str, Any]]:
    """OpenAI chat dicts of LangChain messages (what the provider would be sent)."""
    out = convert_to_openai_messages(list(messages))
    return [out] if isinstance(out, dict) else list(out)


def to_compactd(messages: Sequence[BaseMessage]) -> list[Message]:
    """compactd messages of LangChain messages, for counting them with compactd's counter."""
    out: list[Message] = []
    for d in to_openai(messages):
        d = {k: v for k, v in d.items() if k in ("role", "content", "tool_calls",
                                                 "tool_call_id", "name")}
        if isinstance(d.get("content"), list):
            d["content"] = "\n".join(str(b.get("text", "")) for b in d["content"]
                                     if isinstance(b, dict))
        if d.get("content") is None:
            d["content"] = ""
        out.extend(parse(d, "openai"))
    return out


def is_summary(message: BaseMessage) -> bool:
    return message.additional_kwargs.get("lc_source") == SUMMARY_SOURCE


def apply_update(state: list[AnyMessage], update: Mapping[str, Any] | None) -> list[AnyMessage]:
    """The state after a node's update, as LangGraph's ``add_messages`` reducer computes it."""
    if not update or "messages" not in update:
        return state
    return list(add_messages(state, update["messages"]))  # type: ignore[arg-type]


def add_step(state: list[AnyMessage], new: list[AnyMessage]) -> list[AnyMessage]:
    return list(add_messages(state, new))  # type: ignore[arg-type]
