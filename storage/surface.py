"""The surface: the ordered projection of the event log that the model sees.

Plain data and pure functions only (no SQL): the policy reads these types, and ``replay`` is the
reference definition of the projection that ``compactd verify`` checks the stored rows against.

Event kinds:

* ``message``: appended by the runtime; adds a node at the end of the surface.
* ``checkpoint`` and ``pruned``: a *replace*. Their payload names the seqs they replace, which must
  be a contiguous run of the surface; the new node takes the position of the first of them.
* ``compaction/start``, ``compaction/prune``, ``compaction/summary``, ``compaction/end``: journal
  entries. They never touch the surface.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from storage.kinds import REPLACE_KINDS, NodeKind
from storage.messages import Message


@dataclass(frozen=True, slots=True)
class SurfaceNode:
    """One node of the surface: a message, a checkpoint or a pruned tool result."""

    seq: int
    kind: str
    message: Message
    tokens: int
    position: int = 0

    @property
    def role(self) -> str:
        return self.message.role

    @property
    def meta(self) -> dict[str, Any]:
        return self.message.meta


@dataclass(frozen=True, slots=True)
class Surface:
    session_id: str
    version: int
    nodes: tuple[SurfaceNode, ...]

    @property
    def tokens(self) -> int:
        return sum(n.tokens for n in self.nodes)

    @property
    def seqs(self) -> list[int]:
        return [n.seq for n in self.nodes]


@dataclass(frozen=True, slots=True)
class LoggedEvent:
    """An event as replay needs it."""

    seq: int
    kind: str
    tokens: int | None = None
    replaces: tuple[int, ...] = ()
    payload: dict[str, Any] = field(default_factory=dict)


class ReplayError(ValueError):
    """The log holds a replace that does not fit the surface it was applied to."""


def check_contiguous(order: Sequence[int], seqs: Sequence[int]) -> int:
    """Index in ``order`` where the run ``seqs`` starts; raise if it is not a contiguous run."""
    if not seqs:
        raise ReplayError("a replace must name at least one seq")
    try:
        start = order.index(seqs[0])
    except ValueError:
        raise ReplayError(f"seq {seqs[0]} is not on the surface") from None
    if list(order[start:start + len(seqs)]) != list(seqs):
        raise ReplayError(f"seqs {list(seqs)} are not a contiguous run of the surface")
    return start


def replay(events: Iterable[LoggedEvent]) -> list[tuple[int, int]]:
    """The surface the log describes, as ``(seq, tokens)`` in order."""
    order: list[int] = []
    tokens: dict[int, int] = {}
    for event in events:
        if event.kind == NodeKind.MESSAGE:
            order.append(event.seq)
        elif event.kind in REPLACE_KINDS:
            start = check_contiguous(order, event.replaces)
            order[start:start + len(event.replaces)] = [event.seq]
        else:
            continue
        tokens[event.seq] = int(event.tokens or 0)
    return [(seq, tokens[seq]) for seq in order]


def commit_seqs(last_seq: int, count: int) -> list[tuple[int, int]]:
    """The ``(journal, node)`` seqs a commit of ``count`` replacements takes after ``last_seq``:
    each replacement's journal entry directly before its node."""
    return [(last_seq + 2 * i + 1, last_seq + 2 * i + 2) for i in range(count)]


@dataclass(frozen=True, slots=True)
class NewNode:
    """What one replacement of a commit puts on the surface (its seq comes from the commit)."""

    replaces: tuple[int, ...]
    kind: str
    message: Message
    tokens: int


def surface_after_commit(surface: Surface, new_nodes: Sequence[NewNode], *, version: int,
                         last_seq: int) -> Surface | None:
    """``surface`` with a commit of ``new_nodes`` applied, without reading it back.

    ``version`` and ``last_seq`` are the session's as that commit (one without an end event)
    returned them. Each new node takes the seq :func:`commit_seqs` gave it and the position of
    the first node it replaces; the other positions do not move. None when a writer other than
    that commit moved the surface since ``surface`` was read (the version is not one past it):
    the caller reads the surface instead.
    """
    if version != surface.version + 1:
        return None
    seqs = commit_seqs(last_seq - 2 * len(new_nodes), len(new_nodes))
    first: dict[int, tuple[int, NewNode]] = {}
    gone: set[int] = set()
    for new, (_, seq) in zip(new_nodes, seqs, strict=True):
        first[new.replaces[0]] = (seq, new)
        gone.update(new.replaces)
    nodes: list[SurfaceNode] = []
    for node in surface.nodes:
        if node.seq in first:
            seq, new = first[node.seq]
            nodes.append(SurfaceNode(seq=seq, kind=new.kind, message=new.message,
                                     tokens=new.tokens, position=node.position))
        elif node.seq not in gone:
            nodes.append(node)
    return Surface(session_id=surface.session_id, version=version, nodes=tuple(nodes))
