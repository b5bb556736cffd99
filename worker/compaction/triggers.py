"""Pressure and the trigger: pipeline steps 1 and 2.

Pressure is what the run model would be sent at its next step: every surface node (a checkpoint
node's token count already includes its rendered form and authority contract) plus the envelope
the runtime registered (system prompt, tool schemas). Our own count is an estimate; when the
runtime reported the provider's ``input_tokens`` for its last call, that number is the provider's
truth about the same request, so the larger of the two is used: undercounting is what overflows.

The ``fraction`` denominator is the run model's context window, the model that would overflow,
never the summary model's (a 0.8 of a 128k summary model's window would never fire in time for a
64k run model).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from compactd.storage.counters import MESSAGES, TOKENS, Counter, kept_by_name, summed
from compactd.storage.surface import SurfaceNode
from compactd.worker.compaction.policy import Clause, Policy


@dataclass(frozen=True, slots=True)
class Pressure:
    """How full the run model's next request would be."""

    tokens: int
    messages: int
    fraction: float | None  # tokens / the run model's window; None without a known window
    # The counters kept by name (``storage.counters``), a name left out at 0.
    counts: Mapping[str, int] = field(default_factory=dict)

    def count(self, counter: Counter) -> int:
        """What ``counter`` stands at: the measure every kind of that counter compares."""
        if counter is TOKENS:
            return self.tokens
        if counter is MESSAGES:
            return self.messages
        return self.counts.get(counter.name, 0)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "tokens": self.tokens, "messages": self.messages,
            "fraction": None if self.fraction is None else round(self.fraction, 6)}
        if self.counts:
            out["counts"] = dict(self.counts)
        return out

    def ahead_by(self, tokens: int, context_window: int | None) -> Pressure:
        """The pressure once the session has grown by ``tokens`` (its lead's growth)."""
        return self if tokens <= 0 else replace(
            _pressure(self.tokens + tokens, self.messages, context_window), counts=self.counts)

    def reduced_by(self, tokens: int, context_window: int | None) -> Pressure:
        """The pressure after replacements saved ``tokens`` (node count unchanged)."""
        return replace(_pressure(self.tokens - tokens, self.messages, context_window),
                       counts=self.counts)


def measure(nodes: Sequence[SurfaceNode], *, envelope_tokens: int = 0,
            reported_input_tokens: int | None = None,
            context_window: int | None = None) -> Pressure:
    """Pressure of a surface: node tokens plus the envelope, or the provider's count if larger."""
    tokens = pressure_tokens(sum(node.tokens for node in nodes), envelope_tokens,
                             reported_input_tokens)
    return replace(_pressure(tokens, len(nodes), context_window), counts=surface_counts(nodes))


def surface_counts(nodes: Sequence[SurfaceNode]) -> dict[str, int]:
    """The counters kept by name, counted on ``nodes`` as the append and the commit count
    them node by node (``storage.counters``)."""
    counters = kept_by_name()
    if not counters:
        return {}
    return summed({c.name: c.of(node.message, node.tokens) for c in counters}
                  for node in nodes) or {}


def pressure_tokens(surface_tokens: int, envelope_tokens: int, reported_tokens: int | None
                    ) -> int:
    """The pressure in tokens: the surface and the envelope, or the provider's report of the
    same request when it is larger (undercounting is what overflows). The one Python form of
    it; ``storage.schema.OVER_SWEEP_SQL`` is the SQL one, held equal by a contract test."""
    tokens = surface_tokens + max(0, envelope_tokens)
    return reported_tokens if reported_tokens is not None and reported_tokens > tokens else tokens


def _pressure(tokens: int, messages: int, context_window: int | None) -> Pressure:
    fraction = tokens / context_window if context_window else None
    return Pressure(tokens=tokens, messages=messages, fraction=fraction)


def clause_holds(clause: Clause, pressure: Pressure, context_window: int | None) -> bool:
    # A clause that cannot be judged (a fraction without a window) never fires on a guess;
    # ``Policy.resolve`` drops it.
    threshold = clause.threshold(context_window)
    return threshold is not None and pressure.count(clause.measure.counter) >= threshold


def should_compact(pressure: Pressure, policy: Policy) -> tuple[bool, str]:
    """Whether automatic compaction fires, and why (or why not), for logs and ``plan --json``.

    The trigger is OR over groups, each group AND over its clauses (LangChain's semantics).
    ``policy`` should be resolved, so ``fraction`` uses the run model's window.
    """
    if not policy.enabled:
        return False, "automatic compaction is disabled"
    if not policy.trigger:
        return False, "no trigger clause is usable (automatic compaction is off)"
    window = policy.context_window
    for group in policy.trigger:
        if all(clause_holds(c, pressure, window) for c in group):
            what = " and ".join(c.describe() for c in group)
            return True, f"{what} (pressure {_describe(pressure)})"
    return False, f"under every trigger (pressure {_describe(pressure)})"


def should_clear(pressure: Pressure, policy: Policy) -> bool:
    """Whether clearing old tool results fires on its own trigger (LangChain's
    ``ClearToolUsesEdit``: strictly above it), whatever the summary trigger says. Clearing is
    model-free and committed like a prune; ``enabled: false`` turns it off with the rest of
    automatic compaction."""
    clear = policy.clear_tool_uses
    return policy.enabled and clear.enabled and pressure.tokens > clear.trigger


def should_run(pressure: Pressure, policy: Policy, *, lead_tokens: int = 0
               ) -> tuple[bool, str]:
    """Whether an automatic run is worth waking for: the summary trigger, or clearing's own.
    ``lead_tokens`` (what the session may add before the checkpoint lands: its growth over its
    lead or its next step, ``worker.pressure.lead_parts``) counts
    toward the summary trigger only: the plan judges clearing on the pressure as it is."""
    fired, reason = should_compact(pressure.ahead_by(lead_tokens, policy.context_window),
                                   policy)
    if lead_tokens:
        reason += f"; counting {lead_tokens} tokens ahead of the checkpoint (its lead)"
    if fired or not should_clear(pressure, policy):
        return fired, reason
    return True, (f"clear_tool_uses tokens>{policy.clear_tool_uses.trigger} "
                  f"(pressure {_describe(pressure)}); the summary trigger: {reason}")


def _describe(pressure: Pressure) -> str:
    out = f"{pressure.tokens} tokens, {pressure.messages} messages"
    out += "".join(f", {n} {name}" for name, n in pressure.counts.items())
    if pressure.fraction is not None:
        out += f", {pressure.fraction:.3f} of the window"
    return out
