"""The plan: pipeline steps 1 to 5 joined into one pure function.

``plan`` measures, checks the trigger, prunes (no model call), measures again, selects the range,
captures skills and lays out the summarizer calls. It reads nothing and writes nothing: the
orchestration commits the prune actions, runs the calls (each through :func:`build_prompt`),
validates the summary and commits the checkpoint. ``compactd plan --json`` prints
:meth:`Plan.to_json`.

Gating. Nothing happens unless a trigger fired or the run is forced. The clearing edit has its
own trigger (LangChain's ``ClearToolUsesEdit``): over it, old tool results are cleared even when
the summary trigger has not fired, and such a run stops at the clearing (model-free, committed
like a prune). Size pruning belongs to the summary trigger. The clearing of old reasoning
(``clear_thinking``) has no trigger of its own: it joins every run that edits, whichever trigger
fired it. After pruning, an automatic run
summarizes only if the summary trigger still fires; a forced run (overflow, manual) always goes
on to a maximal head reduction, as DeepSeek Harness does after a provider confirmed the overflow.

Determinism. The plan depends only on its arguments (``now`` is recorded, never read from a
clock), so equal inputs give equal plans, and :func:`replan_smaller` can re-plan the same inputs
with a smaller call budget after a provider's context-length error.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from functools import lru_cache
from typing import Any

from compactd.storage.counters import TOKENS
from compactd.storage.messages import Message
from compactd.storage.surface import SurfaceNode
from compactd.storage.tokens import TokenCounter, counter_for
from compactd.worker.compaction.arrivals import Arrivals, keep_at_pickup
from compactd.worker.compaction.boundary import (
    Selection,
    is_checkpoint,
    protected,
    resolve_keep,
    select_range,
    unsafe_boundaries,
)
from compactd.worker.compaction.cache_breaks import hold_edits, summary_wasted
from compactd.worker.compaction.lead import EARLY_WAIT_SHARE, early_wait_shrink
from compactd.worker.compaction.policy import Clause, Policy
from compactd.worker.compaction.prompt import SummaryCall, message_body, plan_calls, refill_calls
from compactd.worker.compaction.pruning import (
    PruneAction,
    apply_actions,
    clear_tool_uses,
    merge_actions,
    prune_tool_results,
)
from compactd.worker.compaction.reasoning import clear_thinking
from compactd.worker.compaction.recall import (
    checkpoint_ref,
    offers_recall,
    recall_meta,
    span_of,
)
from compactd.worker.compaction.recallable import NoPlan, RecallablePass, plan_pass
from compactd.worker.compaction.refire import early_refire_growth, refire_growth, usual_step
from compactd.worker.compaction.render import Skill, checkpoint_message
from compactd.worker.compaction.skills import capture_skills
from compactd.worker.compaction.triggers import Pressure, measure, should_clear, should_compact
from compactd.worker.compaction.validation import framed_tokens


@dataclass(frozen=True, slots=True)
class Outlook:
    """What a plan knows of the session beyond its surface: each mechanism that times a run
    against the agent adds its field here, not a keyword to :func:`plan`."""

    # What the session may add before a checkpoint asked for now lands, its growth over its
    # lead or its next step (``worker.pressure.lead_parts``): the trigger is judged on
    # the pressure when a checkpoint asked for now would land, as the signal that fired it was.
    lead_tokens: int = 0
    # What the agent is expected to append before it picks the checkpoint up (keep_at: pickup);
    # None keeps the policy's tail as it stands at the read.
    arrivals: Arrivals | None = None
    # Model-free edits may wait for the summary's commit (see cache_breaks); False for the
    # runs that never wait (overflow, forced) and for callers that commit edits alone.
    edits_may_wait: bool = False
    # The session's last append: how warm the agent's cache is (cache_breaks).
    last_append_at: datetime | None = None


# A session planned on its surface alone: no lead, no arrivals, edits commit on their own.
NO_OUTLOOK = Outlook()


@dataclass(frozen=True, slots=True)
class PlanInputs:
    """Everything a plan was computed from (kept so it can be re-planned)."""

    nodes: tuple[SurfaceNode, ...]
    policy: Policy
    envelope_tokens: int
    reported_input_tokens: int | None
    run_model: str | None
    now: datetime
    force: bool
    keep_override: Clause | None
    envelope: dict[str, Any] | None
    outlook: Outlook = NO_OUTLOOK


@dataclass(frozen=True, slots=True)
class SummarizeStep:
    """The summary part of a plan: one range replaced by one checkpoint, but for the nodes
    inside it that stay (``kept_inside``; see :mod:`worker.compaction.boundary`, rule 3)."""

    # Surface seqs, in order: with ``kept_inside``, a contiguous run of the surface.
    replace_seqs: tuple[int, ...]
    keep_seqs: tuple[int, ...]  # every other surface seq, in order
    calls: tuple[SummaryCall, ...]
    existing_summary: str  # the summary call 0 merges into ("" when none)
    skills: tuple[Skill, ...]  # active skills the checkpoint carries
    replaced_tokens: int  # surface tokens of the run after pruning: the summary must be smaller
    has_history: bool  # False: nothing to read, the canned no-history summary is valid
    strategy: str
    deferred_seqs: tuple[int, ...]  # compactable seqs left for a later round
    # The original seqs the run covers (recall.span_of): names the checkpoint and its footer.
    span: tuple[int, int] = (0, 0)
    footer: bool = True  # the runtime offers the recall tools (recall.offers_recall)
    # The protected nodes inside the range (the latest user request, a reminder, ...): they
    # stay verbatim where they are, and the checkpoint follows the last of them.
    kept_inside: tuple[int, ...] = ()

    @property
    def recall(self) -> dict[str, Any]:
        """The checkpoint's ``meta.recall``: its reference, span and footer."""
        return checkpoint_recall(*self.span, footer=self.footer)

    def to_json(self) -> dict[str, Any]:
        return {"replace_seqs": list(self.replace_seqs), "keep_seqs": list(self.keep_seqs),
                "kept_inside": list(self.kept_inside),
                "calls": [call.to_json() for call in self.calls],
                "replaced_tokens": self.replaced_tokens, "strategy": self.strategy,
                "skills": [s.to_json() for s in self.skills],
                "deferred_seqs": list(self.deferred_seqs), "checkpoint": self.recall["ref"]}


