"""One pass of the ``recallable`` layout, run: its calls concurrently, its commits left to right.

The plan (:mod:`worker.compaction.recallable`) names the chunks, the state and where each goes.
Here every chunk's index chain and the state's chain start at once, each through the candidate
fallback with its usage recorded per call, and the pass commits once they have all ended: the
roll-up, the index checkpoints left to right and the new state, in one commit through
:meth:`RunScope.commit` (fence checked). One commit, because every surface version a runtime
picks up makes it re-send, uncached, everything after the first node that changed: index
checkpoints committed ahead of the state would cost the agent a second re-send of its context
in the same pass (``tests/bench/cache_cost.py`` counts it), for a gain only a crash could
collect.

A chunk whose chain fails degrades to its pointer, composed by code at plan time, and the pass
goes on. The state is the one call a pass cannot do without: when its chain fails, the index
checkpoints still commit (each is valid alone; the surface between is a valid layout), then the
run fails ``summary``, and the next pass resumes from the log, its state reading those index
checkpoints.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from compactd.storage.kinds import LayoutRole, RunStatus, Stage
from compactd.storage.messages import Message
from compactd.storage.records import Replacement, SessionInfo
from compactd.storage.surface import Surface
from compactd.storage.tokens import counter_for
from compactd.worker.chains import ChainFailed, Summarizers, Written, run_chain, summary_request
from compactd.worker.compaction.planner import Plan
from compactd.worker.compaction.policy import Policy
from compactd.worker.compaction.prompt import SummaryCall, build_index_prompt
from compactd.worker.compaction.pruning import PruneAction, prune_replacements, riding_actions
from compactd.worker.compaction.recallable import (
    IndexStep,
    RecallablePass,
    StateStep,
    commit_replacements,
    index_checkpoint,
    state_checkpoint,
    validate_index,
)
from compactd.worker.compaction.triggers import should_compact
from compactd.worker.llm.fallback import SummaryRequest
from compactd.worker.llm.local import summarize_local_index
from compactd.worker.metrics import metrics
from compactd.worker.pressure import read_pressure, session_pressure
from compactd.worker.run import RunScope


@dataclass
class _IndexChain:
    """An index checkpoint's calls (a :class:`~worker.chains.Chain`)."""

    step: IndexStep
    policy: Policy
    run_model: str | None

    @property
    def calls(self) -> Sequence[SummaryCall]:
        return self.step.calls

    def request(self, index: int, running: str | None) -> SummaryRequest:
        counter = counter_for(self.run_model)
        final = index == len(self.step.calls) - 1
        call = self.step.calls[index]

        def check(text: str) -> str | None:
            return validate_index(text, self.step, self.policy, self.run_model, counter,
                                  final=final)

        return SummaryRequest.of(build_index_prompt(call, running, self.policy),
                                 messages=call.messages, existing_summary=running,
                                 max_tokens=self.policy.index_summary_tokens, validate=check,
                                 local=summarize_local_index)

    def shrink(self, index: int, request: SummaryRequest) -> SummaryRequest | None:
        return None  # its calls are budget-sized; the next candidate, then the pointer


@dataclass
class _StateChain:
    """The state's calls (a :class:`~worker.chains.Chain`): the previous state merged with what
    the pass absorbs, the last call held to the room the index checkpoints leave."""

    state: StateStep
    policy: Policy
    info: SessionInfo

    @property
    def calls(self) -> Sequence[SummaryCall]:
        return self.state.calls

    def request(self, index: int, running: str | None) -> SummaryRequest:
        state = self.state
        final = index == len(state.calls) - 1
        return summary_request(state.calls[index], running, policy=self.policy, info=self.info,
                               skills=state.skills, has_history=state.has_history,
                               recall=state.recall,
                               below=state.room_tokens if final else None,
                               max_tokens=state.max_tokens if final else None)

    def shrink(self, index: int, request: SummaryRequest) -> SummaryRequest | None:
        return None  # budget-sized calls: the next candidate


async def run_pass(scope: RunScope, current: Plan, surface: Surface, policy: Policy,
                   info: SessionInfo, *, final_if_relieved: bool) -> tuple[SessionInfo, bool]:
    """Run the plan's pass to its last commit; ``(session, whether that commit ended the
    run)``. Raises :class:`~worker.chains.ChainFailed` after committing the index checkpoints
    when the state's chain fails."""
    p = current.recall_pass
    assert p is not None
    summarizers = Summarizers.of(scope, info.run_model, policy.model_name)

    async def index_text(step: IndexStep) -> tuple[str | None, Written | None]:
        """The chunk's entry, or None: its pointer (no room for a call, or no candidate)."""
        if not step.calls:
            return None, None
        try:
            written = await run_chain(scope, _IndexChain(step, policy, info.run_model), None,
                                      summarizers)
        except ChainFailed:
            return None, None
        return written.text, written

    indexes = [asyncio.create_task(index_text(step)) for step in p.chunks]
    state_task = asyncio.create_task(run_chain(
        scope, _StateChain(p.state, policy, info), p.state.existing_summary or None,
        summarizers))
    held = current.prune if current.prune_held is not None else ()
    try:
        return await _commits(scope, p, indexes, state_task, surface, policy, info, held,
                              final_if_relieved=final_if_relieved)
    finally:
        for task in (*indexes, state_task):
            task.cancel()
        await asyncio.gather(*indexes, state_task, return_exceptions=True)


