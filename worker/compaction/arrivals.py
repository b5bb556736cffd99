"""What the agent appends while a run works: the keep measured at the pickup.

Out of band, the tail the agent holds when it picks a checkpoint up is the kept tail plus every
step it appended between the run's read and its own next read of the surface, and all of it
follows the changed prefix, so all of it is re-sent uncached. Under ``keep_at: pickup`` a run
keeps less by what it expects to arrive, so that the tail at the pickup is what the policy's
keep asked for; under ``keep_at: claim`` it keeps the policy's tail as it stands at the read.

What arrives is what the agent appends from the read to the commit, and then the step it
appends before the poll that sees the commit: a runtime appends a step and then reads the
surface for its next request, so the first read after the commit comes with one whole step
more. The wait from the commit to that read is half a step interval on average, but what it
adds to the tail is not half a step: it is the whole step appended before the read, whatever
the phase the commit fell in.

The appends to the commit are measured on the session's own recent appends, as they happened
(:func:`append_cadence`): the typical time between them (:func:`typical_interval`) and the
median append, so the count and the size come from the same window, and neither one idle pause
nor one large observation sets them. A session with too few appends to measure, or one that
has paused for several of its intervals, is expected to grow at its growth rate instead
(:func:`expected_arrivals`): the append's long-window average, which for a session tens of
seconds old holds a fraction of its true rate, converted to messages at its recent mean
message size.

The expectation is an input (:class:`Arrivals`), computed by the orchestration from the
session's appends (or growth rate) and a recent percentile of claim-to-commit durations (both
read from storage); this module only does the arithmetic, and never moves a cut past what
:func:`worker.compaction.boundary.select_range` allows: the kept clause only gets smaller,
the selection rules (protected nodes, tool-pair-safe cuts) apply to it unchanged.
"""

from __future__ import annotations

import datetime as dt
import itertools
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from compactd.storage.counters import MESSAGES, TOKENS, Counter
from compactd.storage.messages import META_CHECKPOINT
from compactd.storage.records import AppendedMessage
from compactd.storage.surface import SurfaceNode
from compactd.worker.compaction.lead import percentile as nearest_rank
from compactd.worker.compaction.policy import Clause

# The claim-to-commit duration a run expects: a high percentile of recent runs', since the
# pickup comes after the commit (at the agent's next step), and expecting too little growth
# only leaves the tail a little larger than asked, as keep_at: claim does.
CLAIM_TO_COMMIT_PERCENTILE = 0.75
# The recent messages a session's tokens per message are measured over: about the steps a
# run spans, so a session whose steps grew (long tool results) converts at their size; the
# session's appends are read over as many of its newest messages, for the same reason.
RECENT_MESSAGES = 32
# The fewest intervals between appends a session's cadence is measured on: with fewer, one
# quick or slow step would set it, and the growth rate is the better guess.
MIN_APPEND_INTERVALS = 4
# The fewest intervals whose adjacent means are medianed (``typical_interval``): enough that
# the two means one pause moves stay a minority.
MIN_PAIRED_INTERVALS = 6
# How many of its intervals a session may go without an append and still be read as stepping
# at its cadence: past that it has paused (a user reading, a long tool call), and what it
# still grows by is what its decayed growth rate says.
IDLE_INTERVALS = 8
# Arrivals.measure: what the appends to the commit were counted from.
MEASURE_APPENDS = "appends"
MEASURE_GROWTH_RATE = "growth_rate"


@dataclass(frozen=True, slots=True)
class Step:
    """The mean size of the session's recent steps: what an agent appends at once."""

    tokens: float
    messages: float


@dataclass(frozen=True, slots=True)
class Cadence:
    """How a session has been appending: the typical seconds between its recent appends and
    its median append, measured on the same appends."""

    interval_s: float
    append: Step
    intervals: int  # how many it was measured on
    last_at: dt.datetime  # the newest append's time

    def stepping_at(self, now: dt.datetime) -> bool:
        """Whether the session is still appending at this cadence at ``now``."""
        return (now - self.last_at).total_seconds() <= IDLE_INTERVALS * self.interval_s


@dataclass(frozen=True, slots=True)
class Arrivals:
    """What a run expects the agent to append between the run's read and the pickup."""

    tokens: int
    messages: int
    seconds: float  # the expected claim-to-commit duration
    rate_tokens_per_s: float  # the session's growth rate at the claim, as measured
    # The step the agent appends after the commit, before the read that picks it up.
    pickup_step: Step = Step(0.0, 0.0)
    measure: str = MEASURE_GROWTH_RATE
    cadence: Cadence | None = None  # the appends measured (measure "appends")

    def count(self, counter: Counter) -> int:
        """What the arrivals add to ``counter``: none expected to a counter kept by name (its
        keep is kept at the claim)."""
        if counter is TOKENS:
            return self.tokens
        if counter is MESSAGES:
            return self.messages
        return 0

    def to_json(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "messages": self.messages,
                "claim_to_commit_s": round(self.seconds, 3),
                "rate_tokens_per_s": round(self.rate_tokens_per_s, 2),
                "pickup_step": {"tokens": round(self.pickup_step.tokens),
                                "messages": round(self.pickup_step.messages, 2)},
                "measure": self.measure,
                "append_interval_s": (round(self.cadence.interval_s, 3)
                                      if self.cadence is not None else None),
                "appends_measured": (self.cadence.intervals
                                     if self.cadence is not None else None)}


