"""Tool-call pairing checks shared by tests and benchmarks.

Two questions: does a cut keep every tool-call group on one side (``cut_problems``), and would a
provider accept a message list as a request (``request_problems``)? Both return descriptions of
what is wrong, empty when nothing is.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

from compactd.storage.surface import SurfaceNode

# (seq, role, the ids of the calls it issues, the call id it answers)
Row = tuple[int, str, Sequence[str], str | None]


def node_rows(nodes: Iterable[SurfaceNode]) -> list[Row]:
    return [(n.seq, n.message.role, [c.id for c in n.message.tool_calls],
             n.message.tool_call_id) for n in nodes]


def json_rows(messages: Iterable[Mapping[str, Any]]) -> list[Row]:
    """Rows of ``compactd surface --json`` messages (OpenAI-shaped, with ``seq``)."""
    return [(m["seq"], m["role"], [c["id"] for c in m.get("tool_calls") or ()],
             m.get("tool_call_id")) for m in messages]


def cut_problems(rows: Iterable[Row], replaced: Collection[int]) -> list[str]:
    """A result on the other side of the cut from its call, or a replaced call still open.

    A result answers the nearest earlier call with its id (real transcripts reuse ids).
    """
    problems: list[str] = []
    owner: dict[str, int] = {}
    open_calls: dict[int, set[str]] = {}
    for seq, role, call_ids, answers in rows:
        for call_id in call_ids:
            owner[call_id] = seq
            open_calls.setdefault(seq, set()).add(call_id)
        if role == "tool" and answers in owner:
            call_seq = owner[answers]
            open_calls[call_seq].discard(answers)
            if (seq in replaced) != (call_seq in replaced):
                problems.append(f"tool group of call {answers} split by the cut")
    problems += [f"seq {seq}: a call without its result is replaced"
                 for seq, missing in open_calls.items() if seq in replaced and missing]
    return problems


def request_problems(messages: Sequence[Mapping[str, Any]]) -> list[str]:
    """What a provider rejects: a result not answering a call of the assistant message before
    it, or a call left without its result."""
    problems: list[str] = []
    pending: set[str] = set()
    for m in messages:
        if m["role"] == "tool":
            if m.get("tool_call_id") in pending:
                pending.discard(m["tool_call_id"])
            else:
                problems.append(f"orphan result for {m.get('tool_call_id')!r}")
            continue
        problems += [f"call {c!r} has no result before a {m['role']} message" for c in pending]
        pending = ({c["id"] for c in m.get("tool_calls") or ()} if m["role"] == "assistant"
                   else set())
    return problems + [f"call {c!r} has no result at the end" for c in pending]
