"""The lead on the user's path (issue 27, item 1): a runtime appends a growing session through
the client, a real worker (Celery, PostgreSQL, Redis) summarizes through the fake provider over
HTTP, and the checkpoint lands before the session reaches its trigger; with ``lead: 0`` it
fires at the trigger and lands after it, as before the lead existed.

The lead is measured from the worker's own runs (auto, the default): a first session's run is
the measure. Its summary call is made slower than the growing session's (the fake's latency),
so the lead measured covers the growing session's run with room on a loaded machine: the test
shows the mechanism (fire early by growth x measured lead, land before the trigger), not how
close the percentile comes. Until a run is measured, ``auto`` fires by the first lead
(``summarization.first_lead_s``): a fresh worker's first checkpoint lands before the trigger
too, and with a first lead of 0 it lands after it, as before the first lead existed.

A session whose steps are large next to its trigger fires one step before it by its largest
recent step (``summarization.lead_steps``), with no growth lead at all. The growth tests here
turn it off: their steps are small, and it would fire them a step early.

A run fired early whose kept tail holds a long observation (the few steps that let it leave the
keep shrink the tail by over half of what the run would free) asks for no summary: the session
waits for those steps, and the run then fired summarizes it.
"""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from compactd.scheduler.client import CompactdClient
from compactd.storage.leads import ALL_POOLS, checkpoint_commit_s
from compactd.worker.settings import load_config
from tests.support.db import Db
from tests.support.stack import Stack, wait_until

pytestmark = pytest.mark.slow

MakeStack = Callable[..., Stack]

TRIGGER = 4_000
POLICY = {"trigger": {"type": "tokens", "value": TRIGGER},
          "keep": {"type": "messages", "value": 4}, "model_name": "fake-gpt",
          "trim_tokens_to_summarize": 16_000, "lead_steps": False}
STEP_WORDS = 12  # about 60 tokens a step
STEP_S = 0.2
MAX_STEPS = 400


@dataclass
class Trace:
    signalled_at_tokens: int | None = None  # the context when the append that fired was made
    landed_at_tokens: int | None = None  # the context the agent held when the checkpoint landed


def turn(i: int, words: int = STEP_WORDS) -> dict[str, str]:
    role = "user" if i % 2 == 0 else "assistant"
    return {"role": role, "content": f"step {i}: " + " ".join(f"word{i}x{j}"
                                                             for j in range(words))}


async def grow(stack: Stack, session_id: str) -> Trace:
    """Append a step every ``STEP_S`` until a compaction's checkpoint is picked up."""
    trace = Trace()
    held = 0
    async with CompactdClient(load_config(env=stack.env)) as client:
        handle = await client.create_session(session_id, run_model="fake-gpt",
                                             context_window=128_000)
        for i in range(MAX_STEPS):
            if await handle.poll() is not None:
                trace.landed_at_tokens = held
                return trace
            step = await handle.append([turn(i)])
            if step.signalled:
                trace.signalled_at_tokens = step.tokens
            # A checkpoint committed between the poll and this append shrinks what it returns:
            # what the agent held before it is the largest seen.
            held = max(held, step.tokens)
            await asyncio.sleep(STEP_S)
    raise AssertionError(f"{session_id}: no checkpoint landed in {MAX_STEPS} steps ({trace})")


def assert_landed_early(db: Db, session_id: str, trace: Trace) -> None:
    """The session fired before its trigger, by its pressure run, and the agent picked the
    checkpoint up before its context reached the trigger."""
    assert trace.signalled_at_tokens is not None and trace.signalled_at_tokens < TRIGGER, trace
    assert trace.landed_at_tokens is not None and trace.landed_at_tokens < TRIGGER, trace
    [run] = db.runs(session_id)
    assert run.status == "committed" and run.trigger == "pressure"
    assert run.tokens_before is not None and run.tokens_before < TRIGGER