@dataclass(frozen=True, slots=True)
class Plan:
    """What a compaction of one surface would do, and why."""

    pressure: Pressure
    fired: bool  # the trigger fired (forced runs report it too, and go on regardless)
    reason: str
    forced: bool
    prune: tuple[PruneAction, ...]
    tokens_after_prune: int
    summarize: SummarizeStep | None
    nothing_to_do: str | None  # set when the plan neither prunes nor summarizes
    why_no_summary: str | None  # set when ``summarize`` is None
    inputs: PlanInputs = field(repr=False)
    # Planned with ``defer_summary``: the prunes still leave the trigger fired, and the
    # summarize step is for the plan of the surface they make (``summarize`` is None here).
    summary_deferred: bool = False
    # Under ``layout: recallable``, the pass that stands where ``summarize`` would.
    recall_pass: RecallablePass | None = None
    # Why ``prune`` does not commit on its own (cache_breaks.hold_edits): it rides with
    # ``summarize``'s commit, or, with no summary, waits for a later run's.
    prune_held: str | None = None
    # Set when no summary is asked for because none could bring the session under its
    # trigger (cache_breaks.summary_wasted): the growth after which a run could
    # (:mod:`worker.compaction.refire`).
    refire_growth: int | None = None

    @property
    def standing_tokens(self) -> int:
        """The session's pressure once the run commits this plan's edits and no summary: held
        edits are not committed, and free nothing."""
        return self.pressure.tokens if self.prune_held else self.tokens_after_prune

    @property
    def compacts(self) -> bool:
        """Whether the plan writes a summary of any kind (a checkpoint, or a pass)."""
        return self.summarize is not None or self.recall_pass is not None

    def to_json(self) -> dict[str, Any]:
        """The CLI contract's ``plan --json`` body (the caller adds session and version)."""
        return {
            "pressure": self.pressure.to_json(),
            "trigger": {"fired": self.fired, "reason": self.reason},
            "forced": self.forced,
            "prune": [action.to_json() for action in self.prune],
            "tokens_after_prune": self.tokens_after_prune,
            "layout": self.inputs.policy.layout,
            "summarize": (self.summarize.to_json() if self.summarize is not None
                          else self.recall_pass.to_json() if self.recall_pass is not None
                          else None),
            "nothing_to_do": self.nothing_to_do,
            "why_no_summary": self.why_no_summary,
            "arrivals": (self.inputs.outlook.arrivals.to_json()
                         if self.inputs.outlook.arrivals is not None else None),
            "prune_held": self.prune_held,
        }


