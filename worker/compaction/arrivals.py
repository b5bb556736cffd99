"""What the agent appends while a run works: the keep measured at the pickup.

Out of band, the tail the agent holds when it picks a checkpoint up is the kept tail plus every
step it appended between the run's read and its own next read of the surface, and all of it
follows the changed prefix, so all of it is re-sent uncached. Under ``keep_at: pickup`` a run
keeps less by what it expects to arrive, so that the tail at the pickup is what the policy's
keep asked for; under ``keep_at: claim`` it keeps the policy's tail as it stands at the read.

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
class Arrivals:
    """What a run expects the agent to append between the run's read and the pickup."""

    tokens: int
    messages: int
    seconds: float  # the expected claim-to-commit duration
    rate_tokens_per_s: float  # the session's growth rate at the claim

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
                "rate_tokens_per_s": round(self.rate_tokens_per_s, 2)}


def claim_to_commit_s(durations: Sequence[float],
                      percentile: float = CLAIM_TO_COMMIT_PERCENTILE) -> float | None:
    """The ``percentile`` of ``durations`` (seconds, any order; nearest rank), None when there
    are none: with no run to learn from, a run keeps at the claim."""
    usable = [d for d in durations if math.isfinite(d) and d >= 0]
    return nearest_rank(usable, percentile) if usable else None


def tokens_per_message(nodes: Sequence[SurfaceNode], recent: int = RECENT_MESSAGES
                       ) -> float | None:
    """Mean tokens of the session's newest ``recent`` conversation messages (system messages
    and checkpoints are not what an agent appends), None when there are none."""
    sizes: list[int] = []
    for node in reversed(nodes):
        if len(sizes) >= recent:
            break
        meta = node.message.meta
        if node.message.role == "system" or meta.get(META_CHECKPOINT):
            continue
        sizes.append(node.tokens)
    return sum(sizes) / len(sizes) if sizes and sum(sizes) > 0 else None


def expected_arrivals(rate_tokens_per_s: float, seconds: float,
                      nodes: Sequence[SurfaceNode]) -> Arrivals:
    """Tokens the session grows by in ``seconds`` at its rate, and as messages at its recent
    tokens per message (rounded to the nearest: the expectation is no better than a message)."""
    rate = max(0.0, rate_tokens_per_s) if math.isfinite(rate_tokens_per_s) else 0.0
    span = max(0.0, seconds) if math.isfinite(seconds) else 0.0
    tokens = rate * span
    per_message = tokens_per_message(nodes)
    messages = round(tokens / per_message) if per_message else 0
    return Arrivals(tokens=round(tokens), messages=messages, seconds=span,
                    rate_tokens_per_s=rate)


def keep_at_pickup(keep: Clause, arrivals: Arrivals, context_window: int | None) -> Clause:
    """The clause to keep at the read so the tail at the pickup is ``keep``: a count less the
    messages expected, a token budget (a ``fraction`` is one, of the window) less the tokens
    expected; never below zero."""
    counter = keep.measure.counter
    budget = keep.threshold(context_window) or 0
    return Clause(counter.name, max(0, math.floor(budget) - arrivals.count(counter)))
