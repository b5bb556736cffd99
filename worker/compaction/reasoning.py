"""Model-free clearing of old reasoning: ``summarization.clear_thinking``.

An assistant message keeps its reasoning as content blocks: Anthropic's ``thinking`` and
``redacted_thinking`` (both the Anthropic importer and LangChain's ``convert_to_openai_messages``
keep them in the content list as they came), and ``reasoning`` (LangChain's standard block, and an
OpenAI Responses reasoning item stored as a block). They are sent back on every request and cost
what they weigh, yet the model needs little of an old turn's reasoning. Anthropic's own context
editing clears them the same way (``clear_thinking``, keeping the newest turns).

The edit drops every reasoning block of an assistant message but those of the ``keep`` newest
messages that hold reasoning (Anthropic's ``thinking_turns``: a message whose reasoning is
already cleared no longer counts, so the same surface clears the same way twice). A signed block
can only be sent back whole or not at all, so a block is never shortened, only dropped.

Never touched, whatever ``keep`` says, because the provider rejects or degrades a request
without them (Anthropic: thinking blocks go back complete and unmodified for the turn in
progress, and a tool-use loop is one turn; OpenAI: reasoning items go back with the function
call outputs of their turn):

* an assistant message with a tool call still waiting for its result;
* every assistant message of the turn in progress, when it is a tool-use loop: those after the
  latest real user request (``boundary.latest_user_request``: not a checkpoint, reminder or
  hidden message), when one of them made a tool call and the surface does not end on an
  assistant reply without one;
* a message whose reasoning is all it holds (clearing it would leave an empty assistant message,
  which providers refuse).

A cleared message is a pruned node: ``meta.pruned``, ``meta.cleared_thinking``, and
``meta.recall`` naming its original (``r<seq>``, read back with ``history_read``), so nothing is
lost. No note is added to the message's text: it would read as something the assistant said.
Reasoning kept in ``meta`` (an OpenAI-compatible ``reasoning_content``) is neither counted nor
sent back by compactd's renderers, so there is nothing there to free.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from compactd.storage.messages import META_PRUNED, Message
from compactd.storage.surface import SurfaceNode
from compactd.storage.tokens import TokenCounter
from compactd.worker.compaction.boundary import latest_user_request, open_calls
from compactd.worker.compaction.policy import ClearThinkingConfig
from compactd.worker.compaction.pruning import PruneAction
from compactd.worker.compaction.recall import META_RECALL, node_span, pruned_ref

REASONING_BLOCKS = frozenset({"thinking", "redacted_thinking", "reasoning"})
META_CLEARED_THINKING = "cleared_thinking"
KIND_CLEAR_THINKING = "clear_thinking"


def is_reasoning(block: dict[str, Any]) -> bool:
    return block.get("type") in REASONING_BLOCKS


def holds_reasoning(message: Message) -> bool:
    """Whether an assistant message has a reasoning block to clear."""
    content = message.content
    return (
        message.role == "assistant"
        and isinstance(content, list)
        and any(is_reasoning(b) for b in content)
    )


def loop_in_progress(nodes: Sequence[SurfaceNode]) -> set[int]:
    """Indexes of the assistant messages of the turn in progress when it is a tool-use loop."""
    # A reminder, checkpoint or hidden message injected between steps is not the user speaking:
    # the loop (and the provider's need for its signed reasoning) goes on across it.
    latest = latest_user_request(nodes)
    start = 0 if latest is None else latest + 1
    turn = [i for i in range(start, len(nodes)) if nodes[i].message.role == "assistant"]
    if not any(nodes[i].message.tool_calls for i in turn):
        return set()
    last = nodes[-1].message
    if last.role == "assistant" and not last.tool_calls:
        return set()  # the loop ended on a reply: the next user message starts a new turn
    return set(turn)


def without_reasoning(message: Message, original: int) -> Message | None:
    """``message`` with its reasoning blocks dropped, or None when nothing would remain."""
    assert isinstance(message.content, list)
    kept = [b for b in message.content if not is_reasoning(b)]
    if not kept and not message.tool_calls:
        return None
    return message.model_copy(
        update={
            "content": kept or None,
            "meta": {
                **message.meta,
                META_PRUNED: True,
                META_CLEARED_THINKING: True,
                META_RECALL: pruned_ref(original).to_json(),
            },
        }
    )


def clear_thinking(
    nodes: Sequence[SurfaceNode], config: ClearThinkingConfig | None, counter: TokenCounter
) -> list[PruneAction]:
    """Drop the reasoning of every assistant message but the ``config.keep`` newest that hold
    some, and those the provider needs (see the module's docstring), oldest first."""
    if config is None:
        return []
    holding = [i for i, node in enumerate(nodes) if holds_reasoning(node.message)]
    candidates = holding[: len(holding) - config.keep] if config.keep < len(holding) else []
    needed = open_calls(nodes) | loop_in_progress(nodes)
    actions: list[PruneAction] = []
    for i in candidates:
        if i in needed:
            continue
        node = nodes[i]
        cleared = without_reasoning(node.message, node_span(node)[0])
        if cleared is None:
            continue
        after = counter.count_message(cleared)
        if after < node.tokens:
            actions.append(
                PruneAction(node.seq, cleared, node.tokens, after, (KIND_CLEAR_THINKING,))
            )
    return actions
