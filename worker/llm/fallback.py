"""Ask the candidates for a summary, in order, until one writes text the policy accepts.

Per candidate (after DeerFlow's ``_asummarize_with``, with these retry rules):

* building its client, calling it, extracting text, the non-empty check and the policy's
  ``validate`` can each fail; any failure moves on to the next candidate, recorded with its kind;
* only transient failures are retried on the same candidate, by tenacity: 429 (waiting what
  Retry-After says, capped), 5xx and 529, timeouts, connection errors; with exponential backoff
  and jitter, at most ``max_attempts`` HTTP attempts, within the candidate's time budget;
* 401/403/404/other 400s move on at once; auth, not-found and quota failures also mark the
  candidate unavailable for a while (the key or model will not fix itself in seconds);
* a context-length error asks ``on_context_length`` (once per call) for a smaller request; the
  same candidate is tried again with it, and later candidates get it too; else move on;
* a refused summary (empty, whitespace-only, non-text, not shrinking...) is not retried: the same
  model asked the same thing tends to answer the same way; nor is one cut off at the output cap
  (kind ``truncated``), which the same cap would cut again.

A candidate whose circuit is open (:mod:`worker.llm.breaker`: its recent calls, in any run of
any worker, kept failing) is skipped at once, recorded as its ``circuit_open`` failure; each
remote call's outcome is reported to its circuit.

One overall deadline (``asyncio.timeout_at``) bounds every remote call: a candidate that hangs is
cancelled when it passes, and the remaining remote candidates are not tried. The ``local``
candidate still runs after the deadline: it makes no call, takes milliseconds, and is the point of
having a last resort. All failed: :class:`SummaryFailed` with every attempt.

Nothing logged at INFO or above carries a key, a prompt or a provider's response body: reasons
are built from status codes and error codes, and SDK exceptions are never logged.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
import random
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception,
    stop_after_attempt,
    stop_before_delay,
)
from tenacity.stop import stop_base

from compactd.storage.kinds import ModelFailure
from compactd.storage.messages import Message
from compactd.worker.compaction.policy import DEFAULT_MAX_SUMMARY_TOKENS
from compactd.worker.compaction.sharing import CacheHints
from compactd.worker.llm.breaker import Breaker
from compactd.worker.llm.candidates import Candidate
from compactd.worker.llm.errors import (
    BROKEN_KINDS,
    CIRCUIT_KINDS,
    LLMError,
    LocalSummaryError,
    ProviderError,
    Unavailable,
)
from compactd.worker.llm.local import summarize_local
from compactd.worker.llm.provider import ChatMessage, Completion, Provider, Tool
from compactd.worker.llm.usage import Usage
from compactd.worker.settings import WorkerConfig

logger = logging.getLogger(__name__)

Validator = Callable[[str], "str | None"]
ContextShrinker = Callable[["SummaryRequest", Candidate],
                           "Awaitable[SummaryRequest | None] | SummaryRequest | None"]
LocalSummarizer = Callable[..., str]


@dataclass(frozen=True, slots=True)
class SummaryRequest:
    """What to summarize, in both shapes: ``chat`` for a model (usually a system instruction
    and one user message built by the policy), ``messages`` and ``existing_summary`` for the
    local summarizer, which reads structure rather than a prompt.

    ``validate`` (optional) replaces the call's validator for this request: a planner that
    shrinks the range on a context-length error hands back the validator for the new range.
    ``local`` (optional) is the model-free summarizer that answers it as the ``local``
    candidate: an index call is answered with a short entry, not the eight sections.
    """

    chat: tuple[ChatMessage, ...]
    messages: tuple[Message, ...] = ()
    tools: tuple[Tool, ...] = ()  # the runtime's tool schemas, sent in replay mode
    existing_summary: str | None = None
    max_tokens: int = DEFAULT_MAX_SUMMARY_TOKENS
    validate: Validator | None = None
    local: LocalSummarizer | None = None
    # The runtime's cache hints, for a call that begins with its last request (sharing).
    cache: CacheHints | None = None

    @classmethod
    def of(cls, chat: Sequence[ChatMessage], messages: Sequence[Message] = (),
           existing_summary: str | None = None, max_tokens: int = DEFAULT_MAX_SUMMARY_TOKENS,
           validate: Validator | None = None, tools: Sequence[Tool] = (),
           local: LocalSummarizer | None = None, cache: CacheHints | None = None
           ) -> SummaryRequest:
        return cls(chat=tuple(dict(m) for m in chat), messages=tuple(messages),
                   existing_summary=existing_summary, max_tokens=max_tokens, validate=validate,
                   tools=tuple(dict(t) for t in tools), local=local, cache=cache)


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Per-candidate retry limits. ``jitter=False`` (or a seeded ``rng`` passed to
    :func:`summarize`) makes the waits deterministic for tests."""

    max_attempts: int = 4
    candidate_budget_s: float = 90.0
    retry_after_cap_s: float = 20.0
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 8.0
    jitter: bool = True

    @classmethod
    def from_config(cls, worker: WorkerConfig, **overrides: Any) -> RetryPolicy:
        values: dict[str, Any] = {"max_attempts": worker.max_attempts,
                                  "candidate_budget_s": worker.candidate_budget_s,
                                  "retry_after_cap_s": worker.retry_after_cap_s}
        return cls(**{**values, **overrides})


