"""The lead: how early a growing session fires so that its checkpoint lands as its context
reaches the trigger, not some steps after it. Pure: no I/O.

A checkpoint lands a while after the signal that asks for it (the queue, the claim, the summary
call, the commit). A session firing at its trigger spends that while over it, and every step
it takes there sends the tokens over the trigger again. Firing when its tokens plus its growth
over that while reach the trigger lands the checkpoint about when the context gets there. The
while is measured (``LEAD_PERCENTILE`` of recent runs' signal-to-commit times) or configured.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from compactd.worker.compaction.policy import PolicyError

# The share of recent runs whose checkpoint the lead covers: a median lead lands half of the
# checkpoints late; the slowest tenth is left to the cap and the trigger's own margin.
LEAD_PERCENTILE = 0.9
# A pool's own runs give its lead once it has this many; until then it takes every pool's, which
# the first measured run gives (the percentile of a few runs is their slowest: early, not late).
LEAD_MIN_RUNS = 5
# The runs a lead is measured on: the newest this many within ``LEAD_SAMPLE_S``, so the lead
# follows the load the workers have now.
LEAD_SAMPLE_RUNS = 200
LEAD_SAMPLE_S = 3600.0
# The lead brings the firing point down by at most this share of the trigger's tokens. A session
# growing a trigger's worth within one lead would otherwise fire again as soon as a checkpoint
# lands and summarize little each time; capped, it fires at half its trigger and lands late,
# which the loop guard and the next run still handle.
LEAD_MAX_SHARE = 0.5

# A run its lead fired early (the session not yet at its trigger) waits when the steps before its
# trigger let its kept tail shrink by at least this share of what the run frees now: a long
# message in the keep, replaced by usual ones. Right after a long observation arrives the keep
# holds it, and a checkpoint then frees little, breaks the agent's cache, re-sends the
# observation and leaves the session near its trigger, summarized again a few steps later. A
# tail of messages of the usual size turns over into as much again, and waiting for it would
# only land the checkpoint later.
EARLY_WAIT_SHARE = 0.5

# The ``summarization`` keys that are the fleet's, not a policy's (a session cannot set them).
FLEET_LEAD_KEYS = ("lead", "first_lead_s", "lead_steps")

# ``summarization.lead``'s value for a measured lead.
AUTO = "auto"
# The lead an ``auto`` fleet fires by until its first checkpoint is measured
# (``summarization.first_lead_s``'s default): 0, as before the key existed. About one summary
# call (5 s for a hosted model) lands a fresh deployment's first checkpoints on time instead of
# a whole run late; it is not the default because it also fires an ingested history early (a
# burst reads as a steep growth rate), which a fleet with measured leads does too but a fresh
# one never did.
FIRST_LEAD_S = 0.0


def parse_lead(value: Any, path: str = "summarization.lead") -> float | None:
    """``auto`` (None: measured), or the configured seconds (0: fire at the trigger, as before
    the lead existed)."""
    if value == AUTO and isinstance(value, str):
        return None
    return _seconds(value, path, "auto or a")


def parse_lead_steps(value: Any, path: str = "summarization.lead_steps") -> bool:
    """Whether the lead counts a session's largest recent step (:func:`step_lead_tokens`)."""
    if not isinstance(value, bool):
        raise PolicyError(path, f"must be true or false, got {value!r}")
    return value


def parse_first_lead(value: Any, path: str = "summarization.first_lead_s") -> float:
    """The seconds an ``auto`` lead is until a run is measured (0: at the trigger)."""
    return _seconds(value, path, "a")


def _seconds(value: Any, path: str, allowed: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise PolicyError(path, f"must be {allowed} number of seconds (0 turns it off), "
                                f"got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise PolicyError(path, f"must be {allowed} finite number of seconds, not negative, "
                                f"got {value!r}")
    return float(value)


def percentile(values: Sequence[float], share: float = LEAD_PERCENTILE) -> float:
    """The nearest-rank percentile: the smallest value at least ``share`` of ``values`` do not
    exceed. ``values`` must not be empty."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    return ordered[max(0, math.ceil(share * len(ordered)) - 1)]


def lead_tokens(rate_per_s: float, lead_s: float, threshold_tokens: float | None,
                grown_tokens: int | None = None) -> int:
    """The tokens a session growing at ``rate_per_s`` adds over ``lead_s``, which its pressure
    counts when deciding whether to fire: at most ``LEAD_MAX_SHARE`` of ``threshold_tokens``
    (the lowest token count its trigger fires at), and at most ``grown_tokens``, what it grew
    since its last checkpoint left it (None: never compacted). A checkpoint that leaves a
    session near its trigger then does not fire it again at once: it fires no earlier than
    halfway from what the checkpoint left to the trigger, and each compaction relieves it. 0
    with no growth, no lead or no token threshold (a messages-only trigger)."""
    if rate_per_s <= 0 or lead_s <= 0 or not threshold_tokens:
        return 0
    return _capped(rate_per_s * lead_s, threshold_tokens, grown_tokens)


def _capped(ahead: float, threshold_tokens: float, grown_tokens: int | None) -> int:
    """``ahead`` held to ``LEAD_MAX_SHARE`` of the trigger's tokens and to what the session
    grew since its last checkpoint (None: never compacted): both parts of the lead's caps."""
    ahead = min(ahead, LEAD_MAX_SHARE * threshold_tokens)
    if grown_tokens is not None:
        ahead = min(ahead, max(0, grown_tokens))
    return int(ahead)


def step_lead_tokens(step_tokens: float, threshold_tokens: float | None,
                     grown_tokens: int | None = None) -> int:
    """The tokens a session's next step may add, which its pressure counts beside its growth
    over the lead: its largest recent step (``sessions.step_tokens``), capped as the growth is
    (:func:`lead_tokens`: ``LEAD_MAX_SHARE`` of ``threshold_tokens``, and ``grown_tokens``,
    what it grew since its last checkpoint, None: never compacted). The growth rate averages a
    session's steps over time; one whose steps are large next to its trigger (a long file
    read, a test log) crosses it in a single step the rate does not see coming, and its
    checkpoint then lands that step late. Held to what it grew since, a checkpoint that leaves
    the session within one step of its trigger does not fire it again at once, with nothing
    new to summarize. 0 with no token threshold."""
    if step_tokens <= 0 or not threshold_tokens:
        return 0
    return _capped(step_tokens, threshold_tokens, grown_tokens)


def early_wait_shrink(freed: int) -> int:
    """How much a run fired early, freeing ``freed`` now, waits for its kept tail to shrink
    by: ``EARLY_WAIT_SHARE`` of it, at least 1 token."""
    return max(1, math.ceil(EARLY_WAIT_SHARE * freed))
