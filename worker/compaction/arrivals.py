"""What the agent appends while a run works: the keep measured at the pickup.

Out of band, the tail the agent holds when it picks a checkpoint up is the kept tail plus every
step it appended between the run's read and its own next read of the surface, and all of it
follows the changed prefix, so all of it is re-sent uncached. Under ``keep_at: pickup`` a run
keeps less by what it expects to arrive, so that the tail at the pickup is what the policy's
keep asked for; under ``keep_at: claim`` it keeps the policy's tail as it stands at the read.

What arrives is what the agent appends from the read to the commit, at the session's growth
rate, and then the step it appends before the poll that sees the commit: a runtime appends a
step and then reads the surface for its next request, so the first read after the commit comes
with one whole step more. The wait from the commit to that read is half a step interval on
average, but what it adds to the tail is not half a step: it is the whole step appended before
the read, whatever the phase the commit fell in.

The expectation is an input (:class:`Arrivals`), computed by the orchestration from the
session's growth rate and a recent percentile of claim-to-commit durations (both read from
storage); this module only does the arithmetic, and never moves a cut past what
:func:`worker.compaction.boundary.select_range` allows: the kept clause only gets smaller,
the selection rules (protected nodes, tool-pair-safe cuts) apply to it unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from compactd.storage.counters import MESSAGES, TOKENS, Counter
from compactd.storage.messages import META_CHECKPOINT
from compactd.storage.surface import SurfaceNode
from compactd.worker.compaction.lead import percentile as nearest_rank
from compactd.worker.compaction.policy import Clause

# The claim-to-commit duration a run expects: a high percentile of recent runs', since the
# pickup comes after the commit (at the agent's next step), and expecting too little growth
# only leaves the tail a little larger than asked, as keep_at: claim does.
CLAIM_TO_COMMIT_PERCENTILE = 0.75
# The recent messages a session's tokens per message are measured over: about the steps a
# run spans, so a session whose steps grew (long tool results) converts at their size.
RECENT_MESSAGES = 32


@dataclass(frozen=True, slots=True)
class Step:
    """The mean size of the session's recent steps: what an agent appends at once."""

    tokens: float
    messages: float


@dataclass(frozen=True, slots=True)
class Arrivals:
    """What a run expects the agent to append between the run's read and the pickup."""

    tokens: int
    messages: int
    seconds: float  # the expected claim-to-commit duration
    rate_tokens_per_s: float  # the session's growth rate at the claim
    # The step the agent appends after the commit, before the read that picks it up.
    pickup_step: Step = Step(0.0, 0.0)

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
                                "messages": round(self.pickup_step.messages, 2)}}


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
    rate = max(0.0, rate_tokens_per_s) if math.isfinite(rate_tokens_per_s) else 0.0
    span = max(0.0, seconds) if math.isfinite(seconds) else 0.0
    grown = rate * span
    per_message = tokens_per_message(nodes)
    step = recent_step(nodes) or Step(0.0, 0.0)
    messages = (grown / per_message if per_message else 0.0) + step.messages
    return Arrivals(tokens=round(grown + step.tokens), messages=round(messages), seconds=span,
                    rate_tokens_per_s=rate, pickup_step=step)
def keep_at_pickup(keep: Clause, arrivals: Arrivals, context_window: int | None) -> Clause:
    """The clause to keep at the read so the tail at the pickup is ``keep``: a count less the
    messages expected, a token budget (a ``fraction`` is one, of the window) less the tokens
    expected; never below zero."""
    counter = keep.measure.counter
    budget = keep.threshold(context_window) or 0
    return Clause(counter.name, max(0, math.floor(budget) - arrivals.count(counter)))
