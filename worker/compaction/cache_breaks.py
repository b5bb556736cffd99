"""When a model-free edit may break the agent's prefix cache on its own.

Every commit that changes the surface before its end makes the agent re-send, uncached,
everything after the first node it changed. A summary's commit does that anyway; a prune or a
clearing committed alone does it once more, and pays back only through the tokens it frees on
each later request. So an edit commits on its own only when it frees at least
``clear_at_least`` tokens (Anthropic's context editing asks the same of a clearing); otherwise it
rides with the next summary's commit. Two cases never wait: the agent's cache is cold anyway
(no append for longer than ``cache_ttl_s``: the next request re-sends everything whatever
compactd does), and safety (an overflow or forced run, a session at or over its window), where
relief comes before cost.

Pure: the clock comes in as ``now``.
"""

from __future__ import annotations

from datetime import datetime

from compactd.worker.compaction.policy import Policy


def hold_edits(freed_tokens: int, *, policy: Policy, pressure_tokens: int,
               last_append_at: datetime | None, now: datetime, forced: bool) -> str | None:
    """Why edits freeing ``freed_tokens`` wait for the next summary's commit, or None when
    they commit on their own. ``pressure_tokens``: the session's pressure before the edits;
    ``last_append_at``: the session's last append (None: no agent traffic to keep warm)."""
    if forced:
        return None
    window = policy.context_window
    if window and pressure_tokens >= window:
        return None
    if freed_tokens >= policy.clear_at_least:
        return None
    if last_append_at is None:
        return None
    idle_s = (now - last_append_at).total_seconds()
    if idle_s > policy.cache_ttl_s:
        return None
    return (f"the edits free {freed_tokens} tokens, under clear_at_least "
            f"({policy.clear_at_least}), and the agent's cache is warm (last append "
            f"{max(0.0, idle_s):.0f} s ago, cache_ttl_s {policy.cache_ttl_s:g}): they ride "
            "with the next summary's commit")


def summary_wasted(freed_at_most: int, *, policy: Policy, pressure_tokens: int, relieves: bool,
                   last_append_at: datetime | None, now: datetime, forced: bool) -> str | None:
    """Why a summary freeing at most ``freed_at_most`` tokens (its range less an empty
    checkpoint) is not asked for, or None when it is. A summary that can bring the session
    under its trigger always is. One that cannot (the kept tail, or the envelope beside it,
    holds the rest: a trigger below what any compaction reaches) commits a checkpoint that
    breaks the agent's cache for what it frees, as an edit committed alone does, and is asked
    for on the same terms (:func:`hold_edits`: at least ``clear_at_least``, or a cold cache,
    or safety). Without this, a trigger set below the kept tail rewrites the checkpoint with
    every step the keep lets go of, each time for a few dozen tokens."""
    if relieves:
        return None
    if hold_edits(freed_at_most, policy=policy, pressure_tokens=pressure_tokens,
                  last_append_at=last_append_at, now=now, forced=forced) is None:
        return None
    return (f"a summary would free at most {freed_at_most} tokens and leave the session over "
            f"its trigger (the kept tail holds the rest): under clear_at_least "
            f"({policy.clear_at_least}), with the agent's cache warm, its checkpoint would "
            "cost the agent more than it frees")
