"""Small builders for surfaces in compaction tests (no I/O)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from typing import Any

from compactd.storage.kinds import NodeKind
from compactd.storage.messages import Message, ToolCall
from compactd.storage.surface import SurfaceNode
from compactd.storage.tokens import counter_for
from compactd.worker.compaction.render import Skill, checkpoint_message, checkpoint_tokens

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
COUNTER = counter_for(None)


def sys(text: str = "You are an agent.", **meta: Any) -> Message:
    return Message(role="system", content=text, meta=meta)


def user(text: str = "please do it", **meta: Any) -> Message:
    return Message(role="user", content=text, meta=meta)


def ai(text: str | None = "ok", *calls: tuple[str, str] | tuple[str, str, Any],
       **meta: Any) -> Message:
    tool_calls = tuple(
        ToolCall(id=c[0], name=c[1],
                 arguments=json.dumps(c[2]) if len(c) > 2 else "{}")  # type: ignore[misc]
        for c in calls)
    return Message(role="assistant", content=text, tool_calls=tool_calls, meta=meta)


def tool(call_id: str, text: str | list[dict[str, Any]] = "result", name: str | None = None,
         **meta: Any) -> Message:
    return Message(role="tool", content=text, tool_call_id=call_id, name=name, meta=meta)


def ckpt(summary: str = "earlier work", skills: Sequence[Skill] = (),
         form: str = "durable_context") -> Message:
    return checkpoint_message(summary, skills, form)


def nodes(*messages: Message, start: int = 1, tokens: Iterable[int] | None = None
          ) -> list[SurfaceNode]:
    """Surface nodes with consecutive seqs; tokens counted unless given."""
    sizes = list(tokens) if tokens is not None else None
    out = []
    for i, message in enumerate(messages):
        is_ckpt = bool(message.meta.get("checkpoint"))
        if sizes is not None:
            count = sizes[i]
        elif is_ckpt:
            count = checkpoint_tokens(message, None)
        else:
            count = COUNTER.count_message(message)
        kind = NodeKind.CHECKPOINT if is_ckpt else NodeKind.MESSAGE
        out.append(SurfaceNode(seq=start + i, kind=kind, message=message, tokens=count, position=i))
    return out


def seqs(ns: Sequence[SurfaceNode]) -> list[int]:
    return [n.seq for n in ns]