def compute_backoff(attempt: int, *, initial_s: float, max_s: float, jitter: bool = True,
                    rng: random.Random | None = None) -> float:
    """Seconds to wait after HTTP attempt ``attempt`` (1-based) failed.

    Doubles from ``initial_s`` up to ``max_s``; with ``jitter``, "equal jitter": a uniform draw in
    [half, full] of that step, so a fleet of workers does not retry in lockstep. A jittered wait
    can be half its step, so it is shorter than the unjittered one; below the cap it is never
    shorter than the previous attempt's full step, so the waits still grow.
    """
    base = min(max_s, initial_s * (2 ** max(0, attempt - 1)))
    if not jitter:
        return base
    return base / 2 + (rng or random).uniform(0, base / 2)


@dataclass(frozen=True, slots=True)
class Attempt:
    """One candidate's part in a call. ``kind`` None means it wrote the summary."""

    candidate: str
    provider: str
    model: str
    kind: ModelFailure | None
    reason: str
    latency_s: float
    http_attempts: int = 0
    status: int | None = None
    request_id: str | None = None
    usage: Usage | None = None  # what the provider billed, when it answered (refused or not)

    @property
    def ok(self) -> bool:
        return self.kind is None

    def to_json(self) -> dict[str, Any]:
        return {"candidate": self.candidate, "provider": self.provider, "model": self.model,
                "kind": self.kind, "reason": self.reason,
                "latency_s": round(self.latency_s, 4), "http_attempts": self.http_attempts,
                "status": self.status, "request_id": self.request_id}


class SummaryFailed(LLMError):
    """Every summary candidate failed or was refused."""

    def __init__(self, attempts: Sequence[Attempt], message: str | None = None) -> None:
        self.attempts = tuple(attempts)
        if message is None:
            tried = ", ".join(f"{a.candidate}={a.kind}" for a in self.attempts) or "none"
            message = f"every summary candidate failed ({tried})"
        super().__init__(message)


@dataclass(frozen=True, slots=True)
class SummaryOutcome:
    """The accepted summary and how it was obtained."""

    text: str
    candidate: Candidate
    model: str  # what the provider says answered (``local`` for the local summarizer)
    usage: Usage
    request_id: str | None
    attempts: tuple[Attempt, ...]
    request: SummaryRequest  # the request actually summarized (smaller after a shrink)
    latency_s: float
    failures: tuple[Attempt, ...] = field(default=())


class ProviderSource(Protocol):
    """Where providers come from (a :class:`~worker.llm.pool.ProviderPool`)."""

    def get(self, candidate: Candidate) -> Provider: ...

    def mark_broken(self, candidate: Candidate, reason: str) -> None: ...


