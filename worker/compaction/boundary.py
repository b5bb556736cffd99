"""Which nodes a summary replaces: pipeline step 4.

Vocabulary. ``nodes[i]`` is the i-th surface node; *boundary* ``b`` is the gap before
``nodes[b]`` (0 is before everything, ``len(nodes)`` after everything). A boundary is *unsafe*
when a tool-call group straddles it: an assistant message with tool calls at index ``a`` whose
last result is at ``e`` makes every boundary in ``(a, e]`` unsafe. Parallel calls are one group
(all results of one assistant message), and results that interleave with other messages widen the
group. Cutting only at safe boundaries means no side of a cut ever holds a result without its call
or a call without all its results.

An *open* call (no result yet) can only be answered by a result appended after everything on the
surface, and that result must find its call. So the assistant message holding an open call is
protected (never replaced), with the results of its group already present, and nothing else: what
follows it can be compacted, since no result can land inside what is already there. A call left
open by a runtime that moved on (followed by 30 messages) then pins one node, not the session.

Selection:

1. **The kept tail.** ``keep`` picks a cut: ``messages N`` keeps the last N nodes, ``tokens N`` the
   longest tail within N tokens, ``fraction f`` the longest tail within f of the run model's
   window; the default is ``retain_ratio`` of the window, or the last 20 messages without one. The
   cut then moves toward the head to the nearest safe boundary. Forced mode (overflow or manual
   compaction) ignores ``keep`` unless an explicit override is given: its cut is at the newest
   assistant message with tool calls of the current turn (else the last assistant message, else
   the last node), so the step in progress stays verbatim and the head is reduced as far as it
   can be.
2. **Protected nodes.** Never replaced: system messages, ``pinned`` nodes (the contract) and
   assistant messages with an open call, plus
   nodes rescued from the range: ``dynamic_context_reminder`` messages and the latest real user
   request (a user message that is not a checkpoint, reminder or hidden message). Earlier user
   messages are compacted normally; that is what stops an old request from contaminating later
   turns.
3. **One range, the rescued nodes left in place.** Protected nodes inside the head split it
   into *segments* (maximal runs of unprotected nodes), each shrunk inward to safe boundaries.
   Segments separated only by rescued nodes (reminders, the latest user request) and what a
   shrink left out are one *group*, replaced at once: the range runs from its first segment's
   start to its last one's end, and the nodes between its segments are *kept*: they stay
   verbatim, in their order, and the checkpoint follows the last of them (``storage.surface``:
   a replace that keeps nodes). One summary, one commit, one break of the agent's cache. The
   plan replaces the group holding the most tokens (the earliest on a tie); the others stay
   for a later round. A node never replaced where it stands (system, pinned, an open call)
   ends a group: what the runtime put before it stays before it.

   Why all at once. The commonest protected node inside the head is the latest user request:
   a tau-bench session's request arrives, the agent works on it for forty steps, and the range
   is ``[older history, the request, the work on it]``. Replacing only the largest segment (the
   rule until 2026-12-06) left the other one verbatim until a later run, and the agent carried
   it on every step meanwhile; a run per segment would break the agent's cache and pay the
   summarizer once per segment.

   Why the checkpoint after the kept nodes. The agent then reads ``[system, the request, the
   summary, the latest steps]``: the request first, then what was done on it, then where the
   work stands, in the order it happened; the summary's account of earlier turns is background
   it names as such ("Conversation summary so far"). Put before the request, the summary would
   tell the work done on the request before the request itself, and a model could take the
   request for new and start its work again. The request is never summarized away: it stays the
   latest real user request on the surface, so the next run keeps it too, and once a newer
   request arrives it is ordinary history and joins the range. Stacked checkpoints self-heal as
   before: an earlier checkpoint at the range's start is merged (its summary is the input's
   existing summary), one further in is read inline.
4. **Worth it.** Segments that are all lone checkpoints, or a range whose replaced tokens do not
   exceed an empty checkpoint's framed size, cannot shrink the surface (validation demands
   strictly fewer tokens): nothing to do.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from compactd.storage.counters import Counter
from compactd.storage.kinds import NodeKind
from compactd.storage.messages import META_CHECKPOINT, META_HIDDEN, META_PINNED, META_REMINDER
from compactd.storage.surface import SurfaceNode
from compactd.worker.compaction.policy import Clause, Policy, effective_keep


@dataclass(frozen=True, slots=True)
class Selection:
    """Where the kept tail starts and which range ``nodes[start:end]`` a summary replaces:
    all of it but ``kept`` (indexes inside it that stay where they are)."""

    cut: int
    start: int
    end: int
    nothing_to_do: str | None = None
    kept: tuple[int, ...] = ()


NO_HEAD = "the kept tail and its tool-call groups are the whole surface"


def is_checkpoint(node: SurfaceNode) -> bool:
    return node.kind == NodeKind.CHECKPOINT or bool(node.message.meta.get(META_CHECKPOINT))


def is_real_user_request(node: SurfaceNode) -> bool:
    meta = node.message.meta
    return (node.message.role == "user" and not is_checkpoint(node)
            and not meta.get(META_REMINDER) and not meta.get(META_HIDDEN))


def latest_user_request(nodes: Sequence[SurfaceNode]) -> int | None:
    for i in range(len(nodes) - 1, -1, -1):
        if is_real_user_request(nodes[i]):
            return i
    return None


def protected(nodes: Sequence[SurfaceNode]) -> list[bool]:
    """Per node: never replaced (system, pinned, an open call) or rescued (reminder, latest user
    request)."""
    latest = latest_user_request(nodes)
    out = []
    for i, node in enumerate(nodes):
        meta = node.message.meta
        out.append(node.message.role == "system" or bool(meta.get(META_PINNED))
                   or bool(meta.get(META_REMINDER)) or i == latest)
    for i in open_calls(nodes):
        out[i] = True
    return out


def pair_results(nodes: Sequence[SurfaceNode]) -> dict[int, int]:
    """Index of each tool result -> index of the assistant message whose call it answers.

    A result answers the nearest earlier call with its id. Ids should be unique in a session,
    but real transcripts replayed from caches reuse them, and pairing by the nearest call keeps
    each reuse its own group rather than one group spanning the session.
    """
    owner: dict[str, int] = {}
    out: dict[int, int] = {}
    for i, node in enumerate(nodes):
        message = node.message
        for call in message.tool_calls:
            owner[call.id] = i
        if message.role == "tool" and message.tool_call_id is not None:
            a = owner.get(message.tool_call_id)
            if a is not None:
                out[i] = a
    return out


def open_calls(nodes: Sequence[SurfaceNode]) -> set[int]:
    """Indexes of the assistant messages with a call still waiting for its result (a result
    answers the nearest earlier call with its id, as in :func:`pair_results`)."""
    pending: dict[str, int] = {}
    shadowed: set[int] = set()  # open calls whose id a later call reused
    for i, node in enumerate(nodes):
        message = node.message
        if message.tool_calls:
            for call in message.tool_calls:
                earlier = pending.get(call.id)
                if earlier is not None:
                    shadowed.add(earlier)
                pending[call.id] = i
        elif pending and message.tool_call_id is not None and message.role == "tool":
            pending.pop(message.tool_call_id, None)
    return shadowed | set(pending.values())


def unsafe_boundaries(nodes: Sequence[SurfaceNode]) -> list[bool]:
    """``unsafe[b]`` for every boundary ``b`` in ``0..len(nodes)`` (see the module docstring)."""
    n = len(nodes)
    last: dict[int, int] = {}
    for r, a in pair_results(nodes).items():
        last[a] = r
    diff = [0] * (n + 2)
    # A group spans its call and the results present so far; a call still waiting for more is
    # protected instead (see :func:`protected`), since its result can only come after the end.
    for a, e in last.items():
        if e > a:
            diff[a + 1] += 1
            diff[e + 1] -= 1
    unsafe = []
    depth = 0
    for b in range(n + 1):
        depth += diff[b]
        unsafe.append(depth > 0)
    return unsafe


def resolve_keep(policy: Policy, override: Clause | None = None) -> Clause:
    """The effective keep clause; a ``fraction`` needs the run model's window."""
    return effective_keep(override or policy.keep, policy.retain_ratio, policy.context_window)


