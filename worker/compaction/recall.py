"""Recall: what code (never a model) writes so the agent can follow a compaction back to its
originals, and how newly stale history is cut for the ``recallable`` layout.

**References.** A checkpoint is named by the span of original message seqs it replaced:
``c12-340``; the ``recallable`` layout's state checkpoint by the span it absorbed, ``s12-340``
(its own letter: the state's span ends where an index checkpoint's may, and the two must not
share a name). The name is known before the commit (a node's own seq is not: the commit assigns
it) and it never changes. Two checkpoints share a name only when they span the same originals:
a checkpoint that keeps nodes inside its range (the latest request, boundary rule 3) spans them
without replacing them, so live nodes' spans may nest, and a later checkpoint replacing exactly
it and what it kept is named like it (``[the request 4, c2-12]`` gives a second ``c2-12``).
That is no ambiguity, because a name is read by its span, not by its node (``storage.recall``:
the originals replaced between its ends), so both read the same messages: the first's, and
the kept ones once replaced. A pruned tool result is named by the seq of its original: ``r57``
(a result pruned twice keeps its name). Every name ever written stays readable, because the log
keeps every replace: ``history_read("c12-340")`` still works after an index roll-up replaced
``c12-340``.

**Footers.** A checkpoint carries one short line naming itself and the tool that reads it back,
only where the runtime offers the recall tools (:func:`offers_recall`; the ``recallable``
layout's checkpoints always carry it, recall being what that layout is for): the tools' own
schemas, sent with every request, say what they do, so the line needs only the name the model
must pass; without the tools it would name a tool the model cannot call, on every step after
the checkpoint. A pruned tool result carries a note naming its original. Both are
byte-identical for equal inputs (they sit in the provider's cached prefix) and a test holds
their size under :data:`FOOTER_MAX_TOKENS`. The footer belongs outside the summary text: a
merge reads the previous summary back as its existing summary, and a footer fed to the
summarizer could come back stale.

**Anchors.** Without a model, :func:`extract_anchors` keeps what a later search must find
verbatim: error lines (the last line of a Python traceback, lines with ``Error``/``Exception``/
``error:``), file paths, ids (uuids, hex hashes, ``#123``, ``ABC-123``), URLs and numbers with
units. Each is an exact substring of the text it came from (a long one is cut, never marked), so
searching for it finds the original.

**Chunks.** :func:`chunk_history` cuts a run of the surface at tool-pair-safe boundaries
(:func:`worker.compaction.boundary.unsafe_boundaries`, the planner's own) into chunks of about
``chunk_tokens``.

**Pointers.** :func:`pointer_text` is a checkpoint written without a model: what a failed chunk
call degrades to, and what the oldest index checkpoints roll up into. It says how much it
covers (message counts, tool calls, tokens), its anchors and how to recall it.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from compactd.storage.errors import RecallArgumentError
from compactd.storage.kinds import LayoutRole, NodeKind
from compactd.storage.messages import META_RECALL, Message
from compactd.storage.surface import SurfaceNode
from compactd.worker.compaction.boundary import unsafe_boundaries
from compactd.worker.compaction.prompt import atoms, message_body

HISTORY_SEARCH = "history_search"
HISTORY_READ = "history_read"

# Where a checkpoint or a pruned node keeps its reference and span (``Ref.to_json``) and its
# footer: storage.messages.META_RECALL, reserved so a runtime cannot forge one.

# A footer is at most this many tokens with every shipped counter while seqs are under 10^9
# (about 14 for seqs under 10^5), the pruned note too.
FOOTER_MAX_TOKENS = 24

MAX_ANCHORS = 24
ANCHOR_MAX_CHARS = 160
MAX_TOOL_NAMES = 8

RefKind = Literal[NodeKind.CHECKPOINT, NodeKind.PRUNED]
_REF = re.compile(r"(?:([cs])(\d{1,18})-(\d{1,18})|r(\d{1,18}))")


@dataclass(frozen=True, slots=True, order=True)
class Ref:
    """What ``history_read`` is given: a checkpoint's span or a pruned result's original;
    ``state``: the recallable layout's state checkpoint (``s12-340``)."""

    first: int
    last: int
    kind: RefKind = NodeKind.CHECKPOINT
    state: bool = False

    def __post_init__(self) -> None:
        if self.first < 0 or self.last < self.first:
            raise ValueError(f"not a seq span: {self.first}-{self.last}")
        if self.kind == NodeKind.PRUNED and (self.first != self.last or self.state):
            raise ValueError("a pruned result names one original seq")

    def __str__(self) -> str:
        if self.kind == NodeKind.PRUNED:
            return f"r{self.first}"
        return f"{'s' if self.state else 'c'}{self.first}-{self.last}"

    def to_json(self) -> dict[str, Any]:
        return {"ref": str(self), "first": self.first, "last": self.last}