async def summarize(request: SummaryRequest, *, candidates: Sequence[Candidate],
                    validate: Validator, deadline_s: float,
                    providers: ProviderSource | None = None,
                    retry: RetryPolicy | None = None,
                    on_context_length: ContextShrinker | None = None,
                    rng: random.Random | None = None,
                    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
                    local: LocalSummarizer = summarize_local,
                    breaker: Breaker | None = None) -> SummaryOutcome:
    """The first accepted summary from ``candidates``; raises ``SummaryFailed`` if none."""
    run = _Run(request=request, validate=validate, providers=providers,
               retry=retry or RetryPolicy(), on_context_length=on_context_length, rng=rng,
               sleep=sleep, local=local, breaker=breaker)
    loop = asyncio.get_running_loop()
    started = loop.time()
    deadline_at = started + deadline_s
    for candidate in candidates:
        if candidate.is_local:
            outcome = await run.local_candidate(candidate)
        elif loop.time() >= deadline_at:
            run.fail(candidate, ModelFailure.DEADLINE,
                     f"the overall deadline ({deadline_s:g} s) passed before this candidate",
                     loop.time())
            continue
        else:
            outcome = await run.remote_candidate(candidate, deadline_at, deadline_s)
        if outcome is not None:
            return _finish(outcome, run.attempts, loop.time() - started)
    logger.warning("every summary candidate failed",
                   extra={"action": "llm.failed",
                          "attempts": [f"{a.candidate}:{a.kind}" for a in run.attempts]})
    raise SummaryFailed(run.attempts)


