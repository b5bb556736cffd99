"""The ``recallable`` layout: one pass of it, planned (pure: no I/O).

The surface the layout keeps, after system and pinned nodes::

    [index checkpoints, oldest first][one state checkpoint][newly stale history][kept tail]

An **index checkpoint** stands for one chunk of history: a short what-happened a model wrote
(the index call, capped at ``index_summary_tokens``), a line of exact anchors composed by code,
and its footer. It is frozen: never rewritten, never summarized again, so the request prefix up
to the state stays byte-stable across passes and the provider's prefix cache keeps it. The
**state checkpoint** is the working memory (the eight sections), rewritten by every pass from
the previous state, the index checkpoints newer than its span, and the new stale history.

Reading a surface, before the keep cut (:func:`worker.compaction.boundary.tail_cut`): the
*anchor* is the last checkpoint; the *previous state* the last checkpoint that is no index
checkpoint (a ``merge`` checkpoint from before the layout changed counts); the stale history
lies between the anchor and the cut, and, as ``merge`` does, the pass takes its largest run
between protected nodes (:func:`worker.compaction.boundary.segments`). Index checkpoints are
never in it. Three ways the pass places its nodes:

* ``swap``: the run directly follows the previous state. Each index checkpoint goes in front of
  the state (``Replacement.before``: the two swap positions) and the last commit also rewrites
  the state in place, so every surface between commits is a valid layout.
* ``insert``: there is no state directly before the run (the first pass; a protected node in
  between, such as the latest user request; a state lagging behind an interrupted pass's index
  checkpoints). Index checkpoints replace their chunks in place and the new state is inserted
  after the last one (``Replacement.after``, into the position the last chunk's replace left
  free: that chunk is given two nodes or more). An earlier state is read, not replaced: it
  stays, frozen, until a roll-up takes it.
* ``plain``: a run of one node, or under half a chunk, is not worth an index checkpoint: the
  state replaces it (with the previous state, when that directly precedes it).

**Chunks.** About ``chunk_tokens`` each, unless one pass's index checkpoints would take more
than half of ``index_max_tokens`` (a first pass over a long history): then fewer, larger ones.

**Roll-up.** When the index checkpoints, this pass's included, would exceed
``index_max_tokens``, the oldest of them (with the frozen states and loose messages among them)
roll up into one pointer composed by code (:func:`worker.compaction.recall.pointer_body`):
merged anchors and tallies, named by its span, still recallable. It rolls up to half the cap, so
a roll-up (which changes the cached prefix) is rare.

**The pass guard.** Everything a pass writes must cost strictly fewer tokens than everything it
replaces. An index checkpoint is held to a bound known at plan time (its pointer's size, or its
anchors and footer plus ``index_summary_tokens``), so the state is held to what the bounds
leave (``StateStep.room_tokens``), and the guard holds however the calls turn out.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from compactd.storage.kinds import JournalKind, LayoutRole, NodeKind
from compactd.storage.messages import Message
from compactd.storage.records import Replacement
from compactd.storage.surface import SurfaceNode
from compactd.storage.tokens import TokenCounter
from compactd.worker.compaction.boundary import (
    is_checkpoint,
    protected,
    segments,
    tail_cut,
    unsafe_boundaries,
)
from compactd.worker.compaction.policy import Clause, Policy
from compactd.worker.compaction.prompt import (
    Budget,
    BudgetTooSmall,
    CallPlan,
    SummaryCall,
    atoms,
    index_overhead,
    message_body,
    pack,
    plan_calls,
)
from compactd.worker.compaction.recall import (
    MAX_ANCHORS,
    META_RECALL,
    Chunk,
    Ref,
    Tally,
    checkpoint_ref,
    chunk_history,
    is_index,
    merge_anchors,
    merge_tallies,
    message_anchors,
    node_span,
    pointer_body,
    recall_meta,
    render_anchors,
    span_of,
    state_ref,
    tally,
)
from compactd.worker.compaction.render import Skill, checkpoint_message, checkpoint_tokens
from compactd.worker.compaction.skills import capture_skills
from compactd.worker.compaction.validation import framed_tokens

SWAP, INSERT, PLAIN = "swap", "insert", "plain"
# An index checkpoint's anchors: fewer and shorter than a pointer may hold, so it stays near its
# 100 to 200 tokens.
INDEX_ANCHORS = 6
INDEX_ANCHOR_CHARS = 80
# Tokens an index checkpoint's what-happened may add beyond its count alone (escaping, the line
# joining it to the anchors): its bound is its empty form plus the cap plus this.
INDEX_SLACK_TOKENS = 8
# The same for the state: the last state call's output cap leaves this much of its room free.
STATE_SLACK_TOKENS = 16
MIN_STATE_TOKENS = 64


@dataclass(frozen=True, slots=True)
class IndexStep:
    """One chunk of the stale history and the index checkpoint it becomes."""

    replace_seqs: tuple[int, ...]
    ref: Ref
    calls: tuple[SummaryCall, ...]  # empty: no room for a call, the pointer is written
    anchors: tuple[str, ...]
    recall: dict[str, Any]  # the checkpoint's meta.recall, with its anchors and tally
    pointer: Message  # what the chunk degrades to when its calls fail
    pointer_tokens: int
    bound_tokens: int  # the most the checkpoint may cost (the pass guard counts this)
    replaced_tokens: int
    before: int | None  # swap: the state's seq

    def to_json(self) -> dict[str, Any]:
        return {"checkpoint": str(self.ref), "replace_seqs": list(self.replace_seqs),
                "replaced_tokens": self.replaced_tokens, "bound_tokens": self.bound_tokens,
                "before": self.before, "calls": [c.to_json() for c in self.calls]}


@dataclass(frozen=True, slots=True)
class RollUp:
    """The oldest index checkpoints (and what lies among them) folded into one pointer."""

    replace_seqs: tuple[int, ...]
    ref: Ref
    message: Message
    tokens: int
    replaced_tokens: int
    rolled_up: int  # index checkpoints folded, counting those earlier roll-ups folded

    def to_json(self) -> dict[str, Any]:
        return {"checkpoint": str(self.ref), "replace_seqs": list(self.replace_seqs),
                "replaced_tokens": self.replaced_tokens, "tokens": self.tokens,
                "rolled_up": self.rolled_up}


@dataclass(frozen=True, slots=True)
class StateStep:
    """The state checkpoint the pass writes: what it reads, replaces and where it goes."""

    replace_seqs: tuple[int, ...]  # the previous state (swap), the run (plain), or none
    after: int | None  # insert: the last chunk's last seq (its index checkpoint, by then)
    calls: tuple[SummaryCall, ...]
    existing_summary: str
    skills: tuple[Skill, ...]
    has_history: bool
    span: tuple[int, int]  # everything the layout absorbed: names it s<first>-<last>
    room_tokens: int  # the framed state must cost fewer (what the pass guard leaves it)
    max_tokens: int  # the last call's output cap
    strategy: str

    @property
    def ref(self) -> Ref:
        return state_ref(*self.span)

    @property
    def recall(self) -> dict[str, Any]:
        return recall_meta(self.ref, layout=LayoutRole.STATE)

    def to_json(self) -> dict[str, Any]:
        return {"checkpoint": str(self.ref), "replace_seqs": list(self.replace_seqs),
                "after": self.after, "room_tokens": self.room_tokens,
                "max_tokens": self.max_tokens, "strategy": self.strategy,
                "skills": [s.to_json() for s in self.skills],
                "calls": [c.to_json() for c in self.calls]}


@dataclass(frozen=True, slots=True)
class RecallablePass:
    """One pass: an optional roll-up, the index checkpoints left to right, the state."""

    mode: str
    rollup: RollUp | None
    chunks: tuple[IndexStep, ...]
    state: StateStep
    replaced_tokens: int  # everything the pass takes off the surface
    keep_seqs: tuple[int, ...]
    deferred_seqs: tuple[int, ...]

    @property
    def replace_seqs(self) -> tuple[int, ...]:
        out = list(self.rollup.replace_seqs) if self.rollup else []
        for chunk in self.chunks:
            out.extend(chunk.replace_seqs)
        out.extend(self.state.replace_seqs)
        return tuple(sorted(out))

    def to_json(self) -> dict[str, Any]:
        """``plan --json``'s ``summarize`` body for this layout: the contract's keys (every
        seq the pass replaces, what it keeps, every call in order), then the pass itself."""
        calls = [c.to_json() for chunk in self.chunks for c in chunk.calls]
        calls += [c.to_json() for c in self.state.calls]
        return {"layout": "recallable", "mode": self.mode,
                "replace_seqs": list(self.replace_seqs), "keep_seqs": list(self.keep_seqs),
                "calls": calls, "replaced_tokens": self.replaced_tokens,
                "deferred_seqs": list(self.deferred_seqs), "checkpoint": str(self.state.ref),
                "rollup": self.rollup.to_json() if self.rollup else None,
                "chunks": [chunk.to_json() for chunk in self.chunks],
                "state": self.state.to_json()}


# ------------------------------------------------------------------------------------------
# checkpoints


def index_text(what: str, anchors: Sequence[str]) -> str:
    """An index checkpoint's summary: the model's what-happened, then the anchors line."""
    line = render_anchors(anchors)
    return f"{what.strip()}\n{line}" if what.strip() else line


def index_checkpoint(step: IndexStep, what: str | None, policy: Policy, **meta: Any) -> Message:
    """The checkpoint for a chunk whose index call wrote ``what`` (None: its pointer)."""
    if what is None:
        return step.pointer.model_copy(update={"meta": {**step.pointer.meta, **meta}})
    return checkpoint_message(index_text(what, step.anchors), (), policy.render,
                              recall=step.recall, **meta)


def state_checkpoint(state: StateStep, summary: str, policy: Policy, **meta: Any) -> Message:
    return checkpoint_message(summary, state.skills, policy.render, recall=state.recall, **meta)


def validate_index(text: str, step: IndexStep, policy: Policy, run_model: str | None,
                   counter: TokenCounter, *, final: bool) -> str | None:
    """Why an index call's text is refused (None: accepted). Every call's text keeps to the cap;
    the final one's checkpoint keeps to the bound the pass guard counted."""
    if not text.strip():
        return "empty or whitespace-only index entry"
    tokens = counter.count_text(text)
    if tokens > policy.index_summary_tokens:
        return (f"index entry is {tokens} tokens, over index_summary_tokens "
                f"{policy.index_summary_tokens}")
    if final:
        framed = checkpoint_tokens(index_checkpoint(step, text, policy), run_model)
        if framed > step.bound_tokens:
            return (f"index checkpoint is {framed} tokens, over its bound of "
                    f"{step.bound_tokens}")
    return None