def plan(nodes: Sequence[SurfaceNode], *, policy: Policy, envelope_tokens: int = 0,
         reported_input_tokens: int | None = None, run_model: str | None = None,
         now: datetime, force: bool = False, keep_override: Clause | None = None,
         envelope: dict[str, Any] | None = None, defer_summary: bool = False,
         outlook: Outlook = NO_OUTLOOK) -> Plan:
    """Plan one compaction round of ``nodes`` under ``policy`` (resolved to the run model's
    window). ``force`` ignores the trigger and, unless ``keep_override`` is given, the keep
    policy. Token counts are the nodes' stored counts; only edited and split text is counted.

    ``outlook``: what the session does around the run. Its ``arrivals``, what the agent is
    expected to append before it picks the checkpoint up, make the kept tail smaller, so the
    tail at the pickup is the keep (a forced run's maximal reduction has no keep to measure,
    and takes none). Its ``lead_tokens``, what the session grows by before a checkpoint asked
    for now lands, count toward the trigger (a run fired early by its lead is not refused as
    under the trigger). With ``edits_may_wait`` the edits wait for a summary's commit unless
    they pay for breaking the agent's cache (``prune_held`` says why they wait;
    ``last_append_at`` says how warm the cache is). Held edits relieve nothing by themselves,
    so the summary is planned, on the surface they make, whenever the summary trigger fired.

    ``defer_summary``: when there is something to prune, stop there (``summary_deferred`` says
    whether a summary would follow). A worker commits the prunes and plans the surface they
    make, whose summarize step is the one it runs; planning it on the virtual surface first was
    work thrown away."""
    outlook = replace(outlook, lead_tokens=max(0, outlook.lead_tokens))
    inputs = PlanInputs(tuple(nodes), policy, envelope_tokens, reported_input_tokens, run_model,
                        now, force, keep_override, envelope, outlook)
    return _plan(inputs, defer_summary=defer_summary)


def replan_smaller(previous: Plan, factor: float = 0.5) -> Plan:
    """The same inputs planned with a call budget ``factor`` times the largest call, for a
    summarizer that reported a context-length error on the previous plan."""
    if not 0 < factor < 1:
        raise ValueError(f"factor must be in (0, 1), got {factor}")
    step = previous.summarize
    if step is None:
        return previous
    inputs = previous.inputs
    largest = max(call.input_tokens for call in step.calls)
    limit = inputs.policy.trim_tokens_to_summarize
    base = min(limit, largest) if limit is not None else largest
    smaller = replace(inputs.policy, trim_tokens_to_summarize=max(1, int(base * factor)))
    return _plan(replace(inputs, policy=smaller))


def refill(previous: Plan, index: int, running: str) -> Plan:
    """``previous`` with its calls from ``index`` on packed again around the summary call
    ``index - 1`` wrote (``running``): :func:`worker.compaction.prompt.refill_calls`."""
    step = previous.summarize
    if step is None or not 0 < index < len(step.calls):
        return previous
    inputs = previous.inputs
    surface = apply_actions(inputs.nodes, previous.prune)
    kept = frozenset(i for i, node in enumerate(surface) if node.seq in step.kept_inside)
    calls = refill_calls(surface, unsafe_boundaries(surface), step.calls, index, running,
                         inputs.policy, counter_for(inputs.run_model), inputs.envelope_tokens,
                         kept)
    if calls == step.calls:
        return previous
    return replace(previous, summarize=replace(step, calls=calls))


def checkpoint_recall(first: int, last: int, *, footer: bool = True) -> dict[str, Any]:
    """``meta.recall`` of a checkpoint replacing the originals ``first``..``last`` (``footer``:
    with its footer line)."""
    return recall_meta(checkpoint_ref(first, last), footer=footer)


def checkpoint_for(step: SummarizeStep, summary: str, policy: Policy, **meta: Any) -> Message:
    """The checkpoint node to commit for a validated summary of ``step``, its recall footer
    composed here (never by the model)."""
    return checkpoint_message(summary, step.skills, policy.render, recall=step.recall, **meta)


# ------------------------------------------------------------------------------------------


