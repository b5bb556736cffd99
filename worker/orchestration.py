"""One compaction, as a pipeline: the pure policy joined to storage and the models.

claim -> read -> plan -> prune (commit the prunes that pay for the agent's cache break, see
:mod:`worker.compaction.cache_breaks`; the others ride in the checkpoint's commit) -> summarize
(no transaction open) -> validate -> commit the checkpoint (fence ours, range unchanged) ->
measure again -> further rounds, bounded; a session that keeps compacting without relief is
flagged (the loop guard).
Under ``layout: recallable`` a round is a pass of that layout (:mod:`worker.passes`): its
calls concurrent, its commits left to right.

What every run has besides its steps (the lease and its renewal, the deadline, cancellation,
usage, the journal's start and end, the :class:`~worker.run.Outcome`) is the run's scope,
:class:`worker.run.RunScope`. After a failure the surface is what it was, except for prunes
already committed, which are kept on purpose: they are valid on their own and a retry starts
from them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import functools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from compactd.storage.errors import InvalidMessage, StorageError
from compactd.storage.instructions import merge_instructions
from compactd.storage.kinds import JournalKind, NodeKind, RunCause, RunStatus, Stage
from compactd.storage.records import Replacement, SessionInfo
from compactd.storage.store import Store
from compactd.storage.surface import NewNode, Surface, surface_after_commit
from compactd.storage.tokens import counter_for
from compactd.worker.chains import CannotShrink, Summarizers, run_chain, summary_request
from compactd.worker.compaction.arrivals import Arrivals
from compactd.worker.compaction.boundary import resolve_keep
from compactd.worker.compaction.planner import (
    NO_OUTLOOK,
    Outlook,
    Plan,
    checkpoint_for,
    plan,
    refill,
    replan_smaller,
)
from compactd.worker.compaction.policy import Clause, Policy, parse_keep_text
from compactd.worker.compaction.prompt import SummaryCall
from compactd.worker.compaction.pruning import prune_replacements, riding_actions
from compactd.worker.compaction.render import checkpoint_tokens
from compactd.worker.compaction.sharing import SharedCall, cache_readable, shared_call
from compactd.worker.compaction.triggers import should_compact
from compactd.worker.hooks import PreCompaction, call_hook, hook_time_s
from compactd.worker.lead import refresh_after_checkpoint
from compactd.worker.llm.fallback import SummaryRequest
from compactd.worker.metrics import metrics
from compactd.worker.passes import run_pass
from compactd.worker.pickup import predict_arrivals
from compactd.worker.pressure import ahead_tokens, read_pressure, session_policy, session_pressure
from compactd.worker.run import AUTOMATIC_TRIGGERS, MANUAL_TRIGGERS, Outcome, RunScope
from compactd.worker.runtime import Deps

logger = logging.getLogger(__name__)

# Sessions a worker process indexes at once after their runs: indexing waits mostly on the
# database's round trips, and one at a time fell behind the runs.
INDEXERS = 4
# How long a session's indexing may wait for its process to have fewer runs in flight: the
# bound of the index's lag while a worker stays busy (until then a search scans the newest
# pending originals instead, storage.recall_index.PENDING_SCANNED).
INDEX_DEFER_S = 30.0
# How often a deferred indexer looks again.
INDEX_RECHECK_S = 0.25


async def compact(deps: Deps, session_id: str, *, trigger: str = RunCause.PRESSURE,
                  force: bool = False, keep: str | Clause | None = None, task_id: str | None = None,
                  bulk_job_id: str | None = None, rate_per_s: float | None = None,
                  index_in_background: bool = False, instructions: Sequence[str] = ()
                  ) -> Outcome:
    """Run one compaction of ``session_id`` to its end; never raises for a failed run. Then
    index what it replaced for recall: before returning, or with ``index_in_background`` (a
    worker's task, whose slot the next run wants) by the process's indexer. ``instructions``:
    the focus its summary is asked to give (a manual run's), recorded on the run row; a
    manual task's run adds those its mark and its earlier deliveries hold (``take_manual``)."""
    keep_clause = parse_keep_text(keep) if isinstance(keep, str) else keep
    take_from = task_id if trigger == RunCause.MANUAL else None
    scope = await RunScope.open(deps, session_id, trigger=trigger, task_id=task_id,
                                bulk_job_id=bulk_job_id, rate_per_s=rate_per_s)
    if isinstance(scope, Outcome):
        return scope
    scope.out.instructions = tuple(instructions)
    deps.runs_in_flight += 1
    try:
        outcome = await scope.run(lambda: _rounds(scope, force=force, keep=keep_clause,
                                                  take_from=take_from))
    finally:
        deps.runs_in_flight -= 1
    if outcome.checkpoint_committed and outcome.signalled_at is not None:
        # A new measure of the time to a checkpoint: the lead the append reads follows it.
        await refresh_after_checkpoint(deps.store, deps.config)
    if deps.config.worker.recall_index and outcome.replaced_nodes:
        if index_in_background:
            if deps.indexer is None:
                # Busy: at least half the process's task slots hold runs.
                busy_at = max(1, deps.config.worker.concurrency // 2)
                deps.indexer = BackgroundIndexer(
                    deps.store, busy=lambda: deps.runs_in_flight >= busy_at)
            deps.indexer.add(session_id)
        else:
            await index_replaced(deps.store, session_id)
    return outcome


async def index_replaced(store: Store, session_id: str) -> None:
    """Index the text of what a run's commits replaced: after them, in transactions of its own
    that never take the session's row. What is left (this fails, the worker dies first) is
    found by a scan until the beat sweep indexes it."""
    try:
        await store.index_recall(session_id)
    except StorageError as exc:
        logger.warning("recall: indexing after the run failed; the sweep will index it",
                       extra={"action": "recall.index_failed", "session_id": session_id,
                              "error": str(exc)})


class BackgroundIndexer:
    """A worker process's recall indexing: the sessions whose runs committed, indexed by at
    most ``INDEXERS`` tasks on the process's loop (each a session at a time), so a run's slot is
    free as soon as its end is committed and indexing holds few connections.

    The runs go first: while ``busy()`` (the process has many runs in flight) a session waits,
    up to ``defer_s`` after it was added, so a burst of compactions does not share the worker's
    and the database's CPU with the index of the runs before it; the index catches up when the
    burst thins out, or at the bound however busy the process stays."""

    def __init__(self, store: Store, *, busy: Callable[[], bool] = lambda: False,
                 defer_s: float = INDEX_DEFER_S, recheck_s: float = INDEX_RECHECK_S) -> None:
        self.store = store
        self._busy = busy
        self._defer_s = defer_s
        self._recheck_s = recheck_s
        self._sessions: dict[str, float] = {}  # session -> when added (monotonic), oldest first
        self._tasks: set[asyncio.Task[None]] = set()

    def add(self, session_id: str) -> None:
        self._sessions.setdefault(session_id, time.monotonic())
        if len(self._tasks) < INDEXERS:
            task = asyncio.create_task(self._drain())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _drain(self) -> None:
        while self._sessions:
            session_id, added = next(iter(self._sessions.items()))
            left = added + self._defer_s - time.monotonic()
            if left > 0 and self._busy():
                await asyncio.sleep(min(self._recheck_s, left))
                continue
            del self._sessions[session_id]
            await index_replaced(self.store, session_id)

    async def aclose(self) -> None:
        """Stop; what is left is indexed by the beat sweep."""
        self._sessions.clear()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)


async def _rounds(scope: RunScope, *, force: bool, keep: Clause | None,
                  take_from: str | None = None) -> None:
    deps, out = scope.deps, scope.out
    store = deps.store
    info = scope.claim.session
    manual = out.trigger in MANUAL_TRIGGERS
    if out.trigger == RunCause.BULK and force:
        # ``recompact --force`` re-applies the policy to sessions under their trigger: it
        # ignores the trigger as a manual run does and keeps the policy's tail, where a forced
        # run keeps only the newest turn (one session's operator may want that, a fleet never).
        manual, force = True, False
    policy = await _asked(scope, info, session_policy(info, deps.config), take_from=take_from)
    if policy is None:
        return
    out.tokens_before = session_pressure(info, policy).tokens
    # Safety before cost: an overflow or forced run commits its edits at once. After a round
    # committed, the agent re-sends from that commit at its pickup whatever later rounds add,
    # so their edits and summaries are judged on relief alone, not on a cache break of their
    # own (cache_breaks.hold_edits, summary_wasted).
    edits_may_wait = not force and out.trigger != RunCause.OVERFLOW
    surface: Surface | None = None
    arrivals: Arrivals | None = None
    for round_no in range(policy.max_rounds):
        out.rounds = round_no + 1
        surface = await store.read_surface(info.id, reuse=surface)
        first = round_no == 0
        if first:
            arrivals = await _first_read(scope, info, surface, policy, force=force, keep=keep)
        current = _plan(deps, surface, info, policy, force=force and first, keep=keep,
                        manual=manual and first, defer_summary=True,
                        outlook=Outlook(arrivals=arrivals,
                                        edits_may_wait=edits_may_wait and first))
        if current.prune_held is not None:
            # Not committed here: the checkpoint's commit carries them, or a later run's.
            logger.info("model-free edits wait for a summary",
                        extra={"action": "compaction.edits_held", "reason": current.prune_held})
        elif current.prune:
            info, current, surface = await _commit_round_prunes(
                scope, current, surface, policy,
                replan=functools.partial(_plan, deps, policy=policy, force=force and first,
                                         keep=keep, manual=manual and first,
                                         outlook=Outlook(arrivals=arrivals)))
        if not current.compacts:
            _no_summary(out, round_no, current, info)
            break
        last_round = round_no + 1 >= policy.max_rounds
        if current.recall_pass is not None:
            info, relieved = await run_pass(scope, current, surface, policy, info,
                                            final_if_relieved=not last_round)
            if relieved:
                await _loop_guard(deps, out, info, policy)
        else:
            written = await _summarize(scope, current, surface, policy, info, round_no)
            if written is None:
                break
            summary, current, usage = written
            info, relieved = await _commit_checkpoint(scope, current, surface, summary, usage,
                                                      policy, info,
                                                      final_if_relieved=not last_round)
        out.outcome = RunStatus.COMMITTED
        if relieved or last_round:
            return
    # Ended without a final checkpoint commit: prune-only, nothing to do, or the last round's
    # commit left the lease held.
    if out.outcome == RunStatus.COMMITTED or out.pruned:
        out.outcome = RunStatus.COMMITTED
    final = await store.get_session(info.id)
    out.tokens_after = session_pressure(final, policy).tokens
    await scope.end()
    if Stage.SUMMARY in out.stages:
        # A summary committed in an earlier round, and a later round found nothing left to
        # do: exactly the session that is never relieved, which the guard is for.
        await _loop_guard(deps, out, final, policy)


def _no_summary(out: Outcome, round_no: int, current: Plan, info: SessionInfo) -> None:
    """Record why round ``round_no`` asked for no summary, and the growth to wait for."""
    _nothing_done(out, round_no,
                  current.prune_held or current.nothing_to_do or current.why_no_summary)
    if current.refire_growth is not None and out.trigger in AUTOMATIC_TRIGGERS:
        # Nothing worth a run until it grows: the appends until then do not fire one each
        # (worker.compaction.refire).
        out.refire = (current.standing_tokens + current.refire_growth, info.compacted_version)


async def _asked(scope: RunScope, info: SessionInfo, policy: Policy, *,
                 take_from: str | None = None) -> Policy | None:
    """The policy with the run's focus: its instructions (with ``take_from``, those its manual
    task's mark and earlier deliveries hold too) and the pre-compaction hook's; None when the
    hook vetoed the run (ended here)."""
    out, store = scope.out, scope.deps.store
    taken = out.instructions
    if take_from is not None:
        # First, before the hook is waited for: until the run row holds them, the mark does.
        taken = out.instructions = await store.take_manual(
            info.id, take_from, run_id=scope.claim.run_id, instructions=out.instructions)
    if await _vetoed(scope, info, policy):
        return None
    if out.instructions:
        if take_from is None or out.instructions != taken:
            # On the row from the start: an operator sees what a running run was asked for.
            await store.note_instructions(scope.claim.run_id, out.instructions)
        policy = dataclasses.replace(policy, focus=out.instructions)
    return policy


async def _vetoed(scope: RunScope, info: SessionInfo, policy: Policy) -> bool:
    """Ask the pre-compaction hook (worker.hooks), when one is configured: its instructions
    join the run's; its veto ends the run as nothing to do (True). Its failure is journaled
    and the run goes on."""
    deps, out = scope.deps, scope.out
    entry_point = deps.config.events.pre_compaction
    if entry_point is None:
        return False
    left = scope.deadline_at - asyncio.get_running_loop().time()
    answer = await call_hook(entry_point, PreCompaction(
        session_id=info.id, tenant=info.tenant, run_id=scope.claim.run_id,
        trigger=out.trigger, tokens=session_pressure(info, policy).tokens,
        instructions=out.instructions),
        timeout_s=hook_time_s(deps.config.events.hook_timeout_s, left))
    out.hook = answer.journal
    if answer.error is not None:
        logger.warning("the pre-compaction hook failed; the run goes on without it: %s",
                       answer.error, extra={"action": "compaction.hook_failed"})
        return False
    if answer.instructions:
        try:
            out.instructions = merge_instructions(out.instructions, answer.instructions)
        except InvalidMessage as exc:
            out.hook = {**answer.journal, "error": f"its instructions were not added: {exc}"}
    if answer.veto is None:
        return False
    out.outcome = RunStatus.NOTHING_TO_DO
    out.error = f"vetoed by the pre-compaction hook: {answer.veto}"
    out.tokens_before = out.tokens_after = session_pressure(info, policy).tokens
    await scope.end()
    return True


def _plan(deps: Deps, surface: Surface, info: SessionInfo, policy: Policy, *, force: bool,
          keep: Clause | None, manual: bool = False, defer_summary: bool = False,
          outlook: Outlook = NO_OUTLOOK) -> Plan:
    """``force`` ignores the trigger and the keep policy (overflow, ``--force``); a manual run
    without it ignores only the trigger: someone asked for this compaction, but the recent
    history the policy keeps stays (DeepSeek Harness's idle-session ``/compact``). The session's
    lead and last append complete ``outlook``."""
    if manual and not force:
        force, keep = True, keep or resolve_keep(policy)
    now = deps.clock()
    outlook = dataclasses.replace(
        outlook, lead_tokens=0 if force else ahead_tokens(info, policy, deps.config, now),
        last_append_at=info.last_append_at)
    return plan(surface.nodes, policy=policy, envelope_tokens=info.envelope_tokens,
                reported_input_tokens=info.reported_tokens, run_model=info.run_model,
                now=now, force=force, keep_override=keep, envelope=info.envelope,
                defer_summary=defer_summary, outlook=outlook)


async def _first_read(scope: RunScope, info: SessionInfo, surface: Surface, policy: Policy, *,
                      force: bool, keep: Clause | None) -> Arrivals | None:
    """What the run starts from is what it read: appends may have come after the claim. An
    automatic run also expects what the agent appends before its pickup (keep_at: pickup)."""
    deps, out = scope.deps, scope.out
    out.tokens_before = read_pressure(info, surface, policy).tokens
    if keep is not None or force or out.trigger not in AUTOMATIC_TRIGGERS:
        # An explicit keep is taken as given, a forced reduction has no keep, and a manual or
        # bulk run keeps the policy's tail of a session that may be idle (its growth rate can
        # still carry an ingest's burst).
        return None
    arrivals = await predict_arrivals(deps.store, deps.config, info, policy, surface.nodes,
                                      deps.clock())
    out.arrivals = arrivals.to_json() if arrivals is not None else None
    return arrivals


async def _commit_round_prunes(scope: RunScope, current: Plan, surface: Surface, policy: Policy,
                               *, replan: Callable[..., Plan]
                               ) -> tuple[SessionInfo, Plan, Surface]:
    """Commit a round's prunes on their own; with the summary deferred, plan it on the surface
    they made (``replan``)."""
    out = scope.out
    info = await _commit_prunes(scope, current)
    out.pruned += len(current.prune)
    out.stages.append(Stage.PRUNE)
    # Durable whatever comes next: a run that fails later reports the surface it left.
    out.tokens_after = session_pressure(info, policy).tokens
    if current.summary_deferred:
        # The pruned surface is known without a read, unless an append came in between.
        surface = surface_after_commit(
            surface, [NewNode((a.seq,), NodeKind.PRUNED, a.message, a.tokens_after)
                      for a in current.prune],
            version=info.surface_version, last_seq=info.last_seq
        ) or await scope.deps.store.read_surface(info.id, reuse=surface)
        current = replan(surface, info)
    if not current.compacts:
        metrics().prune_only.inc()
    return info, current, surface


async def _commit_prunes(scope: RunScope, current: Plan) -> SessionInfo:
    info = await scope.commit(prune_replacements(current.prune), what="the prunes")
    metrics().tokens_saved.labels(Stage.PRUNE).inc(sum(a.saved for a in current.prune))
    return info


class _Calls:
    """The summarizer calls of one merge step (a :class:`~worker.chains.Chain`).

    With ``shared`` (:mod:`worker.compaction.sharing`), one call that begins with the runtime's
    last request reads the whole range; a context-length error on it falls back to the planned
    calls. A context-length error on the first planned call re-plans once with half the budget
    (every replaced message still reaches an input: smaller calls, or with ``shrink`` a smaller
    range); later calls are budget-sized already, so an error there moves on to the next
    candidate. Once a call has answered, the calls after it are packed again around its summary
    (:func:`~worker.compaction.planner.refill`).
    """

    def __init__(self, current: Plan, policy: Policy, info: SessionInfo,
                 shared: SharedCall | None = None) -> None:
        self.plan = current
        self.policy = policy
        self.info = info
        self.shared = shared
        self.shrunk = False

    @property
    def step(self) -> Any:
        assert self.plan.summarize is not None
        return self.plan.summarize

    @property
    def calls(self) -> Sequence[SummaryCall]:
        if self.shared is not None:
            planned = self.step.calls
            return (SummaryCall(0, tuple(p for call in planned for p in call.pieces),
                                self.shared.input_tokens, planned[0].summary_seqs),)
        return self.step.calls

    def request(self, index: int, running: str | None) -> SummaryRequest:
        step = self.step
        if self.shared is not None:
            shared = self.shared
            call = self.calls[0]
            planned = summary_request(call, running, policy=self.policy, info=self.info,
                                      skills=step.skills, has_history=step.has_history,
                                      recall=step.recall, below=step.replaced_tokens)
            return dataclasses.replace(planned, chat=shared.chat, tools=shared.tools,
                                       cache=shared.cache)
        if index > 0 and running is not None:
            # The summary before this call is known now: the calls left reserve its size.
            self.plan = refill(self.plan, index, running)
            step = self.step
        # Intermediate summaries only have to fit the cap; the final one must also be strictly
        # smaller than everything it replaces.
        final = index == len(step.calls) - 1
        return summary_request(step.calls[index], running, policy=self.policy, info=self.info,
                               skills=step.skills, has_history=step.has_history,
                               recall=step.recall,
                               below=step.replaced_tokens if final else None)

    def shrink(self, index: int, request: SummaryRequest) -> SummaryRequest | None:
        if index != 0:
            return None
        if self.shared is not None:
            # The agent's request plus the instruction is over what the model takes: the
            # planned calls, each within the summarizer's budget, read the range instead.
            self.shared = None
            return self.request(0, request.existing_summary)
        if self.shrunk:
            return None
        smaller = replan_smaller(self.plan)
        if smaller.summarize is None:
            return None
        self.plan, self.shrunk = smaller, True
        return self.request(0, request.existing_summary)


def _nothing_done(out: Outcome, round_no: int, reason: str | None) -> None:
    """Why a run's first round found nothing to commit (a later round's reason is not the
    run's: an earlier round committed)."""
    if round_no == 0 and not out.pruned:
        out.error = reason


async def _summarize(scope: RunScope, current: Plan, surface: Surface, policy: Policy,
                     info: SessionInfo, round_no: int
                     ) -> tuple[str, Plan, dict[str, Any] | None] | None:
    """The summary, the plan as made and its usage; None when the range cannot shrink."""
    summarizers = Summarizers.of(scope, info.run_model, policy.model_name)
    calls = _Calls(current, policy, info, _shared(current, surface, policy, info, summarizers))
    try:
        written = await run_chain(scope, calls, calls.step.existing_summary or None,
                                  summarizers)
    except CannotShrink as exc:
        # Nothing of this round is committed and the run ends as if the plan had found
        # nothing (what earlier rounds committed stands); the range grows with the session
        # and a later run replaces it.
        logger.info("the summary would not shrink the range: nothing to commit",
                    extra={"action": "compaction.cannot_shrink", "reason": exc.reason})
        _nothing_done(scope.out, round_no, f"the range is too small to shrink: {exc.reason}")
        return None
    scope.out.model = written.model
    made = calls.plan
    if calls.shared is not None:
        # The journal names the calls made: one, reading the whole range.
        made = dataclasses.replace(made, summarize=dataclasses.replace(
            calls.step, calls=tuple(calls.calls)))
    return written.text, made, written.usage


def _shared(current: Plan, surface: Surface, policy: Policy, info: SessionInfo,
            summarizers: Summarizers) -> SharedCall | None:
    """The call sharing the agent's cache, when it applies: the switch is on, the first
    candidate is the session's own run model (a different summary model has another cache) and
    its provider can read the runtime's cache."""
    step = current.summarize
    first = summarizers.candidates[0] if summarizers.candidates else None
    if (step is None or not policy.share_cache or first is None or first.is_local
            or first.name != info.run_model or not cache_readable(first.provider, info.envelope)):
        return None
    return shared_call(surface.nodes, step.replace_seqs, policy, info.envelope,
                       info.envelope_tokens, counter_for(info.run_model), step.kept_inside)


async def _commit_checkpoint(scope: RunScope, current: Plan, surface: Surface, summary: str,
                             usage: dict[str, Any] | None, policy: Policy, info: SessionInfo,
                             *, final_if_relieved: bool
                             ) -> tuple[SessionInfo, bool]:
    out = scope.out
    step = current.summarize
    assert step is not None
    message = checkpoint_for(step, summary, policy, run_id=scope.claim.run_id)
    tokens = checkpoint_tokens(message, info.run_model)
    # Held edits ride in this commit: those inside the range are replaced with it (the summary
    # read their edited text), the others are replaced beside it.
    held = current.prune if current.prune_held is not None else ()
    riding = riding_actions(held, step.replace_seqs)
    named = {step.replace_seqs[-1], *(a.seq for a in riding)}
    expected: list[tuple[int, int]] = []
    for node in surface.nodes:
        expected.append((node.position, node.seq))
        named.discard(node.seq)
        if not named:
            break
    # Decide before committing whether this round ends the run, so compaction/end can go in
    # the same transaction as the checkpoint (a crash then never leaves a committed checkpoint
    # behind an open start).
    # The range's tokens were counted with the held edits applied; what they save is saved too.
    saved = step.replaced_tokens - tokens + sum(a.saved for a in held)
    # Measured on the surface the plan replaced nodes of, not on ``info``: the claim's row (or
    # the last commit's) does not count what was appended before the read, and the prediction
    # would fall below what the checkpoint leaves, even below zero.
    now_pressure = read_pressure(info, surface, policy)
    predicted = now_pressure.reduced_by(saved, policy.context_window)
    relieved = not should_compact(predicted, policy)[0]
    final = relieved or not final_if_relieved
    kept = (list(out.replaced_seqs), list(out.stages), out.pruned)
    out.replaced_seqs.extend(step.replace_seqs)
    if riding and Stage.PRUNE not in out.stages:
        out.stages.append(Stage.PRUNE)
    out.pruned += len(riding)
    out.stages.append(Stage.SUMMARY)
    out.summary = summary
    journal = {"text": summary, "replaced_tokens": step.replaced_tokens, "tokens": tokens,
               "model": out.model, "calls": len(step.calls), "usage": usage,
               "skills": [s.to_json() for s in step.skills]}
    if policy.focus:
        journal["instructions"] = list(policy.focus)
    rep = Replacement(seqs=step.replace_seqs, kind=NodeKind.CHECKPOINT,
                      payload=message.to_payload(), tokens=tokens,
                      journal_kind=JournalKind.SUMMARY, journal=journal,
                      keeps=step.kept_inside)
    durable_tokens = out.tokens_after
    if final:
        # The end goes in the checkpoint's transaction: the outcome as it will be.
        out.outcome = RunStatus.COMMITTED
        out.tokens_after = predicted.tokens
    try:
        # The checkpoint first: a held edit of a node it keeps would give that node a new seq.
        info = await scope.commit([rep, *prune_replacements(riding)], what="the checkpoint",
                                  expected=expected, final=final)
    except BaseException:
        # Not committed: the outcome keeps only what was.
        out.replaced_seqs, out.stages, out.pruned = kept
        out.tokens_after = durable_tokens
        raise
    pruned_saved = sum(a.saved for a in riding)
    if pruned_saved:
        metrics().tokens_saved.labels(Stage.PRUNE).inc(pruned_saved)
    metrics().tokens_saved.labels(Stage.SUMMARY).inc(max(0, saved - pruned_saved))
    out.tokens_after = session_pressure(info, policy).tokens
    if final:
        await _loop_guard(scope.deps, out, info, policy)
    return info, final


async def _loop_guard(deps: Deps, out: Outcome, info: SessionInfo, policy: Policy) -> None:
    """Flag and cool down a session that keeps compacting without relief."""
    if out.trigger not in AUTOMATIC_TRIGGERS:
        return
    guard = deps.config.worker.loop_guard
    now = deps.clock()
    since = now - dt.timedelta(seconds=guard.window_s)
    runs = await deps.store.recent_runs(session_id=info.id, since=since, status=RunStatus.COMMITTED,
                                        limit=guard.max_compactions + 1)
    metrics().compactions_per_session.observe(len(runs))
    threshold = policy.threshold_tokens()
    if threshold is None:
        return
    relief = threshold * (1 - guard.margin)
    if info.flagged_reason and out.tokens_after is not None and out.tokens_after < relief:
        # Relief came (the cool-down is over and this run got well under the trigger): the flag
        # would otherwise stay in status forever.
        await deps.store.clear_flag(info.id)
        return
    if len(runs) <= guard.max_compactions:
        return
    if all(r.tokens_after is not None and r.tokens_after >= relief for r in runs):
        reason = (f"{len(runs)} compactions in {guard.window_s:g} s without pressure falling "
                  f"below {relief:.0f} tokens")
        await deps.store.flag_session(info.id, reason=reason,
                                      cooldown_until=now + dt.timedelta(seconds=guard.cooldown_s),
                                      now=now)
        metrics().loop_guard_flags.inc()
        logger.warning("loop guard: session cooled down", extra={"action": "loop_guard.flag",
                                                                   "reason": reason})
