"""When a session that a run could not bring under its trigger is worth a run again. Pure.

A trigger below what a compaction can reach (the kept tail alone, or with the envelope, over
it: a long observation among the kept messages, a large system prompt) leaves the session over
its trigger after every run, and every append would fire another. Runs then change nothing
(:func:`worker.compaction.cache_breaks.summary_wasted` asks for no summary), but each is a
claim, a read and a plan. So such a run names the growth after which the next could: the kept
tail has let go of enough of its oldest messages, replaced by steps of the session's usual size,
for a run to bring the session under its trigger; or, when no turnover of the tail can (the
keep of usual steps and the rest are over the trigger by themselves), the growth after which
a summary frees what a break of the agent's cache costs (``clear_at_least``).

A run the lead fired early whose kept tail holds a long message
(:data:`worker.compaction.lead.EARLY_WAIT_SHARE`) names the growth after which the tail has let
it go, before the session reaches its trigger (:func:`early_refire_growth`).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence


def usual_step(tokens: Sequence[int]) -> int:
    """The size of a usual message: the median of ``tokens`` (one long observation among
    them does not make every later message long), at least 1."""
    return max(1, int(statistics.median(tokens))) if tokens else 1


def refire_growth(tail: Sequence[int], *, rest_tokens: int, threshold: int, step: int,
                  clear_at_least: int) -> int:
    """The growth in tokens after which a run can bring the session under ``threshold``.

    ``tail``: the kept tail's message tokens, oldest first; ``rest_tokens``: what stays
    besides it after a run (the envelope, protected messages, the checkpoint). After ``j``
    messages of ``step`` tokens arrive, the ``j`` oldest of the tail leave it for the range:
    the first ``j`` for which the rest, the tail's newer part and the arrivals are under the
    trigger gives ``j * step``. None does: the growth a summary needs to free
    ``clear_at_least``, at least one step."""
    step = max(1, step)
    for j in range(1, len(tail) + 1):
        if rest_tokens + sum(tail[j:]) + j * step < threshold:
            return j * step
    return max(step, clear_at_least)


def early_refire_growth(tail: Sequence[int], *, shrink: int, step: int,
                        to_trigger: int) -> int | None:
    """The growth in tokens after which a run fired early leaves a kept tail at least
    ``shrink`` tokens smaller, or None when it would not before the session reaches its
    trigger (``to_trigger`` tokens away).

    ``tail``: the kept tail's message tokens, oldest first. After ``j`` messages of ``step``
    tokens arrive, the ``j`` oldest of the tail leave it for the range and the arrivals take
    their place: the first ``j`` for which they held ``shrink`` more than the arrivals gives
    ``j * step``."""
    step = max(1, step)
    left = 0
    for j, tokens in enumerate(tail, start=1):
        if j * step >= to_trigger:
            return None
        left += tokens
        if left - j * step >= shrink:
            return j * step
    return None