def _plan(inputs: PlanInputs, *, defer_summary: bool = False) -> Plan:
    policy = inputs.policy
    nodes = inputs.nodes
    window = policy.context_window
    counter = counter_for(inputs.run_model)
    pressure = measure(nodes, envelope_tokens=inputs.envelope_tokens,
                       reported_input_tokens=inputs.reported_input_tokens,
                       context_window=window)
    lead = inputs.outlook.lead_tokens
    fired, reason = should_compact(pressure.ahead_by(lead, window), policy)
    if lead:
        reason += f"; counting {lead} tokens ahead of the checkpoint (its lead)"

    def done(prune: tuple[PruneAction, ...], after: int,
             step: SummarizeStep | RecallablePass | None, why: str | None,
             deferred: bool = False, held: str | None = None) -> Plan:
        nothing = why if step is None and not prune else None
        return Plan(pressure=pressure, fired=fired, reason=reason, forced=inputs.force,
                    prune=prune, tokens_after_prune=after,
                    summarize=step if isinstance(step, SummarizeStep) else None,
                    nothing_to_do=nothing, why_no_summary=why if step is None else None,
                    inputs=inputs, summary_deferred=deferred,
                    recall_pass=step if isinstance(step, RecallablePass) else None,
                    prune_held=held if prune else None)

    summary_due = fired or inputs.force
    if not summary_due and not should_clear(pressure, policy):
        return done((), pressure.tokens, None, f"trigger did not fire: {reason}")

    actions = _edits(nodes, policy, counter, pressure, summary_due=summary_due)
    saved = sum(a.saved for a in actions)
    after = pressure.reduced_by(saved, window)
    held = (hold_edits(saved, policy=policy, pressure_tokens=pressure.tokens,
                       last_append_at=inputs.outlook.last_append_at, now=inputs.now,
                       forced=not inputs.outlook.edits_may_wait) if actions else None)
    if not summary_due:
        return done(actions, after.tokens, None,
                    f"only clear_tool_uses fired; the summary trigger did not: {reason}",
                    held=held)
    if (not inputs.force and held is None
            and not should_compact(after.ahead_by(lead, window), policy)[0]):
        return done(actions, after.tokens, None,
                    "pruning alone brought pressure under the trigger")

    if defer_summary and actions and held is None:
        return done(actions, after.tokens, None, "planned after the prunes are committed",
                    deferred=True)
    surface = apply_actions(nodes, actions)
    step: SummarizeStep | RecallablePass | NoPlan
    if policy.layout == "recallable":
        step = plan_pass(surface, policy=policy, counter=counter, run_model=inputs.run_model,
                         envelope_tokens=inputs.envelope_tokens, keep=_kept_clause(inputs),
                         force=inputs.force)
    else:
        step = _summarize(surface, inputs, counter)
    if isinstance(step, NoPlan):
        # No summary to ride with while the session is over its trigger: the edits are the
        # relief there is, and commit alone.
        return done(actions, after.tokens, None, step.reason)
    # An operator's keep (plan, compact or recompact --keep) asks for that summary: it is not
    # weighed against the agent's cache.
    if isinstance(step, SummarizeStep) and not inputs.force and inputs.keep_override is None:
        # Held edits commit with the summary or not at all: what the session holds after a
        # run that asks for none, and what the summary's commit frees beside its range.
        standing = after if held is None else pressure
        early = _early_wait(step, surface, inputs, standing,
                                 riding=saved if held is not None else 0)
        if early is not None:
            return replace(done(actions, after.tokens, None, early[0], held=held),
                           refire_growth=early[1])
        wasted = _wasted(step, surface, inputs, after)
        if wasted is not None:
            # As above: the edits, if any, are the relief there is.
            return replace(done(actions, after.tokens, None, wasted[0]),
                           refire_growth=wasted[1])
    return done(actions, after.tokens, step, None, held=held)


def _early_wait(step: SummarizeStep, surface: Sequence[SurfaceNode], inputs: PlanInputs,
                     standing: Pressure, *, riding: int) -> tuple[str, int] | None:
    """Why a run its lead fired early asks for no summary, and the growth after which it would
    (:data:`worker.compaction.lead.EARLY_WAIT_SHARE`), or None: the session is at its trigger
    without the lead (``standing``: what it holds after a run with no summary), or its kept
    tail does not shrink, before the trigger, by that share of what the summary's commit frees
    (its range, and ``riding``: the held edits it carries)."""
    policy = inputs.policy
    threshold = policy.threshold_tokens()
    if (not inputs.outlook.lead_tokens or threshold is None
            or should_compact(standing, policy)[0]):
        return None
    freed = _freed(step, inputs) + riding
    growth = early_refire_growth(_tail_after(step, surface), shrink=early_wait_shrink(freed),
                                 step=_usual_step(surface),
                                 to_trigger=int(threshold) - standing.tokens)
    if growth is None:
        # No long message leaves the tail before the trigger: a later run keeps as much.
        return None
    return (f"fired early by its lead, a summary would free {freed} tokens and keep a tail "
            f"that {growth} tokens of growth shrink by at least {EARLY_WAIT_SHARE:.0%} of that (a "
            "long message leaves it): waits for them"), growth