@dataclass
class _Run:
    request: SummaryRequest
    validate: Validator
    providers: ProviderSource | None
    retry: RetryPolicy
    on_context_length: ContextShrinker | None
    rng: random.Random | None
    sleep: Callable[[float], Awaitable[None]]
    local: LocalSummarizer
    breaker: Breaker | None = None
    attempts: list[Attempt] = field(default_factory=list)
    asked_to_shrink: bool = False

    # ----------------------------------------------------------------------------- local

    async def local_candidate(self, candidate: Candidate) -> SummaryOutcome | None:
        loop = asyncio.get_running_loop()
        started = loop.time()
        request = self.request
        try:
            # A thread, so a large range does not stall the loop (lease renewal runs on it).
            text = await asyncio.to_thread(
                request.local or self.local, list(request.messages),
                existing_summary=request.existing_summary, max_tokens=request.max_tokens)
        except LocalSummaryError as exc:
            self.fail(candidate, ModelFailure.REFUSED, str(exc), started)
            return None
        except Exception as exc:  # a bug here must still leave a recorded, failed attempt
            logger.debug("local summarizer raised", exc_info=True,
                         extra={"action": "llm.internal", "candidate": candidate.name})
            self.fail(candidate, ModelFailure.INTERNAL, f"unexpected {type(exc).__name__}", started)
            return None
        completion = Completion(text=text, model=candidate.model_id, usage=Usage())
        return self.accept(candidate, completion, started, http_attempts=0)

    # ---------------------------------------------------------------------------- remote

    async def remote_candidate(self, candidate: Candidate, deadline_at: float,
                               deadline_s: float) -> SummaryOutcome | None:
        loop = asyncio.get_running_loop()
        started = loop.time()
        if self.providers is None:
            self.fail(candidate, ModelFailure.UNAVAILABLE, "no provider pool was given", started)
            return None
        try:
            provider = self.providers.get(candidate)
        except Unavailable as exc:
            self.fail(candidate, ModelFailure.UNAVAILABLE, str(exc), started)
            return None
        if self.breaker is not None:
            skipped = await self.breaker.admit(candidate)
            if skipped is not None:
                self.fail(candidate, ModelFailure.CIRCUIT_OPEN, skipped, started)
                return None
        counter = _Counter()
        try:
            async with asyncio.timeout_at(deadline_at):
                completion = await self._call_with_budget(provider, candidate, counter,
                                                          deadline_at)
        except TimeoutError:
            self.fail(candidate, ModelFailure.DEADLINE,
                      f"the overall deadline ({deadline_s:g} s) ended the call", started,
                      http_attempts=counter.n)
            await self._report(candidate, ModelFailure.DEADLINE)
            return None
        except ProviderError as exc:
            self.fail(candidate, exc.kind, exc.reason, started, http_attempts=counter.n,
                      status=exc.status, request_id=exc.request_id, usage=exc.usage)
            if exc.kind in BROKEN_KINDS:
                self.providers.mark_broken(candidate, exc.reason)
            await self._report(candidate, exc.kind)
            return None
        except Exception as exc:  # a bug in an adapter must not cost the local fallback
            logger.debug("provider adapter raised", exc_info=True,
                         extra={"action": "llm.internal", "candidate": candidate.name})
            self.fail(candidate, ModelFailure.INTERNAL, f"unexpected {type(exc).__name__}", started,
                      http_attempts=counter.n)
            return None
        await self._report(candidate, None)
        return self.accept(candidate, completion, started, http_attempts=counter.n)

    async def _report(self, candidate: Candidate, kind: ModelFailure | None) -> None:
        """Tell the candidate's circuit how its call went: any answer shows the endpoint is up.
        Shielded: a run cancelled as it ends must not leave a probe's result unsaid."""
        if self.breaker is not None:
            await asyncio.shield(self.breaker.record(candidate, failed=kind in CIRCUIT_KINDS))

    async def _call_with_budget(self, provider: Provider, candidate: Candidate,
                                counter: _Counter, deadline_at: float) -> Completion:
        budget_s = self.retry.candidate_budget_s
        try:
            async with asyncio.timeout(budget_s):
                while True:
                    try:
                        return await self._call_with_retries(provider, candidate, counter,
                                                             deadline_at)
                    except ProviderError as exc:
                        if (exc.kind != ModelFailure.CONTEXT_LENGTH
                                or not await self._shrink(candidate)):
                            raise
        except TimeoutError:
            # Only this block's own timeout lands here: the overall deadline's surfaces as a
            # cancellation inside it and becomes TimeoutError at the caller's block.
            raise ProviderError(ModelFailure.TIMEOUT,
                                f"the candidate's time budget ({budget_s:g} s) ran out"
                                ) from None

    async def _call_with_retries(self, provider: Provider, candidate: Candidate,
                                 counter: _Counter, deadline_at: float) -> Completion:
        loop = asyncio.get_running_loop()
        policy, rng, max_tokens = self.retry, self.rng, self.request.max_tokens
        tools = self.request.tools
        # Only a shared call carries hints; a provider that takes none is never passed any.
        hints: dict[str, Any] = {"cache": self.request.cache} if self.request.cache else {}
        # tenacity's retrying object stays in a reference cycle after the call (its iteration
        # state holds its own bound methods), so all its callbacks reach waits for the garbage
        # collector (a failed call's error too: see the except below). They reach only this
        # call's small objects, and the prompt through `held`, emptied when the call ends: the
        # run's surface and plan are freed by reference counting as soon as the run ends, not
        # at the next full collection.
        held = [self.request.chat]

        def wait(state: RetryCallState) -> float:
            exc = state.outcome.exception() if state.outcome else None
            if isinstance(exc, ProviderError) and exc.retry_after_s is not None:
                return min(exc.retry_after_s, policy.retry_after_cap_s)
            return compute_backoff(state.attempt_number, initial_s=policy.backoff_initial_s,
                                   max_s=policy.backoff_max_s, jitter=policy.jitter,
                                   rng=rng)

        async def before_sleep(state: RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome else None
            logger.info("retrying summary candidate %s in %.2f s", candidate.name,
                        state.upcoming_sleep,
                        extra={"action": "llm.retry", "candidate": candidate.name,
                               "kind": getattr(exc, "kind", None),
                               "http_attempts": counter.n,
                               "wait_s": round(state.upcoming_sleep, 3)})

        async def call() -> Completion:
            counter.n += 1
            return await provider.complete(held[0], max_tokens=max_tokens, tools=tools, **hints)

        retrying = AsyncRetrying(
            stop=(stop_after_attempt(policy.max_attempts)
                  | stop_before_delay(policy.candidate_budget_s)
                  | _stop_before_deadline(loop, deadline_at)),
            wait=wait,
            retry=retry_if_exception(lambda e: isinstance(e, ProviderError) and e.transient),
            before_sleep=before_sleep, sleep=self.sleep, reraise=True)
        try:
            result: Completion = await retrying(call)
        except ProviderError as exc:
            # The last attempt's error stays in tenacity's state, which its traceback reaches
            # (a cycle); the traceback and the SDK error under it reach this run and the
            # prompt. Raised bare, it reaches only the frames it passes from here on.
            exc.__context__ = None
            raise exc.with_traceback(None) from None
        finally:
            held.clear()
        return result

    async def _shrink(self, candidate: Candidate) -> bool:
        """Ask the planner once for a smaller request; True if it gave one."""
        if self.asked_to_shrink or self.on_context_length is None:
            return False
        self.asked_to_shrink = True
        smaller = self.on_context_length(self.request, candidate)
        if inspect.isawaitable(smaller):
            smaller = await smaller
        if smaller is None:
            return False
        logger.info("context length exceeded on %s: retrying with a smaller request",
                    candidate.name, extra={"action": "llm.shrink", "candidate": candidate.name})
        self.request = smaller
        return True

    # ----------------------------------------------------------------------- bookkeeping

    def accept(self, candidate: Candidate, completion: Completion, started: float, *,
               http_attempts: int) -> SummaryOutcome | None:
        if completion.truncated:
            # A reply cut at the output cap ends mid-section: committed, it would lose whatever
            # the model had not written yet, with nothing to show for it. The same cap gives
            # the same cut, so the next candidate is asked instead.
            self.fail(candidate, ModelFailure.TRUNCATED, f"the output stopped at its cap of "
                      f"{self.request.max_tokens} tokens ({completion.stop_reason})", started,
                      http_attempts=http_attempts, request_id=completion.request_id,
                      usage=completion.usage)
            return None
        text = completion.text.strip()
        if not text:
            self.fail(candidate, ModelFailure.EMPTY, "the output is empty or whitespace only",
                      started, http_attempts=http_attempts, request_id=completion.request_id,
                      usage=completion.usage)
            return None
        reason = (self.request.validate or self.validate)(text)
        if reason is not None:
            self.fail(candidate, ModelFailure.REFUSED, reason, started, http_attempts=http_attempts,
                      request_id=completion.request_id, usage=completion.usage)
            return None
        loop = asyncio.get_running_loop()
        attempt = Attempt(candidate=candidate.name, provider=candidate.provider,
                          model=completion.model or candidate.model_id, kind=None,
                          reason="accepted", latency_s=loop.time() - started,
                          http_attempts=http_attempts, request_id=completion.request_id,
                          usage=completion.usage)
        self.attempts.append(attempt)
        logger.info("summary written by %s", candidate.name,
                    extra={"action": "llm.summary", "candidate": candidate.name,
                           "model": attempt.model, "http_attempts": http_attempts,
                           "latency_s": round(attempt.latency_s, 3),
                           "request_id": completion.request_id,
                           **{f"usage_{k}": v for k, v in completion.usage.to_json().items()}})
        return SummaryOutcome(text=text, candidate=candidate, model=attempt.model,
                              usage=completion.usage, request_id=completion.request_id,
                              attempts=(), request=self.request, latency_s=0.0)

    def fail(self, candidate: Candidate, kind: ModelFailure, reason: str, started: float, *,
             http_attempts: int = 0, status: int | None = None,
             request_id: str | None = None, usage: Usage | None = None) -> None:
        loop = asyncio.get_running_loop()
        attempt = Attempt(candidate=candidate.name, provider=candidate.provider,
                          model=candidate.model_id, kind=kind, reason=reason,
                          latency_s=max(0.0, loop.time() - started),
                          http_attempts=http_attempts, status=status, request_id=request_id,
                          usage=usage)
        self.attempts.append(attempt)
        # A candidate remembered as unavailable was already warned about once.
        level = logging.DEBUG if kind == ModelFailure.UNAVAILABLE else logging.INFO
        logger.log(level, "summary candidate %s failed: %s", candidate.name, kind,
                   extra={"action": "llm.attempt", **_log_fields(attempt)})


class _stop_before_deadline(stop_base):
    """Stop when the next wait would end past the overall deadline: sleeping into it only to be
    cancelled wastes the time a later candidate could use, and hides the real error."""

    def __init__(self, loop: asyncio.AbstractEventLoop, deadline_at: float) -> None:
        self.loop = loop
        self.deadline_at = deadline_at

    def __call__(self, retry_state: RetryCallState) -> bool:
        return self.loop.time() + retry_state.upcoming_sleep >= self.deadline_at


@dataclass
class _Counter:
    n: int = 0


def _log_fields(attempt: Attempt) -> Mapping[str, Any]:
    return {"candidate": attempt.candidate, "kind": attempt.kind, "reason": attempt.reason,
            "status": attempt.status, "http_attempts": attempt.http_attempts,
            "latency_s": round(attempt.latency_s, 3), "request_id": attempt.request_id}


def _finish(outcome: SummaryOutcome, attempts: list[Attempt], latency_s: float
            ) -> SummaryOutcome:
    return dataclasses.replace(outcome, attempts=tuple(attempts), latency_s=latency_s,
                               failures=tuple(a for a in attempts if not a.ok))