def test_a_growing_session_fires_early_by_the_measured_lead_and_lands_before_its_trigger(
        make_stack: MakeStack, clean_pg: str, fake) -> None:  # type: ignore[no-untyped-def]
    stack = make_stack(summarization={**POLICY, "first_lead_s": 0})
    stack.start_worker("w1", concurrency=2)
    fake.latency_s = 4.0
    first = asyncio.run(grow(stack, "first"))
    # Nothing measured yet, and no first lead: it fires at its trigger and lands after it, as
    # before the lead.
    assert first.signalled_at_tokens is not None and first.signalled_at_tokens >= TRIGGER
    assert first.landed_at_tokens is not None and first.landed_at_tokens > TRIGGER
    with Db(clean_pg) as db:
        [run] = db.runs("first")
        assert run.signalled_at is not None and run.finished_at is not None
        measured = db.run(lambda s: s.read_leads([ALL_POOLS]))[ALL_POOLS]
        assert measured.source == "auto" and measured.runs == 1
        # From the signal to the checkpoint's commit (the run's only one, its end with it).
        first = checkpoint_commit_s(run.stages)
        assert first is not None
        assert measured.lead_s == pytest.approx(
            (run.started_at - run.signalled_at).total_seconds() + first)
        # started_at is the database's clock at the claim and the commit's time the worker's
        # from just before it: the two agree to a few milliseconds, not exactly.
        assert run.started_at + dt.timedelta(seconds=first) <= (
            run.finished_at + dt.timedelta(milliseconds=50))
        assert measured.lead_s >= 4.0

        fake.latency_s = 0.1
        assert_landed_early(db, "grown", asyncio.run(grow(stack, "grown")))

    status = stack.cli_json("status", "grown", "--json")
    assert status["lead"]["source"] == "auto", status["lead"]
    assert status["lead"]["why"].startswith("auto from "), status["lead"]
    assert status["lead"]["seconds"] >= 4.0
    text = stack.cli("status", "grown").stdout
    assert "lead: " in text and "auto from " in text


def test_with_lead_0_a_session_fires_at_its_trigger_as_before(
        make_stack: MakeStack, clean_pg: str, fake) -> None:  # type: ignore[no-untyped-def]
    stack = make_stack(summarization={**POLICY, "lead": 0})
    stack.start_worker("w1", concurrency=2)
    fake.latency_s = 4.0
    asyncio.run(grow(stack, "first"))
    fake.latency_s = 0.1
    grown = asyncio.run(grow(stack, "grown"))
    # The same runs as above measured, and still: at the trigger, landing after it.
    assert grown.signalled_at_tokens is not None and grown.signalled_at_tokens >= TRIGGER
    assert grown.landed_at_tokens is not None and grown.landed_at_tokens >= TRIGGER
    status = stack.cli_json("status", "grown", "--json")
    assert status["lead"] == {"seconds": 0.0, "source": "off", "runs": None, "p90_s": None,
                              "why": "off (summarization.lead: 0): fires at its trigger",
                              "tokens": 0, "growth_tokens": 0, "step_tokens": 0, "by": None}


def test_a_fresh_workers_first_checkpoint_lands_before_the_trigger_by_the_first_lead(
        make_stack: MakeStack, clean_pg: str, fake) -> None:  # type: ignore[no-untyped-def]
    # A first lead of about one summary call, no run measured, no lead stored (no sweep has
    # run): the session fires before its trigger by its growth over the first lead, and its
    # checkpoint lands before the trigger.
    stack = make_stack(summarization={**POLICY, "first_lead_s": 5})
    stack.start_worker("w1", concurrency=2)
    fake.latency_s = 0.2
    with Db(clean_pg) as db:
        # None stored, or the first lead a sweep stored: nothing measured.
        assert all(row.source == "first"
                   for row in db.run(lambda s: s.read_leads([ALL_POOLS])).values())
        assert_landed_early(db, "first", asyncio.run(grow(stack, "first")))
        # The run's commit measured the lead: auto from now on.
        # (the worker stores it after the commit, which the runtime may see first).
        wait_until(lambda: (lead := db.run(lambda s: s.read_leads([ALL_POOLS])).get(ALL_POOLS))
                   is not None and lead.source == "auto", timeout=30, interval=0.2,
                   what="the measured lead stored after the first commit")


BIG_STEP_WORDS = 120  # about 600 tokens a step: seven reach the trigger