async def _commits(scope: RunScope, p: RecallablePass,
                   indexes: Sequence[asyncio.Task[tuple[str | None, Written | None]]],
                   state_task: asyncio.Task[Written], surface: Surface, policy: Policy,
                   info: SessionInfo, held: Sequence[PruneAction], *,
                   final_if_relieved: bool) -> tuple[SessionInfo, bool]:
    """Commit the pass left to right once every chain has ended: one commit of the index
    checkpoints and the state; the index checkpoints alone when the state's chain failed.
    ``held``: model-free edits that wait for this commit (those whose node it does not
    replace go in it, ahead of the checkpoints)."""
    out, run_id = scope.out, scope.claim.run_id
    await asyncio.wait([*indexes, state_task])
    nodes: list[tuple[Message, dict[str, Any]]] = []  # in commit_replacements' order
    if p.rollup is not None:
        nodes.append((p.rollup.message, {
            "layout": LayoutRole.INDEX, "checkpoint": str(p.rollup.ref),
            "rolled_up": p.rollup.rolled_up, "replaced_tokens": p.rollup.replaced_tokens}))
    index_messages: list[Message] = []
    for step, task in zip(p.chunks, indexes, strict=True):
        text, written = task.result()
        index_messages.append(index_checkpoint(step, text, policy, run_id=run_id))
        nodes.append((index_messages[-1], {
            "layout": LayoutRole.INDEX, "checkpoint": str(step.ref), "pointer": text is None,
            "replaced_tokens": step.replaced_tokens, "calls": len(step.calls),
            "model": written.model if written else None,
            "usage": written.usage if written else None}))
    failed: ChainFailed | None = None
    state = None
    try:
        written_state = state_task.result()
    except ChainFailed as exc:
        failed = exc
    else:
        out.model, out.summary = written_state.model, written_state.text
        state = state_checkpoint(p.state, written_state.text, policy, run_id=run_id)
        nodes.append((state, {
            "layout": LayoutRole.STATE, "checkpoint": str(p.state.ref),
            "room_tokens": p.state.room_tokens, "calls": len(p.state.calls),
            "model": written_state.model, "usage": written_state.usage,
            "skills": [s.to_json() for s in p.state.skills]}))
    reps = commit_replacements(p, 0, index_messages, info.run_model, state)
    if reps:  # (none: the state alone, and it failed)
        reps = [replace(rep, journal={"text": message.meta.get("summary"), **journal,
                                      "tokens": rep.tokens})
                for rep, (message, journal) in zip(reps, nodes, strict=True)]
        riding = riding_actions(held, (q for rep in reps for q in rep.seqs))
        reps = [*prune_replacements(riding), *reps]
        saved = sum(_tokens_of(surface, rep) for rep in reps) - sum(r.tokens for r in reps)
        # Whether this commit ends the run is decided before it, so compaction/end goes in
        # its transaction: a pass that relieved the session (or the last round's).
        predicted = read_pressure(info, surface, policy).reduced_by(saved, policy.context_window)
        final = failed is None and (not should_compact(predicted, policy)[0]
                                    or not final_if_relieved)
        info = await _commit(scope, reps, surface, final=final, predicted=predicted.tokens,
                             what="the recallable pass", pruned=len(riding))
        metrics().tokens_saved.labels(Stage.SUMMARY).inc(max(0, saved))
        scope.out.tokens_after = session_pressure(info, policy).tokens
        if final:
            return info, True
    if failed is not None:
        raise failed
    return info, False


async def _commit(scope: RunScope, reps: list[Replacement], surface: Surface, *, final: bool,
                  predicted: int, what: str, pruned: int = 0) -> SessionInfo:
    """One commit of the pass, checked against the prefix of ``surface`` through the last node
    it names; the outcome counts it only once it is written."""
    out = scope.out
    named = {q for r in reps for q in (*r.seqs, r.before, r.after) if q is not None}
    expected: list[tuple[int, int]] = []
    for node in surface.nodes:
        expected.append((node.position, node.seq))
        named.discard(node.seq)
        if not named:
            break
    seqs = [q for r in reps[pruned:] for q in r.seqs]
    kept = (list(out.replaced_seqs), list(out.stages), out.outcome, out.tokens_after,
            out.pruned)
    out.replaced_seqs.extend(seqs)
    out.pruned += pruned
    if pruned and Stage.PRUNE not in out.stages:
        out.stages.append(Stage.PRUNE)
    if Stage.SUMMARY not in out.stages:
        out.stages.append(Stage.SUMMARY)
    out.outcome = RunStatus.COMMITTED
    if final:
        out.tokens_after = predicted  # the end goes in this transaction: the outcome as it will be
    try:
        info = await scope.commit(reps, what=what, expected=expected, final=final)
    except BaseException:
        # Not committed: the outcome keeps only what was.
        out.replaced_seqs, out.stages, out.outcome, out.tokens_after, out.pruned = kept
        raise
    return info


def _tokens_of(surface: Surface, rep: Replacement) -> int:
    named = set(rep.seqs)
    return sum(n.tokens for n in surface.nodes if n.seq in named)