def claim_to_commit_s(durations: Sequence[float],
                      percentile: float = CLAIM_TO_COMMIT_PERCENTILE) -> float | None:
    """The ``percentile`` of ``durations`` (seconds, any order; nearest rank), None when there
    are none: with no run to learn from, a run keeps at the claim."""
    usable = [d for d in durations if math.isfinite(d) and d >= 0]
    return nearest_rank(usable, percentile) if usable else None


def _recent_conversation(nodes: Sequence[SurfaceNode], recent: int) -> list[SurfaceNode]:
    """The newest ``recent`` conversation messages, oldest first (system messages and
    checkpoints are not what an agent appends)."""
    found: list[SurfaceNode] = []
    for node in reversed(nodes):
        if len(found) >= recent:
            break
        if node.message.role == "system" or node.message.meta.get(META_CHECKPOINT):
            continue
        found.append(node)
    return found[::-1]


def tokens_per_message(nodes: Sequence[SurfaceNode], recent: int = RECENT_MESSAGES
                       ) -> float | None:
    """Mean tokens of the session's newest ``recent`` conversation messages, None when there
    are none."""
    sizes = [node.tokens for node in _recent_conversation(nodes, recent)]
    return sum(sizes) / len(sizes) if sizes and sum(sizes) > 0 else None


def recent_step(nodes: Sequence[SurfaceNode], recent: int = RECENT_MESSAGES) -> Step | None:
    """The mean step over the newest ``recent`` conversation messages: a step is an assistant
    message and what follows it up to the next one (its tool results, the user's reply), as a
    runtime appends them; a conversation with no assistant message steps a message at a time.
    None when there is no conversation message."""
    found = _recent_conversation(nodes, recent)
    if not found:
        return None
    steps = sum(1 for node in found if node.message.role == "assistant") or len(found)
    return Step(tokens=sum(node.tokens for node in found) / steps,
                messages=len(found) / steps)


def expected_arrivals(rate_tokens_per_s: float, seconds: float,
                      nodes: Sequence[SurfaceNode]) -> Arrivals:
    """Tokens the session grows by in ``seconds`` at its rate, as messages at its recent tokens
    per message, and the step appended before the pickup at its recent step size (the messages
    rounded to the nearest: the expectation is no better than a message)."""
    rate, span = _measured(rate_tokens_per_s), _measured(seconds)
    grown = rate * span
    per_message = tokens_per_message(nodes)
    step = recent_step(nodes) or Step(0.0, 0.0)
    messages = (grown / per_message if per_message else 0.0) + step.messages
    return Arrivals(tokens=round(grown + step.tokens), messages=round(messages), seconds=span,
                    rate_tokens_per_s=rate, pickup_step=step)


def append_cadence(appended: Sequence[AppendedMessage],
                   min_intervals: int = MIN_APPEND_INTERVALS) -> Cadence | None:
    """The cadence of the appends ``appended`` holds (a session's newest messages, oldest
    first): the messages of one append share its time. Medians, so that one idle pause does
    not stretch the interval and one large observation does not swell the append; None with
    fewer than ``min_intervals`` intervals, or appends all in one instant (an ingest)."""
    appends = [(at, list(messages))
               for at, messages in itertools.groupby(appended, key=lambda m: m.at)]
    if len(appends) <= max(1, min_intervals):
        return None
    intervals = [max(0.0, (later - earlier).total_seconds())
                 for (earlier, _), (later, _) in itertools.pairwise(appends)]
    interval = typical_interval(intervals)
    if interval <= 0:
        return None
    # The oldest append only starts the first interval: the read's limit may have cut it.
    measured = [messages for _, messages in appends[1:]]
    return Cadence(interval_s=interval,
                   append=Step(tokens=statistics.median(sum(m.tokens for m in ms)
                                                        for ms in measured),
                               messages=statistics.median(len(ms) for ms in measured)),
                   intervals=len(intervals), last_at=appends[-1][0])


def typical_interval(intervals: Sequence[float]) -> float:
    """The median of the means of adjacent ``intervals``: a runtime that appends a step's
    messages one at a time (the model's reply, then its tool's result) alternates short and
    long intervals, whose plain median is one or the other while their mean is its step's; one
    idle pause still moves only two of the means. With too few intervals for that (a pause
    would move most of the means), their plain median."""
    if len(intervals) < MIN_PAIRED_INTERVALS:
        return statistics.median(intervals)
    return statistics.median((a + b) / 2 for a, b in itertools.pairwise(intervals))


def arrivals_at_cadence(cadence: Cadence, seconds: float) -> Arrivals:
    """The appends the session makes in ``seconds`` at its cadence, and the one before the
    pickup, each the session's median append."""
    span = _measured(seconds)
    appends = span / cadence.interval_s + 1
    step = cadence.append
    return Arrivals(tokens=round(appends * step.tokens), messages=round(appends * step.messages),
                    seconds=span, rate_tokens_per_s=step.tokens / cadence.interval_s,
                    pickup_step=step, measure=MEASURE_APPENDS, cadence=cadence)


def _measured(value: float) -> float:
    """``value`` as a quantity a clock or a counter could have measured (none below zero)."""
    return max(0.0, value) if math.isfinite(value) else 0.0


def keep_at_pickup(keep: Clause, arrivals: Arrivals, context_window: int | None) -> Clause:
    """The clause to keep at the read so the tail at the pickup is ``keep``: a count less the
    messages expected, a token budget (a ``fraction`` is one, of the window) less the tokens
    expected; never below zero."""
    counter = keep.measure.counter
    budget = keep.threshold(context_window) or 0
    return Clause(counter.name, max(0, math.floor(budget) - arrivals.count(counter)))