# ------------------------------------------------------------------------------------------
# the plan


@dataclass(frozen=True, slots=True)
class NoPlan:
    """Why a plan has no summarize step (said in ``why_no_summary``)."""

    reason: str


@dataclass(frozen=True, slots=True)
class _Layout:
    """The surface as the layout reads it, before the keep cut (see the module's docstring)."""

    nodes: Sequence[SurfaceNode]
    unsafe: list[bool]
    guard: list[bool]
    cut: int
    checkpoints: list[int]
    anchor: int  # the last checkpoint before the cut; -1 when none
    prev: int | None  # the previous state

    @property
    def state_node(self) -> SurfaceNode | None:
        return self.nodes[self.prev] if self.prev is not None else None


@dataclass(frozen=True, slots=True)
class _Reading:
    """What the state reads: the previous state and the index checkpoints newer than its span
    (``lead``), then the stale run ``start``..``end`` as the calls take it."""

    lead: list[SurfaceNode]
    nodes: list[SurfaceNode]
    calls: CallPlan
    start: int
    end: int

    @property
    def read(self) -> list[SurfaceNode]:
        return self.nodes[:self.calls.end]


def plan_pass(nodes: Sequence[SurfaceNode], *, policy: Policy, counter: TokenCounter,
              run_model: str | None, envelope_tokens: int, keep: Clause | None, force: bool
              ) -> RecallablePass | NoPlan:
    """The pass over ``nodes`` (pruned already), or why there is none."""
    layout = _read_layout(nodes, policy, keep=keep, force=force)
    run = _stale_run(layout)
    if isinstance(run, NoPlan):
        return run
    start, _ = run
    # The run directly follows the previous state: the state is rewritten in place.
    swap = layout.prev is not None and layout.prev == layout.anchor == start - 1
    reading = _state_reading(layout, run, policy, counter, envelope_tokens)
    if isinstance(reading, NoPlan):
        return reading
    run_tokens = sum(n.tokens for n in nodes[reading.start:reading.end])
    plain = reading.end - reading.start == 1 or run_tokens * 2 < policy.chunk_tokens
    mode = PLAIN if plain else SWAP if swap else INSERT
    steps = () if plain else _index_steps(layout, reading, policy, counter, run_model,
                                          swap=swap)
    replace_seqs, after = _state_placement(layout, reading, steps, plain=plain, swap=swap)
    new_index = sum(step.bound_tokens for step in steps)
    rollup = _rollup(nodes, layout.checkpoints, min(start, layout.anchor + 1), layout.guard,
                     layout.unsafe, policy, run_model, live=layout.prev if swap else None,
                     index_total=sum(n.tokens for n in nodes[:layout.cut] if is_index(n)),
                     adding=new_index)
    replacing = set(replace_seqs)
    rolled = (rollup.replaced_tokens, rollup.tokens) if rollup else (0, 0)
    replaced = (sum(n.tokens for n in nodes if n.seq in replacing)
                + sum(step.replaced_tokens for step in steps) + rolled[0])
    written = new_index + rolled[1]
    state = _state_step(reading, policy, run_model, replace_seqs, after,
                        replaced=replaced, written=written)
    if isinstance(state, NoPlan):
        return state
    gone = {q for step in steps for q in step.replace_seqs} | replacing
    gone |= set(rollup.replace_seqs if rollup else ())
    keep_seqs, deferred = _left(layout, gone)
    return RecallablePass(mode=mode, rollup=rollup, chunks=steps, state=state,
                          replaced_tokens=replaced, keep_seqs=keep_seqs,
                          deferred_seqs=deferred)


