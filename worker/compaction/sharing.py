"""A summary call that reads the agent's prompt cache (``summarization.share_cache``).

When the session's run model writes the summary, on the provider the runtime calls, the call
can begin with exactly the request the runtime last sent: its envelope (system prompt, tools),
then the surface as compactd serves it (:func:`worker.compaction.render.render_surface`, each
message with the keys a provider is sent), with the runtime's cache hints (OpenAI's
``prompt_cache_key``, Anthropic's ``cache_control`` breakpoints, both read from the envelope),
and the instruction after it as the last user message. The provider then reads that prefix from
the cache the agent's own requests filled, at the cached price. This is replay mode
(:func:`worker.compaction.prompt.build_prompt`) taken to the whole served surface: replay sends
the range re-built from its nodes and stops at its end; a shared call sends what the runtime
sends, the kept tail too, and the instruction names how many of the last messages stay.

Bound. The shared prefix is what the agent already sends the same model, so it fits the run
model's window by construction; what the call adds is the instruction and the summary it writes.
A shared call is therefore bounded by the window: envelope, surface, instruction and
``max_summary_tokens`` must fit it. ``trim_tokens_to_summarize`` does not bound it: that budget
sizes the transcript calls, whose input is paid at the full price; a shared call's prefix is
paid at the cached price, so one call reading it all costs less than several calls reading the
range again. Past the window no call is shared, and the planned calls run as they are; with the
window unknown, the agent's own requests are the evidence that the prefix fits.

The prefix ends where the served surface ends, unless its last assistant turn still waits for
tool results (a request cannot end there): then it ends before that turn, which is still where
the runtime's request began to differ. It never ends before the range does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from compactd.storage.surface import SurfaceNode
from compactd.storage.tokens import MESSAGE_FRAMING_TOKENS, TokenCounter
from compactd.worker.compaction.policy import Policy
from compactd.worker.compaction.prompt import (
    SUMMARY_RULES,
    fill_instruction,
    focus_block,
    kept_inside_note,
)
from compactd.worker.compaction.render import render_surface

# The keys of a served message that a provider is sent (the surface adds seq, tokens, meta).
WIRE_KEYS = ("role", "content", "tool_calls", "tool_call_id", "name")

SHARED_INSTRUCTION = (
    "Stop the task. Summarize the conversation above for yourself, so you can continue from "
    "the summary alone: every message after the system prompt, and the conversation summary "
    "that the system prompt or the first messages may carry (it is the existing summary)."
    f"\n\n{SUMMARY_RULES}"
)
SHARED_EXISTING = "(the conversation summary above, if there is one)"


def kept_note(kept: int) -> str:
    """What the instruction says of the messages that stay after the checkpoint."""
    if kept <= 0:
        return ""
    last = "message" if kept == 1 else f"{kept} messages"
    return (f"\n\nThe last {last} above stay in the conversation word for word after your "
            "summary: leave them out of it.")


@dataclass(frozen=True, slots=True)
class CacheHints:
    """The runtime's cache hints, sent as it sends them: OpenAI's ``prompt_cache_key``, and the
    ``cache_control`` it puts on its system prompt and on its request's last message."""

    prompt_cache_key: str | None = None
    cache_control: dict[str, Any] | None = None

    @classmethod
    def of(cls, envelope: Mapping[str, Any] | None) -> CacheHints | None:
        envelope = envelope or {}
        key = envelope.get("prompt_cache_key")
        control = envelope.get("cache_control")
        hints = cls(key if isinstance(key, str) and key else None,
                    dict(control) if isinstance(control, Mapping) and control else None)
        return hints if hints.prompt_cache_key or hints.cache_control else None


@dataclass(frozen=True, slots=True)
class SharedCall:
    """One summary call beginning with the runtime's last request."""

    chat: tuple[dict[str, Any], ...]  # envelope system, served messages, the instruction
    tools: tuple[dict[str, Any], ...]
    cache: CacheHints | None
    prefix_messages: int  # served messages sent (the instruction follows them)
    kept: int  # of those, the ones after the range: they stay, the summary leaves them out
    input_tokens: int  # estimated: envelope, served messages, instruction


def cache_readable(provider: str, envelope: Mapping[str, Any] | None) -> bool:
    """Whether a call on ``provider`` can read the runtime's cache: OpenAI caches every long
    prefix on its own; Anthropic caches only at breakpoints, so without the runtime's
    ``cache_control`` there is no entry to read and a shared call would pay the whole surface
    at the full price."""
    hints = CacheHints.of(envelope)
    return provider != "anthropic" or (hints is not None and hints.cache_control is not None)


def served_messages(nodes: Sequence[SurfaceNode]) -> list[dict[str, Any]]:
    """The surface as the runtime is served it and sends it (checkpoints rendered as stored,
    the authority contract placed), with the keys a provider is sent."""
    return [{k: m[k] for k in WIRE_KEYS if k in m} for m in render_surface(nodes)]


def prefix_end(nodes: Sequence[SurfaceNode]) -> int:
    """Where a request built from ``nodes`` may end: before the first assistant turn whose
    tool calls are not all answered after it (a request cannot end waiting for results)."""
    answered = {n.message.tool_call_id for n in nodes if n.message.role == "tool"}
    for i, node in enumerate(nodes):
        calls = node.message.tool_calls
        if calls and any(c.id not in answered for c in calls):
            return i
    return len(nodes)


def shared_call(nodes: Sequence[SurfaceNode], replace_seqs: Sequence[int], policy: Policy,
                envelope: Mapping[str, Any] | None, envelope_tokens: int,
                counter: TokenCounter, kept_inside: Sequence[int] = ()) -> SharedCall | None:
    """The shared call for a step replacing ``replace_seqs`` of ``nodes`` (the surface as
    stored), keeping ``kept_inside`` among them, or None when it cannot be made within the run
    model's window."""
    if not replace_seqs:
        return None
    index = {node.seq: i for i, node in enumerate(nodes)}
    last = index.get(replace_seqs[-1])
    if last is None:
        return None
    end = prefix_end(nodes)
    if end <= last:
        return None
    served = served_messages(nodes[:end])
    kept = end - (last + 1)
    template = policy.summary_prompt or SHARED_INSTRUCTION
    instruction = (fill_instruction(template, SHARED_EXISTING, None)
                   if policy.summary_prompt else template) + kept_note(kept) + kept_inside_note(
        [node.message for node in nodes if node.seq in set(kept_inside)]) + focus_block(policy)
    env = envelope or {}
    chat: list[dict[str, Any]] = []
    system = env.get("system")
    if system:
        chat.append({"role": "system", "content": system})
    chat.extend(served)
    chat.append({"role": "user", "content": instruction})
    tools = env.get("tools")
    tool_list = tuple(dict(t) for t in tools if isinstance(t, Mapping)) if isinstance(
        tools, list) else ()
    tokens = (max(0, envelope_tokens) + sum(node.tokens for node in nodes[:end])
              + MESSAGE_FRAMING_TOKENS + counter.count_text(instruction))
    window = policy.context_window
    if window is not None and tokens + policy.max_summary_tokens > window:
        return None
    return SharedCall(tuple(chat), tool_list, CacheHints.of(env), len(served), kept, tokens)