def keep_cut(nodes: Sequence[SurfaceNode], keep: Clause, context_window: int | None) -> int:
    """The boundary where the kept tail starts, before tool-pair safety."""
    budget = keep.threshold(context_window) or 0
    counter = keep.measure.counter
    cut, kept = len(nodes), 0
    while cut > 0 and kept + node_count(nodes[cut - 1], counter) <= budget:
        kept += node_count(nodes[cut - 1], counter)
        cut -= 1
    return cut


def node_count(node: SurfaceNode, counter: Counter) -> int:
    """What one surface node adds to ``counter``."""
    return counter.of(node.message, node.tokens)


def forced_cut(nodes: Sequence[SurfaceNode]) -> int:
    """Forced mode keeps the current step and lets everything before it go: the newest
    tool-call group of the current turn (after the latest real user request) whole, else the last
    assistant message, else the last node. A group of an earlier turn is history like any other:
    keeping it would pin every turn after it, and a session whose one call is thirty turns old
    could not be reduced at all. A group with an open call is not that group unless nothing
    follows it: its call message stays anyway (protected), and a runtime that moved on past it
    is in a later step."""
    latest = latest_user_request(nodes)
    turn_start = 0 if latest is None else latest + 1
    waiting: set[int] | None = None
    for i in range(len(nodes) - 1, turn_start - 1, -1):
        calls = nodes[i].message.tool_calls
        if not calls:
            continue
        ids = {call.id for call in calls}
        if all(node.message.role == "tool" and node.message.tool_call_id in ids
               for node in nodes[i + 1:]):
            return i  # nothing but its own results after it: the step in progress
        waiting = open_calls(nodes) if waiting is None else waiting
        if i not in waiting:
            return i
    for i in range(len(nodes) - 1, -1, -1):
        if nodes[i].message.role == "assistant":
            return i
    return max(0, len(nodes) - 1)