def checkpoint_ref(first: int, last: int) -> Ref:
    return Ref(first, last, NodeKind.CHECKPOINT)


def state_ref(first: int, last: int) -> Ref:
    return Ref(first, last, NodeKind.CHECKPOINT, state=True)


def pruned_ref(seq: int) -> Ref:
    return Ref(seq, seq, NodeKind.PRUNED)


def parse_ref(text: Any, argument: str = "checkpoint") -> Ref:
    """The reference a caller (or a model) passed, or a :class:`RecallArgumentError`."""
    if not isinstance(text, str):
        raise RecallArgumentError(argument, f"must be a string like c12-340 or r57, got "
                                            f"{type(text).__name__}")
    match = _REF.fullmatch(text.strip())
    if match is None:
        shown = text if len(text) <= 40 else text[:40] + "..."
        raise RecallArgumentError(argument, f"{shown!r} is not a checkpoint (like c12-340 or "
                                            f"s12-340) or a pruned result (like r57)")
    if match.group(4) is not None:
        return pruned_ref(int(match.group(4)))
    first, last = int(match.group(2)), int(match.group(3))
    if last < first:
        raise RecallArgumentError(argument, f"{text.strip()!r}: the span ends before it starts")
    return state_ref(first, last) if match.group(1) == "s" else checkpoint_ref(first, last)


def node_span(node: SurfaceNode) -> tuple[int, int]:
    """The original seqs a surface node stands for: its own seq for a message, the span in its
    ``meta.recall`` for a checkpoint or pruned node written with one."""
    raw = node.message.meta.get(META_RECALL)
    if isinstance(raw, Mapping):
        first, last = raw.get("first"), raw.get("last")
        if isinstance(first, int) and isinstance(last, int) and 0 <= first <= last:
            return first, last
    return node.seq, node.seq


def layout_role(node: SurfaceNode) -> str | None:
    """The part a checkpoint plays in the recallable layout (:class:`LayoutRole`), None for any
    other node (a ``merge`` checkpoint included)."""
    raw = node.message.meta.get(META_RECALL)
    role = raw.get("layout") if isinstance(raw, Mapping) else None
    return role if role in (LayoutRole.INDEX, LayoutRole.STATE) else None


def is_index(node: SurfaceNode) -> bool:
    return layout_role(node) == LayoutRole.INDEX


def span_of(nodes: Sequence[SurfaceNode]) -> tuple[int, int]:
    """The span of original seqs a contiguous run of nodes covers."""
    if not nodes:
        raise ValueError("an empty run covers no seqs")
    spans = [node_span(n) for n in nodes]
    return min(s[0] for s in spans), max(s[1] for s in spans)


# ------------------------------------------------------------------------------------------
# footers


def checkpoint_footer(ref: Ref) -> str:
    """The line a checkpoint ends with: the call that reads its originals back (its name holds
    its span)."""
    return f'[originals: {HISTORY_READ}(checkpoint="{ref}")]'


def offers_recall(envelope: Mapping[str, Any] | None) -> bool:
    """Whether the runtime offers its model a recall tool, by the envelope it registered: its
    tools (OpenAI's or Anthropic's shape) name one. With no envelope registered compactd cannot
    tell, and says yes: a footer the model cannot use costs a line, a missing one the recall."""
    if envelope is None:
        return True
    tools = envelope.get("tools")
    if not isinstance(tools, list):
        return False
    for tool in tools:
        if not isinstance(tool, Mapping):
            continue
        function = tool.get("function")
        name = function.get("name") if isinstance(function, Mapping) else tool.get("name")
        if name in (HISTORY_READ, HISTORY_SEARCH):
            return True
    return False


def recall_meta(ref: Ref, *, footer: bool = True, **more: Any) -> dict[str, Any]:
    """A checkpoint's ``meta.recall``: its reference and span, its footer (``footer``: when the
    runtime offers the recall tools), and ``more`` (what the recallable layout keeps beside them:
    its role, an index checkpoint's anchors and tally)."""
    line = {"footer": checkpoint_footer(ref)} if footer else {}
    return {**ref.to_json(), **line, **more}