def _left(layout: _Layout, gone: set[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """What the pass keeps, and of it the stale history a later pass takes."""
    keep_seqs = tuple(n.seq for n in layout.nodes if n.seq not in gone)
    deferred = tuple(n.seq for i, n in enumerate(layout.nodes[:layout.cut])
                     if not layout.guard[i] and not is_checkpoint(n) and n.seq not in gone
                     and i > layout.anchor)
    return keep_seqs, deferred


def _read_layout(nodes: Sequence[SurfaceNode], policy: Policy, *, keep: Clause | None,
                 force: bool) -> _Layout:
    unsafe = unsafe_boundaries(nodes)
    cut = tail_cut(nodes, keep=keep, policy=policy, force=force, unsafe=unsafe)
    checkpoints = [i for i in range(cut) if is_checkpoint(nodes[i])]
    states = [i for i in checkpoints if not is_index(nodes[i])]
    return _Layout(nodes=nodes, unsafe=unsafe, guard=protected(nodes), cut=cut,
                   checkpoints=checkpoints, anchor=checkpoints[-1] if checkpoints else -1,
                   prev=states[-1] if states else None)


def _stale_run(layout: _Layout) -> tuple[int, int] | NoPlan:
    """The largest run of stale history between protected nodes, as ``merge`` takes it."""
    nodes = layout.nodes
    runs = segments(nodes, layout.anchor + 1, layout.cut, layout.guard, layout.unsafe)
    if not runs:
        return NoPlan("no stale history before the kept tail: only index checkpoints, the "
                      "state, system, pinned or rescued nodes, or an unclosed tool-call step")
    return max(runs, key=lambda r: (sum(n.tokens for n in nodes[r[0]:r[1]]), -r[0]))


def _state_reading(layout: _Layout, run: tuple[int, int], policy: Policy,
                   counter: TokenCounter, envelope_tokens: int) -> _Reading | NoPlan:
    """What the state reads: the previous state, the index checkpoints newer than its span,
    then the run. The shrink strategy may shorten the run to what one state call reads."""
    nodes, state_node = layout.nodes, layout.state_node
    start, end = run
    newer_than = node_span(state_node)[1] if state_node is not None else -1
    lagging = [nodes[i] for i in range(layout.cut) if is_index(nodes[i])
               and node_span(nodes[i])[0] > newer_than]
    lead = ([state_node] if state_node is not None else []) + lagging
    reading = [*lead, *nodes[start:end]]
    read_unsafe = unsafe_boundaries(reading)
    calls = plan_calls(reading, 0, len(reading), read_unsafe, policy, counter, envelope_tokens)
    if not isinstance(calls, str) and calls.end <= len(lead) < len(reading):
        # Shrunk to nothing stale: the chunks read what the state cannot in one call anyway.
        calls = plan_calls(reading, 0, len(reading), read_unsafe,
                           replace(policy, strategy="chunk"), counter, envelope_tokens)
    if isinstance(calls, str):
        return NoPlan(calls)
    return _Reading(lead=lead, nodes=reading, calls=calls, start=start,
                    end=start + calls.end - len(lead))


def _index_steps(layout: _Layout, reading: _Reading, policy: Policy, counter: TokenCounter,
                 run_model: str | None, *, swap: bool) -> tuple[IndexStep, ...]:
    """The run's index checkpoints. One pass adds at most half of index_max_tokens (a first
    pass over a long history would add far more): its chunks grow instead, so the next pass's
    roll-up has the other half to work in."""
    state_node = layout.state_node
    before = state_node.seq if swap and state_node else None
    size = policy.chunk_tokens
    while True:
        chunks = _chunks(layout.nodes, reading.start, reading.end, size, layout.unsafe,
                         need_two=not swap)
        steps = tuple(_index_step(layout.nodes, c, policy, counter, run_model, layout.unsafe,
                                  before=before) for c in chunks)
        added = sum(step.bound_tokens for step in steps)
        if len(steps) == 1 or added * 2 <= policy.index_max_tokens:
            return steps
        size = math.ceil(size * added * 2 / policy.index_max_tokens) + 1


def _state_placement(layout: _Layout, reading: _Reading, steps: Sequence[IndexStep], *,
                     plain: bool, swap: bool) -> tuple[tuple[int, ...], int | None]:
    """The state's own replacement: what it replaces, and the seq it goes after (insert)."""
    state_node = layout.state_node
    if plain:
        replace_seqs = tuple(n.seq for n in layout.nodes[reading.start:reading.end])
        if swap and state_node is not None:
            replace_seqs = (state_node.seq, *replace_seqs)
        return replace_seqs, None
    if swap and state_node is not None:
        return (state_node.seq,), None
    return (), steps[-1].replace_seqs[-1]


def _state_step(reading: _Reading, policy: Policy, run_model: str | None,
                replace_seqs: tuple[int, ...], after: int | None, *, replaced: int,
                written: int) -> StateStep | NoPlan:
    """The state checkpoint, when what the pass replaces leaves it room to shrink the surface."""
    read, calls = reading.read, reading.calls
    skills = tuple(capture_skills(read, tool_names=policy.skill_file_read_tool_names,
                                  skills_path=policy.skills_path))
    span = (min(node_span(n)[0] for n in read), max(node_span(n)[1] for n in read))
    room = replaced - written
    empty = framed_tokens("", skills, policy, run_model,
                          recall_meta(state_ref(*span), layout=LayoutRole.STATE))
    cap = min(policy.max_summary_tokens, room - empty - STATE_SLACK_TOKENS)
    if cap < MIN_STATE_TOKENS:
        return NoPlan(f"the pass would not shrink the surface: it replaces {replaced} tokens, "
                      f"its index checkpoints may cost {written}, and an empty state {empty}")
    has_history = bool(calls.existing) or any(message_body(n.message).strip() for n in read)
    return StateStep(replace_seqs=replace_seqs, after=after, calls=calls.calls,
                     existing_summary=calls.existing, skills=skills, has_history=has_history,
                     span=span, room_tokens=room, max_tokens=cap, strategy=calls.strategy)


def _chunks(nodes: Sequence[SurfaceNode], start: int, end: int, size: int,
            unsafe: Sequence[bool], *, need_two: bool) -> list[Chunk]:
    """The run cut into chunks of about ``size``; with ``need_two`` the last has two nodes or
    more (the state is inserted into a position its replace leaves free)."""
    chunks = chunk_history(nodes, start, end, size, unsafe=unsafe)
    if need_two and len(chunks) > 1 and chunks[-1].end - chunks[-1].start == 1:
        a, b = chunks[-2], chunks[-1]
        chunks[-2:] = [Chunk(a.start, b.end, a.tokens + b.tokens,
                             *span_of(nodes[a.start:b.end]))]
    return chunks


def _index_step(nodes: Sequence[SurfaceNode], chunk: Chunk, policy: Policy,
                counter: TokenCounter, run_model: str | None, unsafe: Sequence[bool], *,
                before: int | None) -> IndexStep:
    part = nodes[chunk.start:chunk.end]
    anchors = message_anchors((n.message for n in part), max_count=INDEX_ANCHORS,
                              max_chars=INDEX_ANCHOR_CHARS)
    counts = tally(part)
    ref = chunk.ref
    recall = recall_meta(ref, layout=LayoutRole.INDEX, anchors=list(anchors),
                         tally=counts.to_json())
    pointer = checkpoint_message(pointer_body(counts, anchors), (), policy.render,
                                 recall={**recall, "pointer": True})
    pointer_tokens = checkpoint_tokens(pointer, run_model)
    empty = checkpoint_tokens(checkpoint_message(index_text("", anchors), (), policy.render,
                                                 recall=recall), run_model)
    budget = Budget(policy.trim_tokens_to_summarize, index_overhead(policy, counter), 0,
                    math.ceil(policy.index_summary_tokens * 1.1))
    try:
        calls = tuple(pack(nodes, atoms(chunk.start, chunk.end, unsafe), budget, counter))
    except BudgetTooSmall:
        calls = ()
    return IndexStep(
        replace_seqs=tuple(n.seq for n in part), ref=ref, calls=calls, anchors=anchors,
        recall=recall, pointer=pointer, pointer_tokens=pointer_tokens,
        bound_tokens=max(pointer_tokens,
                         empty + policy.index_summary_tokens + INDEX_SLACK_TOKENS),
        replaced_tokens=chunk.tokens, before=before)


def _rollup(nodes: Sequence[SurfaceNode], checkpoints: Sequence[int], limit: int,
            guard: Sequence[bool], unsafe: Sequence[bool], policy: Policy,
            run_model: str | None, *, live: int | None, index_total: int, adding: int
            ) -> RollUp | None:
    """The oldest index checkpoints rolled up, when the index would exceed its cap: from the
    first index checkpoint, over the index checkpoints, frozen states and loose history after
    it up to ``limit`` (the anchor, included, or the stale run), never over a protected node or
    the state this pass rewrites (``live``); as many as bring the index to half the cap, else
    as many as bring it lowest."""
    if index_total + adding <= policy.index_max_tokens:
        return None
    first = next((i for i in checkpoints if is_index(nodes[i])), None)
    if first is None:
        return None
    last = first
    while last < limit and not guard[last] and last != live:
        last += 1
    best: RollUp | None = None
    best_after = 0
    for stop in range(first + 2, last + 1):
        if unsafe[stop]:
            continue
        rolled = _pointer(nodes[first:stop], policy, run_model)
        if rolled.tokens >= rolled.replaced_tokens:
            continue
        folded = sum(n.tokens for n in nodes[first:stop] if is_index(n))
        after = index_total - folded + rolled.tokens + adding
        if best is None or after < best_after:
            best, best_after = rolled, after
        if after <= policy.index_max_tokens // 2:
            break
    return best


def _pointer(run: Sequence[SurfaceNode], policy: Policy, run_model: str | None) -> RollUp:
    """The code-composed pointer that replaces ``run``."""
    groups: list[Sequence[str]] = []
    tallies: list[Tally] = []
    rolled = 0
    for node in run:
        stored = node.message.meta.get(META_RECALL)
        if is_index(node) and isinstance(stored, dict):
            groups.append(tuple(str(a) for a in stored.get("anchors") or ()))
            rolled += int(stored.get("rolled_up") or 1)
            tallies.append(tally([node]))
        elif not is_checkpoint(node):
            groups.append(message_anchors([node.message]))
            tallies.append(tally([node]))
        # A frozen state is the working memory of its time, read into the states after it:
        # its originals stay searchable through the pointer's span, its tally is theirs.
    anchors = merge_anchors(groups, max_count=MAX_ANCHORS // 2)
    counts = merge_tallies(tallies)
    ref = checkpoint_ref(*span_of(run))
    recall = recall_meta(ref, layout=LayoutRole.INDEX, anchors=list(anchors),
                         tally=counts.to_json(), rolled_up=rolled, pointer=True)
    message = checkpoint_message(pointer_body(counts, anchors, rolled_up=rolled), (),
                                 policy.render, recall=recall)
    return RollUp(replace_seqs=tuple(n.seq for n in run), ref=ref, message=message,
                  tokens=checkpoint_tokens(message, run_model),
                  replaced_tokens=sum(n.tokens for n in run), rolled_up=rolled)


# ------------------------------------------------------------------------------------------
# commits


def commit_count(p: RecallablePass) -> int:
    """How many commits the pass makes at most: one per index checkpoint (the state rides on
    the last), or one for the state alone. Index checkpoints whose calls are done together may
    share one."""
    return max(1, len(p.chunks))


def commit_replacements(p: RecallablePass, start: int, indexes: Sequence[Message],
                        run_model: str | None, state: Message | None = None
                        ) -> list[Replacement]:
    """One commit of the pass, left to right: the roll-up with the first, the index checkpoints
    of chunks ``start``, ``start + 1``, ... (``indexes``), and with the last of them the state
    (``state``; None: the state call failed and the index checkpoints go alone). Journals are
    empty: the caller fills them in."""
    out: list[Replacement] = []
    if start == 0 and p.rollup is not None:
        out.append(_replacement(p.rollup.replace_seqs, p.rollup.message, run_model))
    for step, index in zip(p.chunks[start:start + len(indexes)], indexes, strict=True):
        out.append(_replacement(step.replace_seqs, index, run_model, before=step.before))
    if state is not None and start + len(indexes) == len(p.chunks):
        out.append(_replacement(p.state.replace_seqs, state, run_model, after=p.state.after))
    return out


def _replacement(seqs: tuple[int, ...], message: Message, run_model: str | None, *,
                 before: int | None = None, after: int | None = None) -> Replacement:
    return Replacement(seqs=seqs, kind=NodeKind.CHECKPOINT, payload=message.to_payload(),
                       tokens=checkpoint_tokens(message, run_model),
                       journal_kind=JournalKind.SUMMARY, before=before, after=after)