def safe_at_or_before(unsafe: Sequence[bool], b: int) -> int:
    while b > 0 and unsafe[b]:
        b -= 1
    return b


def tail_cut(nodes: Sequence[SurfaceNode], *, keep: Clause | None, policy: Policy,
             force: bool, unsafe: Sequence[bool]) -> int:
    """The safe boundary where the kept tail starts (rule 1 of the module docstring)."""
    if force and keep is None:
        raw = forced_cut(nodes)
    else:
        raw = keep_cut(nodes, resolve_keep(policy, keep), policy.context_window)
    return safe_at_or_before(unsafe, raw)


def segments(nodes: Sequence[SurfaceNode], start: int, end: int, guard: Sequence[bool],
             unsafe: Sequence[bool]) -> list[tuple[int, int]]:
    """The maximal runs of unprotected nodes in ``nodes[start:end]``, each shrunk inward to
    safe boundaries; empty ones left out (rule 3)."""
    out: list[tuple[int, int]] = []
    i = start
    while i < end:
        if guard[i]:
            i += 1
            continue
        j = i
        while j < end and not guard[j]:
            j += 1
        lo, hi = i, j
        while lo < hi and unsafe[lo]:
            lo += 1
        while hi > lo and unsafe[hi]:
            hi -= 1
        if hi > lo:
            out.append((lo, hi))
        i = j
    return out


def select_range(nodes: Sequence[SurfaceNode], *, keep: Clause | None, policy: Policy,
                 force: bool = False, min_tokens: int = 0,
                 unsafe: Sequence[bool] | None = None) -> Selection:
    """The range a summary replaces (see the module docstring for every rule).

    ``keep`` None in forced mode means a maximal head reduction; otherwise it is resolved with
    :func:`resolve_keep`. ``min_tokens`` is the framed size of an empty checkpoint: a run not
    larger than that cannot be replaced by anything smaller.
    """
    if unsafe is None:
        unsafe = unsafe_boundaries(nodes)
    cut = tail_cut(nodes, keep=keep, policy=policy, force=force, unsafe=unsafe)
    if cut == 0:
        return Selection(cut, 0, 0, NO_HEAD)
    guard = protected(nodes)
    rescued = rescued_nodes(nodes)
    best: tuple[int, list[tuple[int, int]]] | None = None  # tokens, the group's segments
    for group in joined_segments(segments(nodes, 0, cut, guard, unsafe), guard, rescued):
        # Earlier checkpoints alone are no candidate (re-summarizing summaries only churns
        # the cache); beside anything else they are merged into the new one.
        if all(hi - lo == 1 and is_checkpoint(nodes[lo]) for lo, hi in group):
            continue
        tokens = sum(node.tokens for lo, hi in group for node in nodes[lo:hi])
        if best is None or tokens > best[0]:
            best = (tokens, group)
    if best is None:
        return Selection(cut, 0, 0, "no compactable run before the kept tail: only system, "
                                    "pinned, rescued nodes, an earlier checkpoint or an "
                                    "unclosed tool-call step")
    tokens, group = best
    start, end = group[0][0], group[-1][1]
    if tokens <= min_tokens:
        return Selection(cut, start, start,
                         f"the largest compactable range ({tokens} tokens) is not larger than "
                         f"an empty checkpoint ({min_tokens} tokens)")
    replaced = {i for lo, hi in group for i in range(lo, hi)}
    return Selection(cut, start, end,
                     kept=tuple(i for i in range(start, end) if i not in replaced))


def rescued_nodes(nodes: Sequence[SurfaceNode]) -> list[bool]:
    """Per node: rescued from a range (a reminder, the latest user request), as opposed to
    never replaced where it stands (system, pinned, an open call)."""
    latest = latest_user_request(nodes)
    return [bool(node.message.meta.get(META_REMINDER)) or i == latest
            for i, node in enumerate(nodes)]


def joined_segments(parts: Sequence[tuple[int, int]], guard: Sequence[bool],
                    rescued: Sequence[bool]) -> list[list[tuple[int, int]]]:
    """``parts`` (segments, in order) in groups one summary replaces: consecutive segments
    join when only rescued nodes, or nodes a segment's shrink to safe boundaries left out,
    lie between them (rule 3)."""
    groups: list[list[tuple[int, int]]] = []
    for lo, hi in parts:
        if groups and all(rescued[i] or not guard[i] for i in range(groups[-1][-1][1], lo)):
            groups[-1].append((lo, hi))
        else:
            groups.append([(lo, hi)])
    return groups