def pruned_note(ref: Ref) -> str:
    """What a pruned tool result carries so the model can read its original."""
    return f'[pruned; original: {HISTORY_READ}(checkpoint="{ref}")]'


# ------------------------------------------------------------------------------------------
# anchors


@dataclass(frozen=True, slots=True)
class _Pattern:
    kind: str
    regex: re.Pattern[str]
    priority: int  # lower is kept first when there are more anchors than room


_UNIT = (r"(?:ms|µs|us|ns|s|sec|secs|min|mins|h|hrs|d|B|KB|kB|KiB|MB|MiB|GB|GiB|TB|TiB|%|"
         r"tokens|req/s|rps|qps|ops/s|MHz|GHz|°C|px|x)")
_PATTERNS = (
    _Pattern("error", re.compile(
        r"^[ \t]*(?:\S[^\n]*?)?(?P<kw>\b\w*(?:Error|Exception)\b|\b(?:error|ERROR|fatal|FATAL|"
        r"panic)(?:\[\w+\])?:)[^\n]*", re.MULTILINE), 0),
    _Pattern("url", re.compile(r"\bhttps?://[^\s<>\"'`)\]}]+"), 3),
    _Pattern("uuid", re.compile(r"\b[0-9a-fA-F]{8}-(?:[0-9a-fA-F]{4}-){3}[0-9a-fA-F]{12}\b"), 1),
    _Pattern("hash", re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,64}\b"), 1),
    _Pattern("issue", re.compile(r"(?<![\w&#])#\d{1,7}\b|\b[A-Z][A-Z0-9]{1,9}-\d{1,7}\b"), 1),
    _Pattern("path", re.compile(
        r"(?<![\w/.:~@+-])(?:(?:~|\.{1,2})?/(?:[\w.@+-]+/)*[\w.@+-]*[\w@+-]"
        r"|(?:[\w.@+-]+/)+[\w@+-][\w.@+-]*\.[A-Za-z]\w{0,7})(?![\w/])"), 2),
    _Pattern("value", re.compile(rf"(?<![\w.])-?\d+(?:[.,]\d+)?\s?{_UNIT}(?![\w/])"), 4),
)
_TRACEBACK = "Traceback (most recent call last):"
_URL_TRAILING = ".,;:!?'\""


@dataclass(frozen=True, slots=True)
class _Found:
    order: tuple[int, int, int]  # text index, offset, longer first
    priority: int
    text: str


def _traceback_ends(text: str) -> Iterable[tuple[int, str]]:
    """(offset, line) of each traceback's last line: its first unindented line."""
    at = text.find(_TRACEBACK)
    while at >= 0:
        pos = text.find("\n", at)
        while pos >= 0:
            start = pos + 1
            end = text.find("\n", start)
            line = text[start:] if end < 0 else text[start:end]
            if line.strip() and not line[:1].isspace():
                yield start, line
                break
            pos = end
        at = text.find(_TRACEBACK, at + len(_TRACEBACK))