def _freed(step: SummarizeStep, inputs: PlanInputs) -> int:
    """What ``step``'s summary frees at most: its range less an empty checkpoint."""
    return max(0, step.replaced_tokens
               - _empty_checkpoint_tokens(inputs.policy.render, inputs.run_model))


def _tail_after(step: SummarizeStep, surface: Sequence[SurfaceNode]) -> list[int]:
    """The tokens of the nodes after ``step``'s range, oldest first: its kept tail."""
    gone = set(step.replace_seqs)
    last = max(i for i, node in enumerate(surface) if node.seq in gone)
    return [node.tokens for node in surface[last + 1:]]


def _usual_step(surface: Sequence[SurfaceNode]) -> int:
    return usual_step([node.tokens for node in surface if not is_checkpoint(node)])


def _wasted(step: SummarizeStep, surface: Sequence[SurfaceNode], inputs: PlanInputs,
            pressure: Pressure) -> tuple[str, int] | None:
    """Why ``step``'s summary is not asked for (cache_breaks.summary_wasted) and the growth
    after which a run could relieve the session (refire_growth), or None."""
    policy = inputs.policy
    window = policy.context_window
    freed = _freed(step, inputs)
    relieves = not should_compact(pressure.reduced_by(freed, window), policy)[0]
    why = summary_wasted(freed, policy=policy, pressure_tokens=pressure.tokens,
                         relieves=relieves, last_append_at=inputs.outlook.last_append_at,
                         now=inputs.now,
                         forced=inputs.force or not inputs.outlook.edits_may_wait)
    threshold = policy.threshold_tokens()
    if why is None or threshold is None:
        return None
    tail = _tail_after(step, surface)
    rest = pressure.tokens - sum(tail) - freed
    return why, refire_growth(tail, rest_tokens=rest, threshold=int(threshold),
                              step=_usual_step(surface), clear_at_least=policy.clear_at_least)


def _edits(nodes: Sequence[SurfaceNode], policy: Policy, counter: TokenCounter,
           pressure: Pressure, *, summary_due: bool) -> tuple[PruneAction, ...]:
    """The model-free edits of a run, in order: size pruning (the summary trigger's), the
    clearing of old tool results (its own trigger), the clearing of old reasoning (on any run
    that edits), each on the surface the earlier ones make."""
    sized = prune_tool_results(nodes, policy.prune, counter) if summary_due else []
    saved = sum(a.saved for a in sized)
    cleared = merge_actions(sized, clear_tool_uses(
        apply_actions(nodes, sized), policy.clear_tool_uses, counter,
        pressure_tokens=pressure.tokens - saved))
    thought = clear_thinking(apply_actions(nodes, cleared), policy.clear_thinking, counter)
    return tuple(merge_actions(cleared, thought))


def _kept_clause(inputs: PlanInputs) -> Clause | None:
    """The keep the selection cuts by: the override, else the policy's, in compactd's counts of
    the nodes (:func:`_provider_scale`); with ``arrivals``, smaller by them. None: a forced
    run's maximal reduction, or the policy's keep as is."""
    if inputs.force and inputs.keep_override is None:
        return None
    policy = inputs.policy
    arrivals = inputs.outlook.arrivals
    scale = _provider_scale(inputs)
    pickup = arrivals is not None and policy.keep_at == "pickup"
    if not pickup and scale <= 1:
        return inputs.keep_override
    keep = _in_counted_tokens(resolve_keep(policy, inputs.keep_override), scale,
                              policy.context_window)
    if arrivals is None or not pickup:
        return keep
    return keep_at_pickup(keep, arrivals, policy.context_window)


def _in_counted_tokens(keep: Clause, scale: float, window: int | None) -> Clause:
    """A keep of the tokens counter (the provider's tokens) in compactd's counts: over
    ``scale``. A keep of another counter is as it was."""
    if scale <= 1 or keep.measure.counter is not TOKENS:
        return keep
    return Clause(TOKENS.name, math.floor((keep.threshold(window) or 0) / scale))