async def step_until_fired(stack: Stack, session_id: str) -> tuple[int, int]:
    """Append large steps until one signals, then wait for its checkpoint as an agent whose
    next model call is slow would: the context the signal came at, and the one the agent held
    when the checkpoint landed."""
    async with CompactdClient(load_config(env=stack.env)) as client:
        handle = await client.create_session(session_id, run_model="fake-gpt",
                                             context_window=128_000)
        for i in range(2 * TRIGGER // 100):
            step = await handle.append([turn(i, BIG_STEP_WORDS)])
            if step.signalled:
                for _ in range(600):
                    if await handle.poll() is not None:
                        return step.tokens, step.tokens
                    await asyncio.sleep(0.1)
                raise AssertionError(f"{session_id}: signalled at {step.tokens}, no checkpoint")
    raise AssertionError(f"{session_id}: never signalled")


async def one_more_step(stack: Stack, session_id: str) -> None:
    async with CompactdClient(load_config(env=stack.env)) as client:
        handle = await client.create_session(session_id, run_model="fake-gpt",
                                             context_window=128_000)
        await handle.append([turn(1_000, BIG_STEP_WORDS)])


@pytest.mark.parametrize("lead_steps", [True, False])
def test_a_session_of_large_steps_fires_one_step_before_its_trigger(
        make_stack: MakeStack, clean_pg: str, fake,  # type: ignore[no-untyped-def]
        lead_steps: bool) -> None:
    # No run measured and no first lead: the growth leads by nothing, the step alone can. A
    # keep of one step: the tail is small next to the trigger, and a run fired a step early
    # frees over half of it (a keep of four large steps holds too much for that).
    stack = make_stack(summarization={**POLICY, "first_lead_s": 0, "lead_steps": lead_steps,
                                      "keep": {"type": "messages", "value": 1}})
    stack.start_worker("w1", concurrency=2)
    fake.latency_s = 0.2
    signalled_at, _ = asyncio.run(step_until_fired(stack, "steps"))
    with Db(clean_pg) as db:
        [run] = db.runs("steps")
    assert run.status == "committed" and run.trigger == "pressure"
    status = stack.cli_json("status", "steps", "--json")
    if not lead_steps:
        assert signalled_at >= TRIGGER
        assert status["lead"]["step_tokens"] == 0, status["lead"]
        return
    # One step short of the trigger: the checkpoint lands before the agent's next step.
    assert TRIGGER - 700 <= signalled_at < TRIGGER
    assert run.tokens_before is not None and run.tokens_before < TRIGGER
    # Right after the checkpoint the step counts no more than the session grew since (none):
    # one step later it leads again.
    assert status["lead"]["by"] is None, status["lead"]
    asyncio.run(one_more_step(stack, "steps"))
    lead = stack.cli_json("status", "steps", "--json")["lead"]
    assert lead["by"] == "step" and lead["growth_tokens"] < lead["step_tokens"], lead
    assert 400 <= lead["step_tokens"] <= 700, lead
    assert "its largest recent step leads" in lead["why"], lead


LONG_WORDS = 360  # about 1,800 tokens: a long observation among steps of about 60


async def observe_then_step(stack: Stack, session_id: str) -> tuple[int, list[int]]:
    """Usual steps to about 1,500 tokens, one long observation (which fires early by the step
    lead), then usual steps, one at a time once the run the observation fired has ended,
    until a checkpoint lands: the observation's seq, and the contexts the later signals came
    at."""
    signals: list[int] = []
    async with CompactdClient(load_config(env=stack.env)) as client:
        handle = await client.create_session(session_id, run_model="fake-gpt",
                                             context_window=128_000)
        i = 0
        while (await handle.append([turn(i)])).tokens < 1_500:
            i += 1
        observed = await handle.append([turn(i + 1, LONG_WORDS)])
        assert observed.signalled and observed.tokens < TRIGGER, observed
        # The run it fired ends with nothing to do, and the session waits for growth (the
        # client publishes its signal on this loop: the wait must not block it).
        for _ in range(150):
            status = await asyncio.to_thread(stack.cli_json, "status", session_id, "--json")
            if status["waiting_for_growth"] is not None:
                break
            await asyncio.sleep(0.2)
        waiting = status["waiting_for_growth"]
        assert waiting is not None and "fired early by its lead" in waiting["why"], status
        for j in range(i + 2, i + 12):
            step = await handle.append([turn(j)])
            if step.signalled:
                signals.append(step.tokens)
                for _ in range(300):
                    if await handle.poll() is not None:
                        return observed.first_seq, signals
                    await asyncio.sleep(0.1)
        raise AssertionError(f"{session_id}: no checkpoint after the observation ({signals})")


def test_a_run_fired_early_waits_for_a_long_observation_to_leave_the_keep(
        make_stack: MakeStack, clean_pg: str, fake) -> None:  # type: ignore[no-untyped-def]
    stack = make_stack(summarization={**POLICY, "first_lead_s": 0, "lead_steps": True})
    stack.start_worker("w1", concurrency=2)
    seq, signals = asyncio.run(observe_then_step(stack, "observed"))
    with Db(clean_pg) as db:
        runs = db.runs("observed")
    # The first run asked for no summary and said why; it named the growth to wait for, so
    # no append fired another before the tail could let go of the observation (a keep of
    # four: four usual steps, or fewer where the run expected arrivals).
    assert runs[0].status == "nothing_to_do" and runs[0].trigger == "pressure"
    assert "fired early by its lead" in (runs[0].error or ""), runs[0].error
    assert 1 <= len(signals) <= 2, signals
    # The run that committed summarized the observation, before the session reached its
    # trigger.
    last = runs[-1]
    assert last.status == "committed" and [r.status for r in runs[1:-1]] in ([],
                                                                             ["nothing_to_do"])
    assert last.range_seqs is not None and seq in last.range_seqs, last.range_seqs
    assert last.tokens_before is not None and last.tokens_before < TRIGGER
