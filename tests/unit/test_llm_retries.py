"""The retry schedule of one candidate, with a scripted in-memory provider and a recorded sleep."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from typing import Any

import pytest

from compactd.worker.llm.candidates import Candidate
from compactd.worker.llm.errors import ProviderError
from compactd.worker.llm.fallback import RetryPolicy, SummaryFailed, SummaryRequest, summarize
from compactd.worker.llm.provider import ChatMessage, Completion, Usage
from compactd.worker.settings import ModelSpec

CANDIDATE = Candidate.from_spec(ModelSpec(name="m", provider="openai"))
REQUEST = SummaryRequest.of([{"role": "user", "content": "summarize this"}])


class Scripted:
    """A provider answering from a list: an exception is raised, a string is returned."""

    def __init__(self, answers: Sequence[ProviderError | str]) -> None:
        self.candidate = CANDIDATE
        self.answers = list(answers)
        self.calls = 0

    async def complete(self, chat: Sequence[ChatMessage], *, max_tokens: int,
                       tools: Sequence[Any] = ()) -> Completion:
        self.calls += 1
        if isinstance(self.answers[0], ProviderError):
            # No local names the error: as in the adapters, only its traceback reaches frames.
            raise self.answers.pop(0)
        return Completion(text=str(self.answers.pop(0)), model="m-1", usage=Usage())

    async def aclose(self) -> None:
        pass


class Source:
    def __init__(self, provider: Scripted) -> None:
        self.provider = provider
        self.broken: list[str] = []

    def get(self, candidate: Candidate) -> Scripted:
        return self.provider

    def mark_broken(self, candidate: Candidate, reason: str) -> None:
        self.broken.append(reason)


class Sleeps(list[float]):
    """Records each wait; sleeps for real only when asked (the stop rules read real clocks)."""

    def __init__(self, real: bool = False) -> None:
        super().__init__()
        self.real = real

    async def __call__(self, seconds: float) -> None:
        self.append(seconds)
        if self.real:
            await asyncio.sleep(seconds)


def server() -> ProviderError:
    return ProviderError("server", "HTTP 503", status=503)


async def go(provider: Scripted, retry: RetryPolicy, sleeps: Sleeps, *,
             deadline_s: float = 60, rng: random.Random | None = None) -> Source:
    source = Source(provider)
    await summarize(REQUEST, candidates=[CANDIDATE], validate=lambda text: None,
                    deadline_s=deadline_s, providers=source, retry=retry, sleep=sleeps, rng=rng)
    return source


async def test_exponential_backoff_without_jitter() -> None:
    sleeps = Sleeps()
    provider = Scripted([server(), server(), server(), "ok"])
    await go(provider, RetryPolicy(max_attempts=4, backoff_initial_s=0.5, jitter=False), sleeps)
    assert sleeps == [0.5, 1.0, 2.0] and provider.calls == 4


async def test_jitter_is_deterministic_with_a_seeded_rng() -> None:
    runs = []
    for _ in range(2):
        sleeps = Sleeps()
        await go(Scripted([server(), server(), "ok"]), RetryPolicy(backoff_initial_s=1),
                 sleeps, rng=random.Random(11))
        runs.append(list(sleeps))
    assert runs[0] == runs[1]
    assert 0.5 <= runs[0][0] <= 1.0 and 1.0 <= runs[0][1] <= 2.0


async def test_retry_after_is_honoured_up_to_the_cap() -> None:
    sleeps = Sleeps()
    limited = [ProviderError("rate_limited", "HTTP 429", status=429, retry_after_s=s)
               for s in (0.2, 45.0)]
    await go(Scripted([*limited, "ok"]),
             RetryPolicy(retry_after_cap_s=5, backoff_initial_s=3, jitter=False), sleeps)
    assert sleeps == [0.2, 5]


async def test_attempts_are_bounded() -> None:
    sleeps = Sleeps()
    provider = Scripted([server()] * 10)
    with pytest.raises(SummaryFailed) as failed:
        await go(provider, RetryPolicy(max_attempts=3, backoff_initial_s=0.01), sleeps)
    assert provider.calls == 3
    assert [(a.kind, a.http_attempts) for a in failed.value.attempts] == [("server", 3)]


async def test_no_sleep_that_would_end_past_the_deadline() -> None:
    sleeps = Sleeps(real=True)
    provider = Scripted([server()] * 10)
    with pytest.raises(SummaryFailed) as failed:
        await go(provider, RetryPolicy(backoff_initial_s=0.2, jitter=False), sleeps,
                 deadline_s=0.5)
    # 0.2 s fits before the deadline, the next 0.4 s would not. The real error is reported,
    # not a deadline that a pointless wait would have reached.
    assert sleeps == [0.2] and provider.calls == 2
    assert failed.value.attempts[0].kind == "server"


async def test_no_sleep_past_the_candidate_budget() -> None:
    sleeps = Sleeps(real=True)
    provider = Scripted([server()] * 10)
    with pytest.raises(SummaryFailed):
        await go(provider, RetryPolicy(candidate_budget_s=0.5, backoff_initial_s=0.2,
                                       jitter=False), sleeps)
    assert sleeps == [0.2] and provider.calls == 2


@pytest.mark.parametrize("kind", ["auth", "not_found", "bad_request", "quota", "non_text",
                                  "malformed", "refused"])
async def test_permanent_failures_are_not_retried(kind: str) -> None:
    sleeps = Sleeps()
    provider = Scripted([ProviderError(kind, "no"), "never"])  # type: ignore[arg-type]
    with pytest.raises(SummaryFailed):
        await go(provider, RetryPolicy(), sleeps)
    assert provider.calls == 1 and sleeps == []


async def test_broken_kinds_mark_the_candidate() -> None:
    source = Source(Scripted([ProviderError("auth", "HTTP 401", status=401)]))
    with pytest.raises(SummaryFailed):
        await summarize(REQUEST, candidates=[CANDIDATE], validate=lambda text: None,
                        deadline_s=5, providers=source, retry=RetryPolicy(), sleep=Sleeps())
    assert source.broken == ["HTTP 401"]


@pytest.mark.parametrize("succeeds", [True, False])
async def test_a_finished_call_leaves_its_request_to_reference_counting(succeeds: bool) -> None:
    """Nothing of a request may wait for the garbage collector after its call, whether the
    candidate answered or failed every attempt: a run's plan and surface hang off it, and they
    are a worker's largest transient objects."""
    import gc
    import weakref

    def check(text: str) -> str | None:
        return None

    request = SummaryRequest.of([{"role": "user", "content": "summarize this"}], validate=check)
    alive = weakref.ref(check)
    del check
    async def call(request: SummaryRequest) -> None:
        answers = Scripted([server(), "ok" if succeeds else server()])  # the errors die with it
        try:
            await summarize(request, candidates=[CANDIDATE], validate=lambda text: None,
                            deadline_s=60, providers=Source(answers),
                            retry=RetryPolicy(max_attempts=2, jitter=False), sleep=Sleeps())
        except SummaryFailed:
            assert not succeeds

    gc.disable()
    try:
        await call(request)
        del request
        assert alive() is None
    finally:
        gc.enable()