def _matches(index: int, text: str, max_chars: int) -> list[_Found]:
    raw: list[tuple[int, int, int, str]] = []  # start, end, priority, text
    for start, line in _traceback_ends(text):
        raw.append((start, start + len(line), 0, line))
    for pattern in _PATTERNS:
        for m in pattern.regex.finditer(text):
            found = m.group(0)
            if pattern.kind == "url":
                found = found.rstrip(_URL_TRAILING)
            start = m.start()
            if pattern.kind == "error":
                # A long line (minified JSON, a log) is cut to a window that shows the keyword.
                lead = max(0, m.start("kw") - start - max_chars // 4)
                lead += len(found[lead:]) - len(found[lead:].lstrip())
                found, start = found[lead:].rstrip(), start + lead
            raw.append((start, start + len(found), pattern.priority, found))
    raw.sort(key=lambda r: (r[0], -(r[1] - r[0])))
    out: list[_Found] = []
    covered_to = -1
    for start, end, priority, found in raw:
        if end <= covered_to:  # inside an anchor already taken from this text
            continue
        covered_to = max(covered_to, end)
        cut = found[:max_chars].rstrip()
        if cut:
            out.append(_Found((index, start, start - end), priority, cut))
    return out


def extract_anchors(texts: Iterable[str], *, max_count: int = MAX_ANCHORS,
                    max_chars: int = ANCHOR_MAX_CHARS) -> tuple[str, ...]:
    """The exact strings a later search must find, in order of first appearance.

    De-duplicated (an anchor inside one already kept is dropped), each cut to ``max_chars``
    code points, at most ``max_count``: when there are more, errors are kept first, then ids,
    paths, URLs and values, and the kept ones stay in order of appearance.
    """
    found: list[_Found] = []
    for index, text in enumerate(texts):
        if text:
            found.extend(_matches(index, text, max_chars))
    return _bounded(found, max_count)


def _bounded(found: Sequence[_Found], max_count: int) -> tuple[str, ...]:
    unique: list[_Found] = []
    for item in found:
        if not any(item.text in kept.text for kept in unique):
            unique.append(item)
    if len(unique) > max_count:
        chosen = sorted(unique, key=lambda f: (f.priority, f.order))[:max_count]
        unique = sorted(chosen, key=lambda f: f.order)
    return tuple(f.text for f in unique)


def message_anchors(messages: Iterable[Message], *, max_count: int = MAX_ANCHORS,
                    max_chars: int = ANCHOR_MAX_CHARS) -> tuple[str, ...]:
    """Anchors of messages as a transcript reads them (text, then each tool call's name and
    arguments)."""
    return extract_anchors((message_body(m) for m in messages), max_count=max_count,
                           max_chars=max_chars)


def merge_anchors(groups: Iterable[Sequence[str]], *, max_count: int = MAX_ANCHORS
                  ) -> tuple[str, ...]:
    """Anchor lists of consecutive checkpoints as one list (a roll-up): de-duplicated, in order,
    the oldest kept first when there are too many."""
    out: list[str] = []
    for group in groups:
        for anchor in group:
            if len(out) >= max_count:
                return tuple(out)
            if not any(anchor in kept for kept in out):
                out.append(anchor)
    return tuple(out)


def render_anchors(anchors: Sequence[str]) -> str:
    """One line; each anchor in backquotes so its edges are exact (a backquote inside becomes
    a quote: the line is for reading, the search runs over the originals)."""
    if not anchors:
        return "Anchors: (none)"
    return "Anchors: " + " ".join("`" + a.replace("`", "'").replace("\n", " ") + "`"
                                  for a in anchors)


# ------------------------------------------------------------------------------------------
# chunks


@dataclass(frozen=True, slots=True)
class Chunk:
    """``nodes[start:end]``: one future index checkpoint, and the originals it covers."""

    start: int
    end: int
    tokens: int
    first: int  # the span of original seqs (:func:`span_of`), which names its checkpoint
    last: int

    @property
    def ref(self) -> Ref:
        return checkpoint_ref(self.first, self.last)


def chunk_history(nodes: Sequence[SurfaceNode], start: int, end: int, chunk_tokens: int, *,
                  unsafe: Sequence[bool] | None = None) -> list[Chunk]:
    """``nodes[start:end]`` cut into consecutive chunks of about ``chunk_tokens``.

    Cuts fall only on tool-pair-safe boundaries, so a tool call and all its results are always
    in one chunk. A chunk closes before the unit (a message, or a whole tool-call group) that
    would take it over ``chunk_tokens``; a unit larger than that is a chunk of its own. A last
    chunk under half of ``chunk_tokens`` joins the one before it while the two stay within one
    and a half: an index checkpoint of a scrap would cost about as much as the scrap.
    ``start`` and ``end`` must themselves be safe boundaries (as a selected range's are).
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be at least 1, got {chunk_tokens}")
    if not 0 <= start <= end <= len(nodes):
        raise ValueError(f"[{start}, {end}) is not a range of {len(nodes)} nodes")
    if unsafe is None:
        unsafe = unsafe_boundaries(nodes)
    if unsafe[start] or unsafe[end]:
        raise ValueError(f"[{start}, {end}) cuts a tool-call group")
    bounds: list[tuple[int, int, int]] = []  # start, end, tokens
    lo, size = start, 0
    for a, b in atoms(start, end, unsafe):
        tokens = sum(nodes[i].tokens for i in range(a, b))
        if size and size + tokens > chunk_tokens:
            bounds.append((lo, a, size))
            lo, size = a, 0
        size += tokens
    if end > lo:
        bounds.append((lo, end, size))
    if len(bounds) >= 2:
        (a, _, prev), (_, b, last) = bounds[-2], bounds[-1]
        if last * 2 < chunk_tokens and (prev + last) * 2 <= chunk_tokens * 3:
            bounds[-2:] = [(a, b, prev + last)]
    return [Chunk(a, b, tokens, *span_of(nodes[a:b])) for a, b, tokens in bounds]


# ------------------------------------------------------------------------------------------
# pointers


@dataclass(frozen=True, slots=True)
class Tally:
    """How much a run of history holds, for a pointer that has no summary to offer."""

    messages: int
    tokens: int
    roles: tuple[tuple[str, int], ...]  # in ROLE_ORDER
    tool_calls: tuple[tuple[str, int], ...]  # most called first, then by name

    def to_json(self) -> dict[str, Any]:
        return {"messages": self.messages, "tokens": self.tokens, "roles": dict(self.roles),
                "tool_calls": dict(self.tool_calls)}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Tally:
        return _tally(int(raw.get("messages", 0)), int(raw.get("tokens", 0)),
                      Counter({str(k): int(v) for k, v in (raw.get("roles") or {}).items()}),
                      Counter({str(k): int(v)
                               for k, v in (raw.get("tool_calls") or {}).items()}))


ROLE_ORDER = ("user", "assistant", "tool", "system")


def _tally(messages: int, tokens: int, roles: Counter[str], calls: Counter[str]) -> Tally:
    ordered = tuple((r, roles[r]) for r in ROLE_ORDER if roles.get(r)) + tuple(
        sorted((r, n) for r, n in roles.items() if r not in ROLE_ORDER and n))
    return Tally(messages, tokens, ordered,
                 tuple(sorted(calls.items(), key=lambda item: (-item[1], item[0]))))


def tally(nodes: Iterable[SurfaceNode]) -> Tally:
    """Counts of a run of surface nodes; a checkpoint among them adds the messages of its stored
    tally, and every node adds its surface tokens."""
    return merge_tallies(_node_tally(node) for node in nodes)


def _node_tally(node: SurfaceNode) -> Tally:
    stored = node.message.meta.get(META_RECALL)
    inner = stored.get("tally") if isinstance(stored, Mapping) else None
    if isinstance(inner, Mapping):
        return replace(Tally.from_json(inner), tokens=node.tokens)
    return _tally(1, node.tokens, Counter([node.message.role]),
                  Counter(call.name for call in node.message.tool_calls))


def merge_tallies(parts: Iterable[Tally]) -> Tally:
    messages = tokens = 0
    roles: Counter[str] = Counter()
    calls: Counter[str] = Counter()
    for part in parts:
        messages += part.messages
        tokens += part.tokens
        roles.update(dict(part.roles))
        calls.update(dict(part.tool_calls))
    return _tally(messages, tokens, roles, calls)


def describe_tally(counts: Tally) -> str:
    roles = ", ".join(f"{role} {n}" for role, n in counts.roles)
    noun = "message" if counts.messages == 1 else "messages"
    out = f"{counts.messages} {noun} ({roles}), {counts.tokens} tokens"
    if counts.tool_calls:
        shown = counts.tool_calls[:MAX_TOOL_NAMES]
        names = ", ".join(f"{name} {n}" for name, n in shown)
        more = len(counts.tool_calls) - len(shown)
        out += f"; tool calls: {names}" + (f" and {more} more tools" if more > 0 else "")
    return out


def pointer_text(ref: Ref, counts: Tally, anchors: Sequence[str], *,
                 rolled_up: int = 0) -> str:
    """A checkpoint composed by code alone (footer included): a chunk whose summary call
    failed, or ``rolled_up`` index checkpoints folded into one."""
    return f"{pointer_body(counts, anchors, rolled_up=rolled_up)}\n{checkpoint_footer(ref)}"


def pointer_body(counts: Tally, anchors: Sequence[str], *, rolled_up: int = 0) -> str:
    """:func:`pointer_text` without its footer: a checkpoint's summary, to which its rendering
    adds the footer from ``meta.recall``."""
    what = (f"Rolled up {rolled_up} earlier index checkpoints" if rolled_up
            else "Not summarized")
    return f"{what}: {describe_tally(counts)}.\n{render_anchors(anchors)}"
