"""A chain of summarizer calls, run in order through the candidate fallback: what every summary
step of a run does, whatever it writes (a ``merge`` checkpoint, an index checkpoint, a state).

Call k reads the text call k-1 wrote (its running summary) and merges its own part in; each
call goes through :func:`worker.llm.fallback.summarize` (candidates, retries, the local
summarizer last) within what the run's deadline leaves the models, and each call's attempts and
usage are recorded on the run as they happen (:meth:`worker.run.RunScope.record_call`), so
chains running concurrently (the recallable layout's chunk calls and its state call) add up.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Protocol

from compactd.storage.kinds import FailureClass, ModelFailure
from compactd.storage.records import SessionInfo
from compactd.worker.compaction.policy import Policy
from compactd.worker.compaction.prompt import SummaryCall, build_prompt, request_tools
from compactd.worker.compaction.render import Skill
from compactd.worker.compaction.validation import NOT_SMALLER, validate_summary
from compactd.worker.llm.breaker import Breaker
from compactd.worker.llm.candidates import Candidate, candidate_order
from compactd.worker.llm.fallback import (
    Attempt,
    RetryPolicy,
    SummaryFailed,
    SummaryRequest,
    summarize,
)
from compactd.worker.metrics import metrics
from compactd.worker.run import RunFailed, RunScope

# Who wants to see every request a chain sends (``compactd eval`` measures what the summarizer
# was given); a context variable, so it follows the run into the tasks it starts.
SUMMARY_OBSERVER: ContextVar[Callable[[SummaryRequest], None] | None] = ContextVar(
    "compactd_summary_observer", default=None)


class Chain(Protocol):
    """The calls of one step, and how each is asked."""

    @property
    def calls(self) -> Sequence[SummaryCall]:
        """The calls (a shrink on a context-length error may change them)."""
        ...

    def request(self, index: int, running: str | None) -> SummaryRequest:
        """Call ``index``'s request, merging into ``running`` (the text before it)."""
        ...

    def shrink(self, index: int, request: SummaryRequest) -> SummaryRequest | None:
        """A smaller request after a context-length error on call ``index``, or None."""
        ...


@dataclass(frozen=True, slots=True)
class Written:
    """What a chain wrote, and what it cost."""

    text: str
    model: str
    usage: dict[str, Any] | None  # the providers' billing for this chain's calls


class ChainFailed(RunFailed):
    """Every candidate failed on one call of the chain (its attempts are recorded)."""

    def __init__(self, index: int, total: int) -> None:
        super().__init__(FailureClass.SUMMARY,
                         f"every candidate failed on call {index + 1} of {total}")


class CannotShrink(ChainFailed):
    """Every candidate's summary was refused as not smaller than the range it would replace:
    the range is too small to shrink. The merge run ends with nothing to do, not failed; a
    caller that only knows :class:`ChainFailed` still sees a failed call."""

    def __init__(self, index: int, total: int, reason: str) -> None:
        super().__init__(index, total)
        self.reason = reason


def cannot_shrink(attempts: Sequence[Attempt]) -> bool:
    """Whether every attempt was refused because its checkpoint would not shrink the surface."""
    return bool(attempts) and all(a.kind == ModelFailure.REFUSED and NOT_SMALLER in a.reason
                                  for a in attempts)


@dataclass(frozen=True, slots=True)
class Summarizers:
    """The candidates and the limits of a run's calls, built once per run."""

    candidates: tuple[Candidate, ...]
    retry: RetryPolicy
    providers: Any
    breaker: Breaker | None = None

    @classmethod
    def of(cls, scope: RunScope, run_model: str | None, summary_model: str | None
           ) -> Summarizers:
        config = scope.deps.config
        return cls(tuple(candidate_order(run_model=run_model, summary_model=summary_model,
                                         models=config.models,
                                         default_model=config.default_model,
                                         local_fallback=config.worker.local_fallback)),
                   RetryPolicy.from_config(config.worker), scope.providers(),
                   scope.deps.breaker)


async def run_chain(scope: RunScope, chain: Chain, running: str | None,
                    summarizers: Summarizers) -> Written:
    """Run the chain's calls in order from ``running``; :class:`ChainFailed` when a call has no
    candidate left."""
    index = 0
    usage: dict[str, Any] | None = None
    model = ""
    observe = SUMMARY_OBSERVER.get()
    while index < len(chain.calls):
        request = chain.request(index, running)
        if observe is not None:
            observe(request)
        try:
            outcome = await summarize(
                request, candidates=summarizers.candidates,
                validate=lambda _text: None, deadline_s=scope.models_left_s(),
                providers=summarizers.providers, retry=summarizers.retry,
                breaker=summarizers.breaker,
                on_context_length=functools.partial(_shrink, chain, index))
        except SummaryFailed as exc:
            scope.record_call(exc.attempts)
            if cannot_shrink(exc.attempts):
                raise CannotShrink(index, len(chain.calls), exc.attempts[-1].reason) from exc
            raise ChainFailed(index, len(chain.calls)) from exc
        usage = scope.record_call(outcome.attempts, usage)
        metrics().fallback_depth.observe(max(0, len(outcome.attempts) - 1))
        model = outcome.model
        running = outcome.text
        index += 1
    assert running is not None, "a chain has at least one call"
    return Written(running, model, usage)


def _shrink(chain: Chain, index: int, request: SummaryRequest, _candidate: Candidate
            ) -> SummaryRequest | None:
    return chain.shrink(index, request)


def summary_request(call: SummaryCall, running: str | None, *, policy: Policy,
                    info: SessionInfo, skills: Sequence[Skill], has_history: bool,
                    recall: dict[str, Any], below: int | None,
                    max_tokens: int | None = None) -> SummaryRequest:
    """One call of a summary step (a ``merge`` checkpoint's, a state's): the policy's prompt
    merging into ``running``, its text validated against the policy. ``below``: the final
    call's bound, the framed checkpoint must cost fewer tokens (None for a call whose text is
    only a running summary: it has to fit the cap, the next call reserved exactly that)."""
    def check(text: str) -> str | None:
        return validate_summary(text, replaced_tokens=below, policy=policy,
                                run_model=info.run_model, skills=skills,
                                has_history=has_history, recall=recall)

    return SummaryRequest.of(build_prompt(call, running, policy, info.envelope),
                             messages=call.messages, existing_summary=running,
                             max_tokens=max_tokens or policy.max_summary_tokens,
                             validate=check, tools=request_tools(policy, info.envelope))
