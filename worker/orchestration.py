"""One compaction: the pure policy joined to storage and the models, under the lease protocol.

claim (short transaction) -> read -> plan -> commit the prunes -> summarize (no transaction
open; the lease renewed meanwhile) -> validate -> commit the checkpoint (short transaction: fence
ours, range unchanged; ``compaction/end`` last) -> measure again -> further rounds, bounded.

Every way a run can end is an :class:`Outcome`: committed, nothing_to_do, or failed with one class
(busy, cancelled, changed, summary, commit, persistence, abandoned). A run is bounded by
``worker.deadline_s`` from its claim: past it, it ends ``cancelled``. After a failure the surface
is what it was, except for prunes already committed, which are kept on purpose: they are valid on
their own and a retry starts from them.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from storage.database import deadline
from storage.errors import DeadlinePassed, LeaseLost, StorageError, SurfaceChanged
from storage.records import Busy, Claim, Replacement, RunEnd, SessionInfo, Skipped
from storage.surface import (
    JOURNAL_PRUNE,
    JOURNAL_SUMMARY,
    KIND_CHECKPOINT,
    KIND_PRUNED,
    NewNode,
    Surface,
    surface_after_commit,
)
from worker import logs
from worker.compaction.boundary import resolve_keep
from worker.compaction.planner import Plan, checkpoint_for, plan, replan_smaller
from worker.compaction.policy import Clause, Policy, parse_keep_text
from worker.compaction.prompt import build_prompt, request_tools
from worker.compaction.render import checkpoint_tokens
from worker.compaction.triggers import should_compact
from worker.compaction.validation import validate_summary
from worker.keys import RATE_PROVIDER, bulk_meter
from worker.llm.candidates import candidate_order
from worker.llm.errors import SummaryFailed
from worker.llm.fallback import RetryPolicy, SummaryRequest, summarize
from worker.metrics import metrics
from worker.pressure import read_pressure, session_policy, session_pressure
from worker.runtime import Deps

logger = logging.getLogger(__name__)

AUTOMATIC_TRIGGERS = ("pressure", "sweep", "reap")
MANUAL_TRIGGERS = ("manual",)
# How long after its deadline the loop cancels a run still waiting on something the deadline
# does not reach by itself (the statements it does end on the server, cleanly, first).
DEADLINE_OVERRUN_S = 1.0
# A run that ends failed (past its deadline too) still writes its end and releases its lease,
# within this long; at most half of what is left between the deadline and the task's limit.
FINISH_GRACE_S = 10.0
# The part of a run's deadline the remote models never get (at most a tenth of it): the local
# fallback writes its summary and the checkpoint is committed in it.
COMMIT_RESERVE_S = 10.0


@dataclass
class Outcome:
    session: str
    run_id: str | None
    outcome: str  # committed | nothing_to_do | failed
    failure_class: str | None = None
    trigger: str = "pressure"
    tokens_before: int | None = None
    tokens_after: int | None = None
    pruned: int = 0
    replaced_seqs: list[int] = field(default_factory=list)
    model: str | None = None
    stages: list[str] = field(default_factory=list)
    candidates: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None
    summary: str | None = None
    rounds: int = 0
    rate_wait_s: float = 0.0  # how long the model calls waited on the shared rate meters
    ended: bool = False  # the run's end is committed (run row and compaction/end written)
    # Tokens the providers billed for the run's model calls: totals and per candidate.
    usage: dict[str, Any] | None = None

    @property
    def failed(self) -> bool:
        return self.outcome == "failed"

    def to_json(self) -> dict[str, Any]:
        return {"session": self.session, "run_id": self.run_id, "outcome": self.outcome,
                "failure_class": self.failure_class, "tokens_before": self.tokens_before,
                "tokens_after": self.tokens_after, "pruned": self.pruned,
                "replaced_seqs": self.replaced_seqs, "model": self.model,
                "stages": self.stages, "rounds": self.rounds, "trigger": self.trigger,
                "rate_wait_s": round(self.rate_wait_s, 3), "usage": self.usage,
                "error": self.error, "candidates": self.candidates}

    def brief(self) -> dict[str, Any]:
        """The outcome at a glance, which the Celery task returns (Flower's result column).
        The replaced seqs and the candidates' attempts stay in the run row: Celery renders
        a task's return value for its log line and its event, and with them the rendering
        cost a worker ~0.2 ms of CPU per compaction."""
        return {"session": self.session, "run_id": self.run_id, "outcome": self.outcome,
                "failure_class": self.failure_class, "trigger": self.trigger,
                "tokens_before": self.tokens_before, "tokens_after": self.tokens_after,
                "stages": self.stages, "model": self.model, "error": self.error}

    def run_end(self) -> RunEnd:
        return RunEnd(outcome=self.outcome, failure_class=self.failure_class, error=self.error,
                      tokens_before=self.tokens_before, tokens_after=self.tokens_after,
                      model=self.model, usage=self.usage, candidates=self.candidates or None,
                      stages={"stages": self.stages, "pruned": self.pruned,
                              "rounds": self.rounds,
                              "rate_wait_s": round(self.rate_wait_s, 3)},
                      range_seqs=self.replaced_seqs or None)


def _failure(exc: BaseException, *, past_deadline: bool, deadline_s: float
             ) -> tuple[str, str]:
    """The failure class and error of a run that ended with ``exc``. Once the deadline has
    passed, a failed write (a lock wait or a statement the deadline ended) is the deadline's
    doing: ``cancelled``."""
    passed = f"the run passed its deadline ({deadline_s:g} s)"
    if isinstance(exc, TimeoutError | DeadlinePassed):
        return "cancelled", passed
    if isinstance(exc, LeaseLost):
        return "abandoned", str(exc)
    if isinstance(exc, SurfaceChanged):
        return "changed", str(exc)
    if isinstance(exc, RunFailed):
        if past_deadline and exc.failure_class == "commit":
            return "cancelled", f"{passed}: {exc.error}"
        return exc.failure_class, exc.error
    # A storage error before anything was committed is a persistence failure; the commit
    # steps raise their own (RunFailed "commit").
    if past_deadline:
        return "cancelled", f"{passed}: {exc}"
    return "persistence", str(exc)


class RunFailed(Exception):
    def __init__(self, failure_class: str, error: str) -> None:
        super().__init__(error)
        self.failure_class = failure_class
        self.error = error


async def compact(deps: Deps, session_id: str, *, trigger: str = "pressure", force: bool = False,
                  keep: str | Clause | None = None, task_id: str | None = None,
                  bulk_job_id: str | None = None, rate_per_s: float | None = None) -> Outcome:
    """Run one compaction of ``session_id`` to its end; never raises for a failed run."""
    keep_clause = parse_keep_text(keep) if isinstance(keep, str) else keep
    lease_s = deps.config.worker.lease_s
    deadline_s = deps.config.worker.deadline_s
    loop = asyncio.get_running_loop()
    deadline_at = loop.time() + deadline_s
    with deadline(deadline_at):
        claim = await deps.store.claim(session_id, owner=deps.owner, trigger=trigger,
                                       lease_s=lease_s, now=deps.clock(), task_id=task_id,
                                       bulk_job_id=bulk_job_id)
    if isinstance(claim, Skipped):
        return _counted(Outcome(session_id, None, "nothing_to_do", trigger=trigger,
                                error=claim.reason))
    if isinstance(claim, Busy):
        return _counted(Outcome(session_id, claim.run_id, "failed", "busy", trigger=trigger,
                                error=f"leased by {claim.holder}"))
    out = Outcome(session_id, claim.run_id, "nothing_to_do", trigger=trigger)
    metrics().in_flight.inc()
    with logs.bind(session_id=session_id, run_id=claim.run_id):
        try:
            # Statements end at the deadline on the server (storage.database.deadline); the
            # loop's own timeout, a moment later, ends whatever else still waits.
            with deadline(deadline_at):
                async with asyncio.timeout_at(deadline_at + DEADLINE_OVERRUN_S), \
                        _kept_lease(deps, claim, lease_s) as lease:
                    try:
                        await _rounds(deps, claim, lease, out, deadline_at, force=force,
                                      keep=keep_clause, rate_per_s=rate_per_s,
                                      bulk_job_id=bulk_job_id)
                    except asyncio.CancelledError:
                        if not lease.lost.is_set():
                            raise
                        current = asyncio.current_task()
                        if current is not None:
                            current.uncancel()
                        raise LeaseLost("the lease could not be renewed") from None
        except asyncio.CancelledError:
            # Worker shutdown, a revoked task or the task's time limit: record it, then let
            # the cancellation through.
            if not out.ended:
                _fail(out, "cancelled", "the run was cancelled before it committed")
                with contextlib.suppress(Exception):
                    await asyncio.shield(_finish(deps, claim, out))
            raise
        except (TimeoutError, StorageError, RunFailed) as exc:
            if out.ended:
                # The run's end is committed: what failed after it (the loop guard's
                # bookkeeping) does not make it a failed run.
                logger.warning("after the run ended: %s", type(exc).__name__,
                               extra={"action": "compaction.after_end"})
            else:
                _fail(out, *_failure(exc, past_deadline=loop.time() >= deadline_at,
                                     deadline_s=deadline_s))
                await _finish_quietly(deps, claim, out)
        finally:
            metrics().in_flight.dec()
        signalled_at = claim.session.signal_at
        if out.outcome == "committed" and trigger in AUTOMATIC_TRIGGERS and signalled_at:
            # The wait an agent under pressure has for its checkpoint: the alert on the runway
            # (ops/prometheus/alerts.yaml) compares its p99 with the least runway.
            metrics().pressure_to_checkpoint.labels(trigger).observe(
                max(0.0, (deps.clock() - signalled_at).total_seconds()))
        logger.info("compaction %s%s", out.outcome,
                    f" ({out.failure_class})" if out.failure_class else "",
                    extra={"action": "compaction.end", "outcome": out.outcome,
                           "failure_class": out.failure_class, "trigger": trigger,
                           "tokens_before": out.tokens_before, "tokens_after": out.tokens_after,
                           "stages": out.stages, "model": out.model})
    return _counted(out)


async def _rounds(deps: Deps, claim: Claim, lease: _KeptLease, out: Outcome,
                  deadline_at: float, *, force: bool, keep: Clause | None,
                  rate_per_s: float | None, bulk_job_id: str | None) -> None:
    store = deps.store
    info = claim.session
    manual = out.trigger in MANUAL_TRIGGERS
    policy = session_policy(info, deps.config)
    out.tokens_before = session_pressure(info, policy).tokens
    surface: Surface | None = None
    for round_no in range(policy.max_rounds):
        out.rounds = round_no + 1
        surface = await store.read_surface(info.id, reuse=surface)
        first = round_no == 0
        if first:
            # What the run starts from is what it read: appends may have come after the claim.
            out.tokens_before = read_pressure(info, surface, policy).tokens
        current = _plan(deps, surface, info, policy, force=force and first, keep=keep,
                        manual=manual and first, defer_summary=True)
        if current.prune:
            info = await _commit_prunes(deps, claim, current)
            out.pruned += len(current.prune)
            out.stages.append("prune")
            # Durable whatever comes next: a run that fails later reports the surface it left.
            out.tokens_after = session_pressure(info, policy).tokens
            if current.summary_deferred:
                # The pruned surface is known without a read, unless an append came in between.
                surface = surface_after_commit(
                    surface, [NewNode((a.seq,), KIND_PRUNED, a.message, a.tokens_after)
                              for a in current.prune],
                    version=info.surface_version, last_seq=info.last_seq
                ) or await store.read_surface(info.id, reuse=surface)
                current = _plan(deps, surface, info, policy, force=force and first, keep=keep,
                                manual=manual and first)
            if current.summarize is None:
                metrics().prune_only.inc()
        if current.summarize is None:
            if round_no == 0 and not out.pruned:
                out.error = current.nothing_to_do or current.why_no_summary
            break
        summary, current, usage = await _summarize(deps, current, policy, info, out,
                                                   deadline_at, rate_per_s, bulk_job_id)
        last_round = round_no + 1 >= policy.max_rounds
        info, relieved = await _commit_checkpoint(deps, claim, lease, out, current, surface,
                                                  summary, usage, policy, info,
                                                  final_if_relieved=not last_round)
        out.outcome = "committed"
        if relieved or last_round:
            return
    # Ended without a final checkpoint commit: prune-only, nothing to do, or the last round's
    # commit left the lease held.
    if out.outcome == "committed" or out.pruned:
        out.outcome = "committed"
    final = await store.get_session(info.id)
    out.tokens_after = session_pressure(final, policy).tokens
    await lease.stop()
    if not await store.finish(info.id, run_id=claim.run_id, fence=claim.fence,
                              end=out.run_end(), now=deps.clock()):
        raise LeaseLost("the lease was lost before the run ended")
    out.ended = True
    if "summary" in out.stages:
        # A summary committed in an earlier round, and a later round found nothing left to
        # do: exactly the session that is never relieved, which the guard is for.
        await _loop_guard(deps, out, final, policy)


def _plan(deps: Deps, surface: Surface, info: SessionInfo, policy: Policy, *, force: bool,
          keep: Clause | None, manual: bool = False, defer_summary: bool = False) -> Plan:
    """``force`` ignores the trigger and the keep policy (overflow, ``--force``); a manual run
    without it ignores only the trigger: someone asked for this compaction, but the recent
    history the policy keeps stays (DeepSeek Harness's idle-session ``/compact``)."""
    if manual and not force:
        force, keep = True, keep or resolve_keep(policy)
    return plan(surface.nodes, policy=policy, envelope_tokens=info.envelope_tokens,
                reported_input_tokens=info.reported_tokens, run_model=info.run_model,
                now=deps.clock(), force=force, keep_override=keep, envelope=info.envelope,
                defer_summary=defer_summary)


async def _commit_prunes(deps: Deps, claim: Claim, current: Plan) -> SessionInfo:
    reps = [Replacement(seqs=(a.seq,), kind=KIND_PRUNED, payload=a.message.to_payload(),
                        tokens=a.tokens_after, journal_kind=JOURNAL_PRUNE,
                        journal={"seq": a.seq, "tokens_before": a.tokens_before,
                                 "tokens_after": a.tokens_after, "saved": a.saved,
                                 "edits": list(a.edits)})
            for a in current.prune]
    try:
        info = await deps.store.commit(claim.session.id, run_id=claim.run_id, fence=claim.fence,
                                       replacements=reps, now=deps.clock())
    except (LeaseLost, SurfaceChanged, DeadlinePassed):
        raise
    except StorageError as exc:
        raise RunFailed("commit", f"committing the prunes failed: {exc}") from exc
    metrics().tokens_saved.labels("prune").inc(sum(a.saved for a in current.prune))
    return info


class _Calls:
    """The summarizer calls of one step, run in order, each merging into the running summary.

    A context-length error on the first call re-plans once with half the budget (every replaced
    message still reaches an input: smaller calls, or with ``shrink`` a smaller range); later
    calls are budget-sized already, so an error there moves on to the next candidate.
    """

    def __init__(self, current: Plan, policy: Policy, info: SessionInfo) -> None:
        self.plan = current
        self.policy = policy
        self.info = info
        self.index = 0
        self.shrunk = False

    @property
    def step(self) -> Any:
        assert self.plan.summarize is not None
        return self.plan.summarize

    def request(self, running: str | None) -> SummaryRequest:
        step, policy, info = self.step, self.policy, self.info
        last = self.index == len(step.calls) - 1

        def check(text: str) -> str | None:
            # Intermediate summaries only have to fit the cap; the final one must also be
            # strictly smaller than everything it replaces.
            return validate_summary(text, replaced_tokens=step.replaced_tokens if last else None,
                                    policy=policy, run_model=info.run_model, skills=step.skills,
                                    has_history=step.has_history, recall=step.recall)

        chat = build_prompt(step.calls[self.index], running, policy, info.envelope)
        return SummaryRequest.of(chat, messages=step.calls[self.index].messages,
                                 existing_summary=running, max_tokens=policy.max_summary_tokens,
                                 validate=check, tools=request_tools(policy, info.envelope))

    def shrink(self, request: SummaryRequest, _candidate: Any) -> SummaryRequest | None:
        if self.index != 0 or self.shrunk:
            return None
        smaller = replan_smaller(self.plan)
        if smaller.summarize is None:
            return None
        self.plan, self.shrunk = smaller, True
        return self.request(request.existing_summary)


async def _summarize(deps: Deps, current: Plan, policy: Policy, info: SessionInfo, out: Outcome,
                     run_deadline_at: float, rate_per_s: float | None, bulk_job_id: str | None
                     ) -> tuple[str, Plan, dict[str, Any] | None]:
    config = deps.config
    candidates = candidate_order(run_model=info.run_model, summary_model=policy.model_name,
                                 models=config.models, default_model=config.default_model,
                                 local_fallback=config.worker.local_fallback)
    retry = RetryPolicy.from_config(config.worker)
    providers = _providers(deps, rate_per_s, bulk_job_id, out)
    loop = asyncio.get_running_loop()
    deadline_at = run_deadline_at - min(COMMIT_RESERVE_S, config.worker.deadline_s / 10)
    calls = _Calls(current, policy, info)
    running: str | None = calls.step.existing_summary or None
    step_usage: dict[str, Any] | None = None
    while calls.index < len(calls.step.calls):
        try:
            outcome = await summarize(
                calls.request(running), candidates=candidates, validate=lambda _text: None,
                deadline_s=max(0.0, deadline_at - loop.time()), providers=providers,
                retry=retry, on_context_length=calls.shrink)
        except SummaryFailed as exc:
            out.candidates.extend(a.to_json() for a in exc.attempts)
            _observe_attempts(exc.attempts)
            _bill(out, None, exc.attempts)
            raise RunFailed("summary", f"every candidate failed on call {calls.index + 1} of "
                            f"{len(calls.step.calls)}") from exc
        out.candidates.extend(a.to_json() for a in outcome.attempts)
        _observe_attempts(outcome.attempts)
        metrics().fallback_depth.observe(max(0, len(outcome.attempts) - 1))
        step_usage = _bill(out, step_usage, outcome.attempts)
        out.model = outcome.model
        running = outcome.text
        calls.index += 1
    assert running is not None
    return running, calls.plan, step_usage


USAGE_KINDS = ("input_tokens", "cached_tokens", "output_tokens")


def _bill(out: Outcome, step_usage: dict[str, Any] | None, attempts: Sequence[Any]
          ) -> dict[str, Any] | None:
    """Add what the providers billed for ``attempts`` (every call that got an answer, refused
    ones too) to the run's usage, the step's (returned) and the metrics."""
    for attempt in attempts:
        reported = attempt.usage.to_json() if attempt.usage is not None else {}
        if all(reported.get(kind) is None for kind in USAGE_KINDS):
            continue  # no answer, or the local summarizer (no call)
        tokens = {kind: int(reported.get(kind) or 0) for kind in USAGE_KINDS}
        step_usage = _add_usage(step_usage, attempt.candidate, tokens)
        out.usage = _add_usage(out.usage, attempt.candidate, tokens)
        for kind, value in tokens.items():
            metrics().model_tokens.labels(attempt.candidate,
                                          kind.removesuffix("_tokens")).inc(value)
    return step_usage


def _add_usage(total: dict[str, Any] | None, candidate: str, tokens: dict[str, int]
               ) -> dict[str, Any]:
    """``total`` with one more call's tokens, overall and under its candidate."""
    total = total or {"calls": 0, **dict.fromkeys(USAGE_KINDS, 0), "by_candidate": {}}
    mine = total["by_candidate"].setdefault(candidate,
                                            {"calls": 0, **dict.fromkeys(USAGE_KINDS, 0)})
    for counts in (total, mine):
        counts["calls"] += 1
        for kind, value in tokens.items():
            counts[kind] += value
    return total


def _observe_attempts(attempts: Sequence[Any]) -> None:
    m = metrics()
    for a in attempts:
        m.model_latency.labels(a.candidate).observe(a.latency_s)
        if a.kind is not None:
            m.model_failures.labels(a.candidate, a.kind).inc()


async def _commit_checkpoint(deps: Deps, claim: Claim, lease: _KeptLease, out: Outcome,
                             current: Plan, surface: Surface, summary: str,
                             usage: dict[str, Any] | None, policy: Policy, info: SessionInfo,
                             *, final_if_relieved: bool
                             ) -> tuple[SessionInfo, bool]:
    step = current.summarize
    assert step is not None
    message = checkpoint_for(step, summary, policy, run_id=claim.run_id)
    tokens = checkpoint_tokens(message, info.run_model)
    last_replaced = step.replace_seqs[-1]
    expected: list[tuple[int, int]] = []
    for node in surface.nodes:
        expected.append((node.position, node.seq))
        if node.seq == last_replaced:
            break
    # Decide before committing whether this round ends the run, so compaction/end can go in
    # the same transaction as the checkpoint (a crash then never leaves a committed checkpoint
    # behind an open start).
    saved = step.replaced_tokens - tokens
    # Measured on the surface the plan replaced nodes of, not on ``info``: the claim's row (or
    # the last commit's) does not count what was appended before the read, and the prediction
    # would fall below what the checkpoint leaves, even below zero.
    now_pressure = read_pressure(info, surface, policy)
    predicted = now_pressure.reduced_by(saved, policy.context_window)
    relieved = not should_compact(predicted, policy)[0]
    final = relieved or not final_if_relieved
    out.replaced_seqs.extend(step.replace_seqs)
    out.stages.append("summary")
    out.summary = summary
    journal = {"text": summary, "replaced_tokens": step.replaced_tokens, "tokens": tokens,
               "model": out.model, "calls": len(step.calls), "usage": usage,
               "skills": [s.to_json() for s in step.skills]}
    rep = Replacement(seqs=step.replace_seqs, kind=KIND_CHECKPOINT,
                      payload=message.to_payload(), tokens=tokens,
                      journal_kind=JOURNAL_SUMMARY, journal=journal)
    end = None
    durable_tokens = out.tokens_after
    if final:
        out.outcome = "committed"
        out.tokens_after = predicted.tokens
        end = out.run_end()
        await lease.stop()
    try:
        info = await deps.store.commit(info.id, run_id=claim.run_id, fence=claim.fence,
                                       replacements=[rep], expected=expected, end=end,
                                       now=deps.clock())
    except BaseException as exc:
        # Not committed: the outcome keeps only what was.
        out.replaced_seqs = out.replaced_seqs[:-len(step.replace_seqs)]
        out.stages.pop()
        out.tokens_after = durable_tokens
        if isinstance(exc, StorageError) and not isinstance(
                exc, LeaseLost | SurfaceChanged | DeadlinePassed):
            raise RunFailed("commit", f"committing the checkpoint failed: {exc}") from exc
        raise
    metrics().tokens_saved.labels("summary").inc(max(0, saved))
    out.tokens_after = session_pressure(info, policy).tokens
    if final:
        out.ended = True
        await _loop_guard(deps, out, info, policy)
    return info, final


async def _loop_guard(deps: Deps, out: Outcome, info: SessionInfo, policy: Policy) -> None:
    """Flag and cool down a session that keeps compacting without relief."""
    if out.trigger not in AUTOMATIC_TRIGGERS:
        return
    guard = deps.config.worker.loop_guard
    now = deps.clock()
    since = now - dt.timedelta(seconds=guard.window_s)
    runs = await deps.store.recent_runs(session_id=info.id, since=since, status="committed",
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


class _KeptLease:
    """The renewer of one run's lease. :meth:`stop` ends it before the run's ending commit:
    that commit clears the lease, and a renewal after it would find the fence gone and cancel
    a run that has already committed."""

    def __init__(self, deps: Deps, claim: Claim, lease_s: float) -> None:
        self.lost = asyncio.Event()
        self._stopped = False
        self._renewing = False
        self._body = asyncio.current_task()
        self._task = asyncio.create_task(self._renew(deps, claim, lease_s))

    async def _renew(self, deps: Deps, claim: Claim, lease_s: float) -> None:
        while not self._stopped:
            await asyncio.sleep(lease_s / 3)
            if self._stopped:
                return
            self._renewing = True
            try:
                ok = await deps.store.renew(claim.session.id, run_id=claim.run_id,
                                            fence=claim.fence, lease_s=lease_s, now=deps.clock())
            except StorageError:
                continue  # transient; the next renewal, or the expiry, decides
            finally:
                self._renewing = False
            if not ok and not self._stopped:
                # Lost to someone else: the body's model calls are wasted work now.
                self.lost.set()
                if self._body is not None:
                    self._body.cancel()
                return

    async def stop(self) -> None:
        """No renewal after this returns. One in flight is let finish (cancelling it would
        break its transaction's connection); its answer no longer cancels the body, and the
        commit that follows checks the fence itself."""
        if self._stopped:
            return
        self._stopped = True
        if not self._renewing:
            self._task.cancel()
        # wait(), not await: the renewer's own end is no error here, and a cancellation of
        # the body while it waits must still reach the body.
        await asyncio.wait([self._task])


@contextlib.asynccontextmanager
async def _kept_lease(deps: Deps, claim: Claim, lease_s: float) -> AsyncIterator[_KeptLease]:
    """Renew the lease every third of its length while the body runs; if a renewal finds the
    fence moved, cancel the body and set ``lost``."""
    lease = _KeptLease(deps, claim, lease_s)
    try:
        yield lease
    finally:
        await lease.stop()


def _fail(out: Outcome, failure_class: str, error: str) -> None:
    out.outcome = "failed"
    out.failure_class = failure_class
    out.error = error


async def _finish(deps: Deps, claim: Claim, out: Outcome) -> None:
    """Write the end of a failed run and release its lease, within its own grace (the run's
    deadline may be what ended it). If the lease is gone, the run row says what became of the
    run: a commit that landed although its answer did not arrive (a deadline cancelled the
    wait) makes the outcome committed after all."""
    worker = deps.config.worker
    grace_s = min(FINISH_GRACE_S, (worker.task_time_limit_s - worker.deadline_s) / 2)
    with deadline(asyncio.get_running_loop().time() + grace_s):
        if await deps.store.finish(claim.session.id, run_id=claim.run_id, fence=claim.fence,
                                   end=out.run_end(), now=deps.clock()):
            return
        run = await deps.store.get_run(claim.run_id)
    if run is not None and run.status == "committed":
        out.outcome, out.failure_class, out.error, out.ended = "committed", None, None, True
        out.tokens_after = run.tokens_after


async def _finish_quietly(deps: Deps, claim: Claim, out: Outcome) -> None:
    """End the run's journal; if even that fails, the lease expires and the reaper ends it."""
    try:
        await _finish(deps, claim, out)
    except StorageError as exc:
        logger.warning("could not record the end of a failed run; the reaper will",
                       extra={"action": "compaction.finish_failed", "error": str(exc)})


def _counted(out: Outcome) -> Outcome:
    metrics().compactions.labels(out.outcome, out.failure_class or "", out.trigger).inc()
    if out.tokens_before is not None:
        metrics().tokens_before.observe(out.tokens_before)
    if out.outcome == "committed" and out.tokens_after is not None:
        metrics().tokens_after.observe(out.tokens_after)
    return out


def _providers(deps: Deps, rate_per_s: float | None, bulk_job_id: str | None,
               out: Outcome) -> Any:
    """The process's provider pool, behind the global and bulk-job rate meters."""
    from worker.llm.providers import ProviderPool

    if deps.models is None:
        w = deps.config.worker
        deps.models = ProviderPool.from_config(w)
    meters: list[tuple[str, float]] = []
    if deps.config.worker.provider_rate_per_s:
        meters.append((RATE_PROVIDER, deps.config.worker.provider_rate_per_s))
    if rate_per_s:
        meters.append((bulk_meter(bulk_job_id or "adhoc"), rate_per_s))
    if not meters:
        return deps.models
    return MeteredProviders(deps.models, deps.limiter, meters, out)


class MeteredProviders:
    """A provider source whose every HTTP call first takes a slot on the shared meters; the
    time spent waiting for slots is added to the run's outcome (its stages show it)."""

    def __init__(self, pool: Any, limiter: Any, meters: list[tuple[str, float]],
                 out: Outcome | None = None) -> None:
        self.pool = pool
        self.limiter = limiter
        self.meters = meters
        self.out = out

    def get(self, candidate: Any) -> Any:
        return _MeteredProvider(self.pool.get(candidate), self.limiter, self.meters, self.out)

    def mark_broken(self, candidate: Any, reason: str) -> None:
        self.pool.mark_broken(candidate, reason)


class _MeteredProvider:
    def __init__(self, provider: Any, limiter: Any, meters: list[tuple[str, float]],
                 out: Outcome | None = None) -> None:
        self.provider = provider
        self.limiter = limiter
        self.meters = meters
        self.out = out

    async def complete(self, *args: Any, **kwargs: Any) -> Any:
        for name, rate in self.meters:
            waited = await self.limiter.acquire(name, rate)
            if self.out is not None:
                self.out.rate_wait_s += waited
        return await self.provider.complete(*args, **kwargs)

    async def aclose(self) -> None:
        await self.provider.aclose()
