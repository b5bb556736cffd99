"""Model-free pruning: pipeline step 3, the cheapest layer, run before any summary.

Two edits, each a *replace* of one surface node by a copy that differs only where it must:

* **Oversized tool results** (DeepSeek Harness's pruner): a result whose text is over
  ``threshold_chars`` code points keeps its first ``head_chars`` and last ``tail_chars`` (either,
  not both, may be 0: the end of a build log alone) with a
  fixed marker between. Python strings index by code point, so a cut never splits a surrogate pair
  and the result stays valid UTF-8. Non-text blocks are kept, in order; the marker goes where the
  head ends. ``meta.pruned`` is set, and a pruned node is never pruned again (cutting a cut would
  only move the marker).
* **Tool-use clearing** (LangChain's ``ClearToolUsesEdit``): above its own token trigger, every tool
  result but the ``keep`` newest becomes the placeholder; results of ``exclude_tools`` are left
  alone; ``clear_tool_inputs`` also empties the arguments of the call that produced it;
  ``clear_at_least`` stops clearing once that many tokens are reclaimed. A cleared result is
  skipped later but still counts among the newest, as in LangChain.

Every edited result ends with a note composed by code naming its original (``r57``, the seq of
the message first pruned, :func:`worker.compaction.recall.pruned_note`), and ``meta.recall``
holds that reference, so the model can read what was cut.

An edit that would not save tokens (a tiny result cleared to a longer placeholder) is skipped:
every replace the planner emits must make the surface smaller. Token counts after an edit are
counted with the run model's counter; the counts before are the node's stored counts, so savings
add up against the surface totals.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from compactd.storage.kinds import JournalKind, NodeKind
from compactd.storage.messages import META_PRUNED, Message
from compactd.storage.records import Replacement
from compactd.storage.surface import SurfaceNode
from compactd.storage.tokens import TokenCounter
from compactd.worker.compaction.boundary import pair_results
from compactd.worker.compaction.policy import PRUNE_MARKER, ClearToolUsesConfig, PruneConfig
from compactd.worker.compaction.recall import META_RECALL, node_span, pruned_note, pruned_ref

META_CLEARED = "cleared"
META_CLEARED_INPUTS = "cleared_tool_inputs"
CLEARED_ARGUMENTS = "{}"

KIND_PRUNE = "prune"
KIND_CLEAR = "clear"
KIND_CLEAR_INPUT = "clear_input"


@dataclass(frozen=True, slots=True)
class PruneAction:
    """One node replaced by an edited copy; ``edits`` says which edits made it."""

    seq: int
    message: Message
    tokens_before: int
    tokens_after: int
    edits: tuple[str, ...]

    @property
    def saved(self) -> int:
        return self.tokens_before - self.tokens_after

    def to_json(self) -> dict[str, Any]:
        return {"seq": self.seq, "tokens_before": self.tokens_before,
                "tokens_after": self.tokens_after, "edits": list(self.edits)}


def text_chars(content: str | list[dict[str, Any]] | None) -> int:
    """Code points of text in a content value (non-text blocks count nothing)."""
    if content is None:
        return 0
    if isinstance(content, str):
        return len(content)
    return sum(len(str(b.get("text", ""))) for b in content if b.get("type") == "text")


def cut_middle(content: str | list[dict[str, Any]], head: int, tail: int,
               marker: str = PRUNE_MARKER) -> str | list[dict[str, Any]]:
    """``content`` with its text middle replaced by ``marker``, cut on code points.

    Offsets run over the text blocks in order, as if joined; non-text blocks stay where they
    were. Text blocks emptied by the cut are dropped. The caller guarantees the text is longer
    than ``head + tail``, so the marker always lands inside some text block.
    """
    if isinstance(content, str):
        return content[:head] + marker + content[len(content) - tail:]
    total = text_chars(content)
    tail_from = total - tail
    out: list[dict[str, Any]] = []
    pos = 0
    for block in content:
        if block.get("type") != "text":
            out.append(block)
            continue
        text = str(block.get("text", ""))
        end = pos + len(text)
        kept = text[:max(0, head - pos)]
        if pos <= head < end:
            kept += marker
        kept += text[max(0, tail_from - pos, head - pos):] if end > tail_from else ""
        if kept:
            out.append({**block, "text": kept})
        pos = end
    return out


def prune_message(message: Message, config: PruneConfig, original: int | None = None
                  ) -> Message | None:
    """The pruned copy of a tool result over the threshold, or None when it is left alone.
    With ``original`` (the seq of the message it stands for) it carries the recall note."""
    if message.role != "tool" or message.flag(META_PRUNED) or message.content is None:
        return None
    if text_chars(message.content) <= config.threshold_chars:
        return None
    content = cut_middle(message.content, config.head_chars, config.tail_chars)
    pruned = message.model_copy(update={"content": content,
                                        "meta": {**message.meta, META_PRUNED: True}})
    return pruned if original is None else with_pruned_note(pruned, original)


def with_pruned_note(message: Message, original: int) -> Message:
    """``message`` ending with the note that names its original, and ``meta.recall`` set."""
    ref = pruned_ref(original)
    note = pruned_note(ref)
    content = message.content
    if isinstance(content, list):
        content = [*content, {"type": "text", "text": note}]
    else:
        content = f"{content}\n{note}" if content else note
    return message.model_copy(update={"content": content, "meta": {
        **message.meta, META_RECALL: {**ref.to_json(), "footer": note}}})


def prune_tool_results(nodes: Sequence[SurfaceNode], config: PruneConfig,
                       counter: TokenCounter) -> list[PruneAction]:
    """Size pruning of every oversized tool result on the surface."""
    if not config.enabled:
        return []
    actions: list[PruneAction] = []
    for node in nodes:
        pruned = prune_message(node.message, config, node_span(node)[0])
        if pruned is None:
            continue
        after = counter.count_message(pruned)
        if after < node.tokens:
            actions.append(PruneAction(node.seq, pruned, node.tokens, after, (KIND_PRUNE,)))
    return actions


def clear_tool_uses(nodes: Sequence[SurfaceNode], config: ClearToolUsesConfig,
                    counter: TokenCounter, *, pressure_tokens: int) -> list[PruneAction]:
    """LangChain ``ClearToolUsesEdit`` over ``nodes`` (already size-pruned), oldest first.

    Fires only when ``pressure_tokens`` is over ``config.trigger`` (LangChain clears when the
    count is strictly above it).
    """
    if not config.enabled or pressure_tokens <= config.trigger:
        return []
    paired = pair_results(nodes)
    results = [i for i, node in enumerate(nodes) if node.message.role == "tool"]
    candidates = results[:-config.keep] if config.keep else results
    if config.keep >= len(results):
        candidates = []
    excluded = set(config.exclude_tools)
    edited: dict[int, Message] = {}
    edits: dict[int, list[str]] = {}
    reclaimed = 0
    for i in candidates:
        message = nodes[i].message
        if message.flag(META_CLEARED):
            continue
        call_index = paired.get(i)
        if call_index is None:  # no call on the surface to attribute it to: LangChain skips it
            continue
        call = next(c for c in nodes[call_index].message.tool_calls
                    if c.id == message.tool_call_id)
        if (message.name or call.name) in excluded:
            continue
        cleared = with_pruned_note(message.model_copy(update={
            "content": config.placeholder,
            "meta": {**message.meta, META_PRUNED: True, META_CLEARED: True}}),
            node_span(nodes[i])[0])
        before = _current_tokens(nodes[i], edited.get(i), counter)
        after = counter.count_message(cleared)
        if after >= before:
            continue
        edited[i] = cleared
        edits.setdefault(i, []).append(KIND_CLEAR)
        reclaimed += before - after
        if config.clear_tool_inputs:
            owner = edited.get(call_index, nodes[call_index].message)
            emptied = _clear_input(owner, call.id)
            if emptied is not owner:
                owner_before = _current_tokens(nodes[call_index], edited.get(call_index), counter)
                owner_after = counter.count_message(emptied)
                if owner_after < owner_before:
                    edited[call_index] = emptied
                    edits.setdefault(call_index, []).append(KIND_CLEAR_INPUT)
                    reclaimed += owner_before - owner_after
        if config.clear_at_least and reclaimed >= config.clear_at_least:
            break
    return [PruneAction(nodes[i].seq, edited[i], nodes[i].tokens,
                        counter.count_message(edited[i]), tuple(edits[i]))
            for i in sorted(edited)]


def _current_tokens(node: SurfaceNode, edited: Message | None, counter: TokenCounter) -> int:
    return node.tokens if edited is None else counter.count_message(edited)


def _clear_input(message: Message, call_id: str) -> Message:
    done = list(message.meta.get(META_CLEARED_INPUTS) or ())
    if call_id in done:
        return message
    calls = tuple(c.model_copy(update={"arguments": CLEARED_ARGUMENTS}) if c.id == call_id else c
                  for c in message.tool_calls)
    return message.model_copy(update={
        "tool_calls": calls,
        "meta": {**message.meta, META_PRUNED: True, META_CLEARED_INPUTS: [*done, call_id]}})


def merge_actions(first: Iterable[PruneAction], then: Iterable[PruneAction]) -> list[PruneAction]:
    """One action per seq: a later edit of an already edited node keeps the original
    ``tokens_before`` and accumulates its edit names."""
    by_seq = {a.seq: a for a in first}
    for action in then:
        earlier = by_seq.get(action.seq)
        if earlier is not None:
            action = replace(action, tokens_before=earlier.tokens_before,
                             edits=earlier.edits + action.edits)
        by_seq[action.seq] = action
    return [by_seq[s] for s in sorted(by_seq)]


def prune_replacements(actions: Iterable[PruneAction]) -> list[Replacement]:
    """The commit's replacements of ``actions``, each journaled with the tokens it saved."""
    return [Replacement(seqs=(a.seq,), kind=NodeKind.PRUNED, payload=a.message.to_payload(),
                        tokens=a.tokens_after, journal_kind=JournalKind.PRUNE,
                        journal={"seq": a.seq, "tokens_before": a.tokens_before,
                                 "tokens_after": a.tokens_after, "saved": a.saved,
                                 "edits": list(a.edits)})
            for a in actions]


def riding_actions(actions: Sequence[PruneAction], replaced: Iterable[int]
                   ) -> list[PruneAction]:
    """The held ``actions`` a summary's commit applies beside its own replacements: those
    whose node it does not replace (the others it replaces whole, its summary having read
    their edited text)."""
    gone = set(replaced)
    return [a for a in actions if a.seq not in gone]


def apply_actions(nodes: Sequence[SurfaceNode], actions: Iterable[PruneAction]
                  ) -> list[SurfaceNode]:
    """The surface after the prune replaces (same seqs: the planner's view before commit)."""
    by_seq = {a.seq: a for a in actions}
    if not by_seq:
        return list(nodes)
    return [node if node.seq not in by_seq else
            replace(node, kind=NodeKind.PRUNED, message=by_seq[node.seq].message,
                    tokens=by_seq[node.seq].tokens_after)
            for node in nodes]
