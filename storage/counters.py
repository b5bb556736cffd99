"""What a session keeps counted for its trigger and keep kinds: one :class:`Counter` object per
count, registered in :data:`COUNTERS` by name.

A counter says what one message adds to it (:meth:`Counter.of`), computed in Python where the
message is parsed: at the append (``storage.store.prepare_append``), for a commit's new nodes,
and by the plan on the surface it read. ``tokens`` and ``messages`` are kept in columns of
their own (``sessions.surface_tokens`` and ``surface_messages``, the sweep's
``sweep_tokens``/``sweep_messages``), which the pressure and the stored ``over_sweep`` flag
are built on. Every other counter is kept generically, by name, in JSON the SQL sums without
knowing the names: each surface row holds what its node adds (``surface.counts``), the session
row the sum (``sessions.counts``), the sweep's floors (``sessions.sweep_counts``) and whether
some count reaches its floor (``sessions.over_counts``, the sweep's second index). A new
counter is therefore its object and a line registering it: no column, no SQL, no migration.
Adding a counter to a deployment with live sessions: a session appended to before it was
registered counts only what came after. Its surface rows from before hold no count of it, and
the commits re-sum ``sessions.counts`` from those rows, so the stored count (the append's signal
and the sweep's flag) stays short by what those rows add until they leave the surface (replaced
by a run, whose new nodes are counted). The plan counts the surface it read, so a run that does
start measures exactly. The error is late, never early: the new kind fires after its
threshold on such a session, and the other kinds of its policy are unaffected (a policy that
gives the new kind beside a ``tokens`` trigger keeps the sessions from overflowing meanwhile).
There is no backfill: a name left out of ``counts`` is 0, so a row counted before the
registration cannot be told from one that adds nothing without a record of which counters
each session has counted, and re-counting every surface row of every session would read each
stored message again to make a trigger fire sooner on sessions that will compact anyway by their
other triggers. A deployment that needs the new count closer on old sessions compacts them
(``compactd compact``) after the release: all but the kept tail is then counted.

No I/O.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, ClassVar

from compactd.storage.messages import Message, from_payload

# What the stored JSON of counts is: counter name -> a non-zero count (a name left out is 0).
Counts = dict[str, int]


class Counter(ABC):
    """One count a session keeps. The kind of the same name measures it as it is."""

    name: ClassVar[str]
    # The sessions columns of a counter kept in columns of its own: its count and the sweep's
    # floor of it (None: kept by name in ``sessions.counts`` and ``sessions.sweep_counts``).
    column: ClassVar[str | None] = None
    floor_column: ClassVar[str | None] = None

    @abstractmethod
    def of(self, message: Message, tokens: int) -> int:
        """What ``message`` (``tokens`` tokens as the session's run model counts it) adds to
        the count when it is on the surface."""

    def __repr__(self) -> str:
        return f"<counter {self.name}>"


class Tokens(Counter):
    """The surface's tokens: with the envelope, or the provider's report when it is larger,
    the pressure (``worker.compaction.triggers``)."""

    name = "tokens"
    column = "surface_tokens"
    floor_column = "sweep_tokens"

    def of(self, message: Message, tokens: int) -> int:
        return tokens


class Messages(Counter):
    """The surface's nodes (a checkpoint is one)."""

    name = "messages"
    column = "surface_messages"
    floor_column = "sweep_messages"

    def of(self, message: Message, tokens: int) -> int:
        return 1


TOKENS = Tokens()
MESSAGES = Messages()

# The registry, in the order a sweep floors an AND group on (``Policy.trigger_floors``).
COUNTERS: dict[str, Counter] = {counter.name: counter for counter in (TOKENS, MESSAGES)}


def kept_by_name() -> list[Counter]:
    """The registered counters kept in ``counts`` (not in a column of their own)."""
    return [counter for counter in COUNTERS.values() if counter.column is None]


def floor_values(floors: Mapping[str, int | None]) -> dict[str, Any]:
    """``floors`` (one per registered counter, None: never by that counter) as the sessions
    columns the sweep reads: a column of its own, else by name in ``sweep_counts``. A counter
    left out, or one not registered, is an error rather than a floor never stored."""
    if set(floors) != set(COUNTERS):
        raise ValueError(f"sweep floors are given for {sorted(floors)}, the registered "
                         f"counters are {sorted(COUNTERS)}")
    values: dict[str, Any] = {}
    by_name: Counts = {}
    for name, counter in COUNTERS.items():
        floor = floors[name]
        if counter.floor_column is not None:
            values[counter.floor_column] = floor
        elif floor is not None:
            by_name[name] = floor
    values["sweep_counts"] = by_name or None
    return values


def counts_of(message: Message, tokens: int, counters: Iterable[Counter] | None = None
              ) -> Counts | None:
    """What ``message`` adds to each counter kept by name, its zero counts left out; None when
    it adds to none (what ``surface.counts`` holds then)."""
    counts = {c.name: n for c in (kept_by_name() if counters is None else counters)
              if (n := c.of(message, tokens))}
    return counts or None


def node_counts(payload: Mapping[str, Any], tokens: int) -> Counts | None:
    """:func:`counts_of` a node a commit writes (its message's stored payload)."""
    counters = kept_by_name()
    return counts_of(from_payload(payload), tokens, counters) if counters else None


def batch_counts(messages: Sequence[Message], tokens: Sequence[int]
                 ) -> tuple[list[Counts | None], Counts | None]:
    """Each message's counts (:func:`counts_of`) and their sum: ``([], None)`` when no counter
    is kept by name, so a batch then costs nothing here."""
    counters = kept_by_name()
    if not counters:
        return [], None
    each = [counts_of(m, n, counters) for m, n in zip(messages, tokens, strict=True)]
    return each, summed(each)


def summed(counts: Iterable[Mapping[str, int] | None]) -> Counts | None:
    """The sum of ``counts`` by name, its zeros left out; None when nothing is left. The
    PostgreSQL form is ``compactd_counts_sum_v1`` (storage/sql/functions)."""
    total: Counts = {}
    for one in counts:
        for name, n in (one or {}).items():
            total[name] = total.get(name, 0) + int(n)
    return {name: n for name, n in sorted(total.items()) if n} or None


def reaches(counts: Mapping[str, int] | None, floors: Mapping[str, int] | None) -> bool:
    """Whether some count reaches its floor (a count left out is 0): the stored
    ``over_counts``. The PostgreSQL form is ``compactd_counts_reach_v1``."""
    have = counts or {}
    return any(int(have.get(name, 0)) >= int(floor) for name, floor in (floors or {}).items())