def _provider_scale(inputs: PlanInputs) -> float:
    """The provider's tokens per token compactd counts on the surface, by the runtime's report:
    its count of the request less the envelope, over compactd's count of the nodes; 1 without a
    larger report. The trigger is judged on the provider's count; a keep (and the window it is a
    fraction of) is the provider's tokens too, so a tail cut by compactd's smaller counts keeps
    more than the keep, and every checkpoint leaves the session that much nearer its trigger,
    compacted again after a little growth and flagged by the loop guard. The whole difference
    is put on the nodes: where the envelope is undercounted too, the tail keeps less, never
    more."""
    reported = inputs.reported_input_tokens
    counted = sum(node.tokens for node in inputs.nodes)
    if reported is None or counted <= 0:
        return 1.0
    return max(1.0, (reported - max(0, inputs.envelope_tokens)) / counted)


@lru_cache(maxsize=32)
def _empty_checkpoint_tokens(render: str, run_model: str | None) -> int:
    return framed_tokens("", (), Policy(render=render), run_model)


def _summarize(surface: list[SurfaceNode], inputs: PlanInputs, counter: TokenCounter
               ) -> SummarizeStep | NoPlan:
    """The summarize step over the pruned surface, or why there is none."""
    policy = inputs.policy
    unsafe = unsafe_boundaries(surface)
    minimum = _empty_checkpoint_tokens(policy.render, inputs.run_model)
    keep = _kept_clause(inputs)
    selection = select_range(surface, keep=keep, policy=policy, force=inputs.force,
                             min_tokens=minimum, unsafe=unsafe)
    if selection.nothing_to_do is not None:
        return NoPlan(selection.nothing_to_do)
    start, end = selection.start, selection.end

    # Leading checkpoints carry the existing summary, unless it is too large to carry: then
    # they are read inline like messages (and split if need be), never dropped.
    # The calls read the kept nodes inside the range too (the request the work answered), as
    # context and within a bound (prompt.kept_piece): only the others are replaced.
    calls = plan_calls(surface, start, end, unsafe, policy, counter, inputs.envelope_tokens,
                       selection.kept)
    if isinstance(calls, str):
        return NoPlan(calls)
    end, existing, strategy = calls.end, calls.existing, calls.strategy
    kept = set(selection.kept)
    replaced = [surface[i] for i in range(start, end) if i not in kept]
    kept_inside = tuple(surface[i].seq for i in range(start, end) if i in kept)
    replaced_tokens = sum(node.tokens for node in replaced)
    span = span_of(replaced) if replaced else (0, 0)
    footer = offers_recall(inputs.envelope)
    # The footer is part of what the checkpoint costs, so a run no larger than an empty
    # checkpoint with its footer cannot shrink the surface either.
    minimum = max(minimum, framed_tokens("", (), policy, inputs.run_model,
                                         checkpoint_recall(*span, footer=footer)))
    if replaced_tokens <= minimum:
        return NoPlan(f"the run that fits the summarizer budget ({replaced_tokens} tokens) is "
                      f"not larger than an empty checkpoint ({minimum} tokens)")
    skills = capture_skills(replaced, tool_names=policy.skill_file_read_tool_names,
                            skills_path=policy.skills_path)
    has_history = bool(existing) or any(message_body(node.message).strip() for node in replaced)
    replace_seqs = tuple(node.seq for node in replaced)
    gone = set(replace_seqs)
    keep_seqs = tuple(node.seq for node in surface if node.seq not in gone)
    return SummarizeStep(
        replace_seqs=replace_seqs, kept_inside=kept_inside, keep_seqs=keep_seqs,
        calls=calls.calls,
        existing_summary=existing, skills=tuple(skills), replaced_tokens=replaced_tokens,
        has_history=has_history, strategy=strategy,
        deferred_seqs=_deferred(surface, selection, gone), span=span, footer=footer)


def _deferred(surface: Sequence[SurfaceNode], selection: Selection, replaced: set[int]
              ) -> tuple[int, ...]:
    """Seqs before the kept tail that stay although compactable (what the shrink strategy or a
    tool group's safety left): a later round's candidates. Protected nodes are not listed."""
    guard = protected(surface)
    return tuple(surface[i].seq for i in range(selection.cut)
                 if not guard[i] and surface[i].seq not in replaced)
