"""The surface: the ordered projection of the event log that the model sees.

Plain data and pure functions only (no SQL): the policy reads these types, and ``replay`` is the
reference definition of the projection that ``compactd verify`` checks the stored rows against.

Event kinds:

* ``message``: appended by the runtime; adds a node at the end of the surface.
* ``checkpoint`` and ``pruned``: a *replace*. Their payload names the seqs they replace, which must
  be a contiguous run of the surface; the new node takes the position of the first of them.
  Two placements change where it goes (the ``recallable`` layout's commits need them), each
  recorded in the payload beside ``replaces``:

  - ``before: X``: the new node goes directly before node X, which must directly precede the
    replaced run. X moves to the run's first position and the new node takes X's old one (a
    swap: no free position is needed).
  - ``after: Y`` with nothing replaced: an insert into the free position directly after node Y
    (a position a replace left free: a run of two or more nodes frees all but its first).

  X and Y name a node on the surface, or a node replaced earlier in the same commit, which
  then means the node that replaced it (a commit cannot know the seqs it is about to give).

  A replace may also name ``keeps``: nodes inside its run that it leaves where they are (the
  latest user request, a reminder: the nodes the policy rescues from a summarized range). The
  replaced seqs and the kept ones together must be the contiguous run; the kept nodes stay in
  their positions and order, and the new node takes the first position after the last of them
  (the first position of the last stretch it replaces), so it follows every node it leaves.
* ``compaction/start``, ``compaction/prune``, ``compaction/summary``, ``compaction/end``: journal
  entries. They never touch the surface.

Positions are integers: an append takes the next one after every append before it, and a
replace frees the positions of the run it replaced but its first. :class:`SurfaceRows` applies
replaces to positioned rows, one at a time, and is the one definition of where a node goes:
``replay``, ``surface_after_commit`` and the SQLite commit use it, and ``compactd_commit`` does
the same steps in SQL.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from compactd.storage.kinds import REPLACE_KINDS, NodeKind
from compactd.storage.messages import Message


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
    before: int | None = None
    after: int | None = None
    keeps: tuple[int, ...] = ()


class ReplayError(ValueError):
    """The log holds a replace that does not fit the surface it was applied to."""


class PlacementError(ReplayError):
    """A replace that does not fit the surface. ``what`` says how: ``order`` (a seq is not on
    the surface, or not in that order), ``contiguous`` (another node lies inside the run),
    ``before`` (the node to go before does not directly precede the run), ``after`` (no free
    position directly after that node). A kept node that is not inside the run is ``order``."""

    def __init__(self, what: str, message: str) -> None:
        super().__init__(message)
        self.what = what


class SurfaceRows:
    """Positioned rows ``(position, seq, tokens)``, changed by one replace at a time.

    A window of the surface serves as well as all of it (the SQLite commit reads the rows from
    the first position a commit names to one past the last), since a replace reads and writes
    only positions between those it names and the one after them.
    """

    def __init__(self, rows: Iterable[tuple[int, int, int]] = ()) -> None:
        self._positions: list[int] = []
        self._seq_at: dict[int, int] = {}
        self._position_of: dict[int, int] = {}
        self._tokens: dict[int, int] = {}
        # Each seq replaced through this object -> the node that replaced it.
        self._holder: dict[int, int] = {}
        for position, seq, tokens in sorted(rows):
            self.add(position, seq, tokens)

    def add(self, position: int, seq: int, tokens: int) -> None:
        """Put a node at a free position (an append, or a row read from storage)."""
        if position in self._seq_at or seq in self._position_of:
            raise ReplayError(f"seq {seq} at position {position} collides with the surface")
        bisect.insort(self._positions, position)
        self._seq_at[position] = seq
        self._position_of[seq] = position
        self._tokens[seq] = tokens

    def _drop(self, seq: int) -> tuple[int, int]:
        position = self._position_of.pop(seq)
        del self._positions[bisect.bisect_left(self._positions, position)]
        del self._seq_at[position]
        return position, self._tokens.pop(seq)

    def _count(self, first: int, last: int) -> int:
        """Rows at positions ``first..last``, both included."""
        return (bisect.bisect_right(self._positions, last)
                - bisect.bisect_left(self._positions, first))

    def holding(self, seq: int) -> int | None:
        """The node standing for ``seq``: itself if on the surface, else the node that
        replaced it here, if that one is."""
        if seq in self._position_of:
            return seq
        holder = self._holder.get(seq)
        return holder if holder in self._position_of else None

    def replace(self, seq: int, tokens: int, replaces: Sequence[int], *,
                before: int | None = None, after: int | None = None,
                keeps: Sequence[int] = ()) -> int:
        """Apply the replace that puts node ``seq`` on the surface; its position. Raises
        :class:`PlacementError`, changing nothing, when it does not fit."""
        if before is not None and after is not None:
            raise PlacementError("before", "a node is placed before one node or after one, "
                                           "not both")
        if keeps:
            if before is not None or after is not None:
                raise PlacementError("order", "a replace that keeps nodes is not placed")
            at = self._split_run(replaces, keeps)
            self._replace_run(seq, tokens, replaces, at)
            return at
        if after is not None:
            return self._insert_after(seq, tokens, replaces, after)
        first = self._run(replaces)
        if before is None:
            self._replace_run(seq, tokens, replaces, first)
            return first
        holder = self.holding(before)
        x = self._position_of.get(holder) if holder is not None else None
        if x is None or x >= first or self._count(x, first) != 2:
            raise PlacementError("before", f"seq {before} does not directly precede seqs "
                                           f"{list(replaces)}")
        assert holder is not None
        self._replace_run(seq, tokens, replaces, None)
        _, held = self._drop(holder)
        self.add(first, holder, held)
        self.add(x, seq, tokens)
        return x

    def _run(self, replaces: Sequence[int]) -> int:
        """The first position of the run ``replaces``, which must be on the surface, in that
        order, with no other node inside it."""
        first = self._run_positions(replaces)
        if self._count(first, self._position_of[replaces[-1]]) != len(replaces):
            raise PlacementError("contiguous", f"seqs {list(replaces)} are not a contiguous "
                                               "run of the surface")
        return first

    def _split_run(self, replaces: Sequence[int], keeps: Sequence[int]) -> int:
        """Where the node of a replace keeping ``keeps`` goes: the first replaced position after
        the last kept node. ``replaces`` must be on the surface in that order, the kept nodes
        strictly inside their run, and the two together the whole run."""
        first = self._run_positions(replaces)
        last = self._position_of[replaces[-1]]
        kept = [self._position_of.get(q) for q in keeps]
        if any(p is None or not first < p < last for p in kept):
            raise PlacementError("order", f"seqs {list(keeps)} are not on the surface inside "
                                          f"the run of seqs {list(replaces)}")
        if len(set(keeps)) != len(keeps) or (
                self._count(first, last) != len(replaces) + len(keeps)):
            raise PlacementError("contiguous", f"seqs {list(replaces)} and the kept "
                                               f"{list(keeps)} are not a contiguous run of "
                                               "the surface")
        after_kept = max(p for p in kept if p is not None)
        return min(self._position_of[q] for q in replaces
                   if self._position_of[q] > after_kept)

    def _run_positions(self, replaces: Sequence[int]) -> int:
        """The first position of ``replaces``, which must be on the surface in that order."""
        if not replaces:
            raise PlacementError("order", "a replace must name at least one seq")
        positions = []
        for q in replaces:
            p = self._position_of.get(q)
            if p is None:
                raise PlacementError("order", f"seq {q} is not on the surface")
            positions.append(p)
        if any(a >= b for a, b in itertools.pairwise(positions)):
            raise PlacementError("order", f"seqs {list(replaces)} are not on the surface in "
                                          "that order")
        return positions[0]

    def _replace_run(self, seq: int, tokens: int, replaces: Sequence[int],
                     at: int | None) -> None:
        for q in replaces:
            self._drop(q)
            self._holder[q] = seq
        if at is not None:
            self.add(at, seq, tokens)

    def _insert_after(self, seq: int, tokens: int, replaces: Sequence[int], after: int) -> int:
        if replaces:
            raise PlacementError("after", "a node placed after another replaces nothing")
        holder = self.holding(after)
        if holder is None:
            raise PlacementError("after", f"seq {after} is not on the surface")
        position = self._position_of[holder] + 1
        if position in self._seq_at:
            raise PlacementError("after", f"no free position directly after seq {holder}")
        self.add(position, seq, tokens)
        return position

    def rows(self) -> list[tuple[int, int, int]]:
        """``(position, seq, tokens)`` in order."""
        return [(p, self._seq_at[p], self._tokens[self._seq_at[p]]) for p in self._positions]


def replay(events: Iterable[LoggedEvent]) -> list[tuple[int, int]]:
    """The surface the log describes, as ``(seq, tokens)`` in order."""
    rows = SurfaceRows()
    appended = 0
    for event in events:
        tokens = int(event.tokens or 0)
        if event.kind == NodeKind.MESSAGE:
            appended += 1
            rows.add(appended, event.seq, tokens)
        elif event.kind in REPLACE_KINDS:
            rows.replace(event.seq, tokens, event.replaces, before=event.before,
                         after=event.after, keeps=event.keeps)
    return [(seq, tokens) for _, seq, tokens in rows.rows()]


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
    before: int | None = None
    after: int | None = None
    keeps: tuple[int, ...] = ()


def surface_after_commit(surface: Surface, new_nodes: Sequence[NewNode], *, version: int,
                         last_seq: int) -> Surface | None:
    """``surface`` with a commit of ``new_nodes`` applied, without reading it back.

    ``version`` and ``last_seq`` are the session's as that commit (one without an end event)
    returned them. Each new node takes the seq :func:`commit_seqs` gave it and its place as
    :class:`SurfaceRows` puts it. None when a writer other than that commit moved the surface
    since ``surface`` was read (the version is not one past it): the caller reads the surface
    instead.
    """
    if version != surface.version + 1:
        return None
    seqs = commit_seqs(last_seq - 2 * len(new_nodes), len(new_nodes))
    rows = SurfaceRows((n.position, n.seq, n.tokens) for n in surface.nodes)
    added: dict[int, NewNode] = {}
    try:
        for new, (_, seq) in zip(new_nodes, seqs, strict=True):
            rows.replace(seq, new.tokens, new.replaces, before=new.before, after=new.after,
                         keeps=new.keeps)
            added[seq] = new
    except PlacementError:
        return None  # not what the commit did: read what it did
    known = {node.seq: node for node in surface.nodes}
    nodes: list[SurfaceNode] = []
    for position, seq, tokens in rows.rows():
        made = added.get(seq)
        if made is not None:
            nodes.append(SurfaceNode(seq=seq, kind=made.kind, message=made.message,
                                     tokens=made.tokens, position=position))
        else:
            node = known[seq]
            nodes.append(node if node.position == position else SurfaceNode(
                seq=seq, kind=node.kind, message=node.message, tokens=tokens,
                position=position))
    return Surface(session_id=surface.session_id, version=version, nodes=tuple(nodes))
