"""A fleet of agents beside real workers: overflows, pressure-to-checkpoint latency, capacity.

    python tests/bench/fleet.py --json fleet.json --plots DIR [--agents 40] [--workers 1]
        [--duration 180] [--latency 1.0] [--concurrency 4] [--window 16000]
        [--transcripts DIR] [--think-scale 1.0] [--search]

What runs: ``--agents`` asyncio tasks in this process, each an agent driven through the real
runtime client (``scheduler.client.CompactdClient``, one per process as a runtime has it),
``--workers`` real ``celery -A worker.app worker`` processes (threads pool, ``--concurrency``
slots each) and one ``celery beat``, PostgreSQL, Redis, and the fake provider in a process of its
own answering every summary call after ``--latency`` seconds, over HTTP through the openai SDK.

Each agent replays a real transcript (every ``*.jsonl`` under ``--transcripts``, by default
``../shared/corpus`` beside the repository; agent k takes file k mod n) cut into steps (an
assistant turn with its tool results, or a run of user messages). Its leading system messages
are the session's envelope. When the transcript runs out it starts again with fresh tool-call
ids. Between steps it thinks a random 1-5 s (times ``--think-scale``): its own model call. Then,
as a runtime does: it reports the provider's input token count of that call (the context it
sent), appends the step, polls, and when the version moved re-reads the surface (the pickup).
A step whose surface (the session's surface tokens after the append plus the envelope) exceeds
the window is an *overflow*: the provider would have refused it, so the agent reports it
(``report_overflow``, a forced run on ``compaction.urgent``) and waits for the smaller surface.

The run model's window is ``--window`` tokens (16k by default: the transcripts hold 1k-15k
tokens, so at a 0.4 fraction trigger every session crosses it again and again); the policy is
trigger ``fraction`` 0.4, keep ``fraction`` 0.1 and a summarizer input budget above the window,
so a compaction is one summary call (the capacity arithmetic assumes that).

Measured (JSON keys):

* ``overflows``: steps whose surface exceeded the window (goal 0).
* ``pressure_to_checkpoint_p50_s`` / ``_p99_s``: from the append that fired the trigger (the
  first one after the session's last checkpoint) to the commit of the next checkpoint (the run
  row's ``finished_at``). Per session, every such episode counts once.
* ``pickup_p99_s``: from a checkpoint's commit to the step at which its agent picked it up (think
  time dominates it: the agent looks at its next step).
* ``step_p99_ms``: what compactd costs the agent per step (report usage + append + poll + the
  surface re-read when the version moved), over the steps taken while any compaction was in
  flight; ``step_p99_ms_at_rest`` over the steps taken while none was (the first steps of a run
  are at rest: no session is over its trigger yet). Goal: busy <= 2x at rest.
* ``compactions_per_s``: committed runs per second of the agents' phase.
* ``worker_cpu_percent`` (all workers, one core = 100) and ``worker_rss_mb`` (the largest one
  worker process reached), sampled with psutil.
* ``urgent_wait_p99_s``: report_overflow to its committed run, the bound urgent runs are
  served within; ``unserved_episodes``: triggers that never saw a checkpoint (goal 0).
* ``runway_least_s`` / ``runway_p50_s``: a session's runway is (window - trigger) / its growth
  (``growth_tokens_per_s``: the tokens it appended over its wall time), the seconds from its
  trigger to its window; ``pace``: the share of the agents' wall time spent thinking.
* ``criterion`` / ``holds``: what decides whether this fleet held (``verdict``): ``overflow``,
  ``p2c_over_runway`` (the p99 wait is at or past the least runway: given time that session
  overflows, whatever this run saw), ``unserved`` (a trigger never answered, or the queue did
  not drain), ``agents_behind`` (``pace`` under MIN_PACE: the agents' own process could not keep
  them at their pace), ``too_short`` (some agent neither crossed its trigger CROSSINGS times nor
  waited a whole runway for a checkpoint), else ``held``.
* ``largest_fleet_without_overflow`` (with ``--search``): the largest ``--agents`` that held,
  doubling from ``--agents`` and then bisecting, each trial a full run; ``trials`` holds every
  size's report. Each size runs for ``planned_run_s``: long enough, at the growth its agents'
  transcripts give at the mean think time, for the slowest agent to cross its trigger CROSSINGS
  times or use up its runway (``Headroom.run_length_s``), times RUN_LENGTH_MARGIN, at least
  ``--duration``. A size whose measured growth asked for more (``needed_run_s``) runs again
  that long (``shorter_run`` says what the first run saw). ``load_before`` / ``load_after`` are
  the machine's load averages around the agents' phase.

Charts (``--plots DIR``): ``context.png`` (context tokens of four sample agents over time against
the trigger and the window), ``queue.png`` (queue depth of compaction.urgent and
compaction.pressure, live leases, and the age of the oldest pending signal over time),
``latency.png`` (the distribution of pressure-to-checkpoint and pickup latency).

Databases: ``--database-url`` (default ``compactd_bench_fleet`` on
``COMPACTD_BENCH_DATABASE_URL``; created, migrated and EMPTIED) and ``--redis-url`` (default
``COMPACTD_BENCH_REDIS_URL``; FLUSHDB'd). Every process it starts is stopped when it ends.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import datetime as dt
import itertools
import json
import math
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from scheduler.client import CompactdClient, SessionHandle  # noqa: E402
from scheduler.samples import SampleSession, iter_steps  # noqa: E402
from storage.messages import parse  # noqa: E402
from storage.records import RunRecord  # noqa: E402
from storage.store import Store, envelope_tokens  # noqa: E402
from storage.tokens import counter_for  # noqa: E402
from tests.bench.common import (  # noqa: E402
    DEFAULT_CORPUS,
    REDIS_URL,
    machine,
    machine_line,
    percentile,
    pg_url,
    print_table,
    write_json,
)
from tests.support.fake_provider import fake_provider_process  # noqa: E402
from tests.support.services import flush_redis, reset_database  # noqa: E402
from tests.support.stack import Stack  # noqa: E402
from worker.keys import QUEUE_PRESSURE, QUEUE_URGENT  # noqa: E402
from worker.settings import load_config  # noqa: E402

RUN_MODEL = "fake-gpt"
WINDOW_TOKENS = 16_000
TRIGGER_FRACTION = 0.4
KEEP_FRACTION = 0.1
THINK_S = (1.0, 5.0)
SAMPLE_S = 0.5
DRAIN_S = 90.0
OVERFLOW_WAIT_S = 120.0
SAMPLE_AGENTS = 4
SEARCH_TRIALS = 8
WARM_UP_STEPS = 16
DEFAULT_DURATION_S = 180.0
# "Several times": one crossing says nothing about the checkpoints that follow it; three show the
# fleet's steady state (trigger, checkpoint, climb back, again).
CROSSINGS = 3
# A transcript's growth is not uniform (a run of user turns climbs slower than its mean), so the
# run planned from the mean is lengthened; the measured check after the run has the last word.
RUN_LENGTH_MARGIN = 1.2
# Below this share of their wall time spent thinking, the simulated agents step measurably slower
# than the fleet they stand for (the agents' own process is saturated): the fleet measured is
# smaller than its size says, so the size is not counted as held.
MIN_PACE = 0.9


# ------------------------------------------------------------------------------------ input


def _positive(kind: type[int] | type[float]) -> Callable[[str], Any]:
    """An argparse type: a finite number above zero, else a message naming what was given."""
    noun = "a positive integer" if kind is int else "a positive number of seconds"

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {noun}, got {text!r}") from None
        if not math.isfinite(value) or value <= 0:
            raise argparse.ArgumentTypeError(f"expected {noun}, got {text!r}")
        return value

    return parse


@dataclass(frozen=True)
class Transcript:
    name: str
    system: str
    steps: tuple[tuple[dict[str, Any], ...], ...]
    step_tokens: tuple[int, ...]  # each step's tokens as the store counts them for RUN_MODEL
    envelope_tokens: int

    def growth(self, think_scale: float) -> float:
        """Tokens per second an agent replaying it adds: a step per think time (the step's own
        milliseconds are noise against seconds of thinking)."""
        return statistics.fmean(self.step_tokens) / (statistics.fmean(THINK_S) * think_scale)


def load_transcripts(root: Path) -> list[Transcript]:
    """Every ``*.jsonl`` under ``root`` (OpenAI chat shape, one message a line), cut into steps."""
    counter = counter_for(RUN_MODEL)
    out = []
    for path in sorted(root.rglob("*.jsonl")):
        messages = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()
                    if line.strip()]
        head = 0
        while head < len(messages) and messages[head].get("role") == "system":
            head += 1
        system = "\n\n".join(str(m.get("content") or "") for m in messages[:head])
        rest = [m for m in messages[head:] if m.get("role") != "system"]
        steps = tuple(tuple(s) for s in iter_steps(SampleSession(rest)))
        if steps:
            tokens = tuple(sum(counter.count_message(m) for raw in step for m in parse(raw))
                           for step in steps)
            envelope = envelope_tokens({"system": system} if system else None, RUN_MODEL)
            out.append(Transcript(path.stem, system, steps, tokens, envelope))
    return out


@dataclass(frozen=True)
class Headroom:
    """The run model's window and the trigger, in context tokens, and what a session's growth
    rate makes of them."""

    window: int
    trigger: int

    def runway_s(self, growth: float) -> float:
        """Seconds from the trigger to the window at ``growth`` tokens per second."""
        return (self.window - self.trigger) / growth if growth > 0 else math.inf

    def run_length_s(self, growth: float, envelope: int, latency_s: float) -> float:
        """Long enough for a session growing at ``growth`` to climb from its envelope to the
        trigger and then either cross it CROSSINGS - 1 more times (each climb back is at most
        trigger - envelope tokens, after at least one summary call) or, when no checkpoint
        comes, use up its whole runway: the longer of the two, so the run shows whichever
        happens."""
        if growth <= 0:
            return math.inf
        climb = max(0, self.trigger - envelope) / growth
        again = (CROSSINGS - 1) * (latency_s + climb)
        return climb + max(again, self.runway_s(growth))


def headroom(args: argparse.Namespace) -> Headroom:
    return Headroom(args.window, int(args.window * TRIGGER_FRACTION))


def planned_run_s(transcripts: Sequence[Transcript], agents: int,
                  args: argparse.Namespace) -> tuple[float, float]:
    """The run length for ``agents`` agents from their transcripts' growth rates (the one that
    needs the longest run sets it: the slowest), and that slowest rate."""
    used = [transcripts[i % len(transcripts)] for i in range(min(agents, len(transcripts)))]
    room = headroom(args)
    slowest = max(used, key=lambda t: room.run_length_s(t.growth(args.think_scale),
                                                        t.envelope_tokens, args.latency))
    growth = slowest.growth(args.think_scale)
    length = room.run_length_s(growth, slowest.envelope_tokens, args.latency)
    return RUN_LENGTH_MARGIN * length, growth


def _fresh(message: dict[str, Any], prefix: str) -> dict[str, Any]:
    """The message with its tool-call ids prefixed, so a replayed loop reuses no id."""
    out = dict(message)
    if out.get("tool_calls"):
        out["tool_calls"] = [{**call, "id": prefix + call["id"]} for call in out["tool_calls"]]
    if out.get("tool_call_id"):
        out["tool_call_id"] = prefix + out["tool_call_id"]
    return out


def replay(transcript: Transcript) -> Iterator[list[dict[str, Any]]]:
    loop = 0
    while True:
        prefix = f"l{loop}_" if loop else ""
        for step in transcript.steps:
            yield [_fresh(m, prefix) if prefix else dict(m) for m in step]
        loop += 1


# -------------------------------------------------------------------------------- recording


@dataclass
class AgentLog:
    session_id: str
    envelope_tokens: int = 0
    began: float = 0.0  # when it started thinking of its first step
    thought_s: float = 0.0  # think time before the steps it took
    appended_tokens: int = 0
    # (wall time, fired) of every append; wall times of pickups; (start, end, ms) of steps
    appends: list[tuple[float, bool]] = field(default_factory=list)
    pickups: list[float] = field(default_factory=list)
    steps: list[tuple[float, float, float]] = field(default_factory=list)
    context: list[tuple[float, int]] = field(default_factory=list)
    overflows: list[tuple[float, int]] = field(default_factory=list)
    overflow_waits: list[float] = field(default_factory=list)
    overflow_failed: int = 0


@dataclass
class Sample:
    t: float
    urgent: int
    pressure: int
    leases: int
    oldest_signal_s: float
    cpu_s: float
    rss_mb: float


async def agent(client: CompactdClient, log: AgentLog, transcript: Transcript, *, window: int,
                think_scale: float, stop_at: float, rng: random.Random) -> None:
    session: SessionHandle = await client.create_session(
        log.session_id, run_model=RUN_MODEL, context_window=window,
        envelope={"system": transcript.system} if transcript.system else None)
    envelope = session.info.envelope_tokens
    log.envelope_tokens = envelope
    log.began = time.time()
    context = envelope
    for step, step_tokens in zip(replay(transcript), itertools.cycle(transcript.step_tokens),
                                 strict=False):
        think = rng.uniform(*THINK_S) * think_scale
        await asyncio.sleep(think)
        if time.monotonic() >= stop_at:
            return
        log.thought_s += think
        log.appended_tokens += step_tokens
        started = time.time()
        t0 = time.perf_counter()
        # The model call of the think time just answered: its input count, as the provider
        # reports it, then the turn it produced.
        await session.report_usage(context)
        result = await session.append(step)
        moved = await session.poll() is not None
        if moved:
            await session.surface()
        elapsed_ms = (time.perf_counter() - t0) * 1000
        ended = time.time()
        log.steps.append((started, ended, elapsed_ms))
        log.appends.append((started, result.fired))
        # An upper bound of what the next model call carries: a checkpoint that lands between
        # the append and the poll is counted from the next step on.
        context = result.tokens + envelope
        if moved:
            log.pickups.append(ended)
            context = (await client.store.get_session(session.id)).surface_tokens + envelope
        log.context.append((ended, context))
        if context > window:
            log.overflows.append((ended, context))
            t1 = time.perf_counter()
            try:
                outcome = await session.report_overflow(timeout_s=OVERFLOW_WAIT_S)
            except Exception:
                log.overflow_failed += 1
                continue
            if outcome.compacted:
                log.overflow_waits.append(time.perf_counter() - t1)
                log.pickups.append(time.time())
                context = (await client.store.get_session(session.id)).surface_tokens + envelope
                log.context.append((time.time(), context))
            else:
                log.overflow_failed += 1


class Sampler:
    """Queue depth, live leases, the oldest pending signal and the workers' CPU and RSS, every
    ``SAMPLE_S``, on connections of its own."""

    def __init__(self, database_url: str, redis_url: str, worker_pids: Sequence[int]) -> None:
        import psutil
        import redis.asyncio as aioredis

        self.store = Store.from_url(database_url, pool_size=1)
        self.redis = aioredis.Redis.from_url(redis_url)
        self.procs = [psutil.Process(pid) for pid in worker_pids]
        self.samples: list[Sample] = []

    def cpu_s(self) -> float:
        total = 0.0
        for proc in self.procs:
            with contextlib.suppress(Exception):
                times = proc.cpu_times()
                total += times.user + times.system
        return total

    def rss_mb(self) -> float:
        peak = 0.0
        for proc in self.procs:
            with contextlib.suppress(Exception):
                peak = max(peak, proc.memory_info().rss / 2**20)
        return peak

    async def sample(self) -> Sample:
        urgent = int(await self.redis.llen(QUEUE_URGENT))
        pressure = int(await self.redis.llen(QUEUE_PRESSURE))
        sessions = await self.store.list_sessions(limit=100_000)
        now = dt.datetime.now(dt.UTC)
        marks = [s.signal_at for s in sessions if s.signal_at is not None]
        leases = sum(1 for s in sessions if s.lease_live(now))
        oldest = max(((now - m).total_seconds() for m in marks), default=0.0)
        sample = Sample(time.time(), urgent, pressure, leases, oldest, self.cpu_s(),
                        self.rss_mb())
        self.samples.append(sample)
        return sample

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.sample()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), SAMPLE_S)

    async def close(self) -> None:
        await self.redis.aclose()
        await self.store.close()


# ---------------------------------------------------------------------------------- driving


@dataclass
class Raw:
    agents: int
    workers: int
    began: float
    agents_ended: float
    logs: list[AgentLog]
    samples: list[Sample]
    runs: list[RunRecord]
    drained: bool


async def drive(stack: Stack, transcripts: list[Transcript], worker_pids: list[int],
                args: argparse.Namespace, agents: int, duration: float) -> Raw:
    config = load_config(env=stack.env)
    sampler = Sampler(stack.database_url, stack.redis_url, worker_pids)
    stop = asyncio.Event()
    logs = [AgentLog(f"fleet-{i:04d}") for i in range(agents)]
    async with CompactdClient(config) as client:
        await warm_up(client, transcripts, args.workers * args.concurrency)
        began_dt = dt.datetime.now(dt.UTC)
        sampling = asyncio.create_task(sampler.run(stop))
        began = time.time()
        stop_at = time.monotonic() + duration
        await asyncio.gather(*(
            agent(client, log, transcripts[i % len(transcripts)], window=args.window,
                  think_scale=args.think_scale, stop_at=stop_at,
                  rng=random.Random(args.seed * 100_003 + i))
            for i, log in enumerate(logs)))
        agents_ended = time.time()
        # What the agents set off is finished before anything is counted: no lease, nothing
        # queued, no pending signal, every triggered session's checkpoint committed.
        drained = False
        deadline = time.monotonic() + DRAIN_S
        while time.monotonic() < deadline:
            last = sampler.samples[-1] if sampler.samples else await sampler.sample()
            if not (last.urgent or last.pressure or last.leases or last.oldest_signal_s):
                runs = await client.store.recent_runs(since=began_dt, limit=10_000_000)
                if not unserved(logs, runs):
                    drained = True
                    break
            await asyncio.sleep(SAMPLE_S)
        stop.set()
        await sampling
        runs = await client.store.recent_runs(since=began_dt, limit=10_000_000)
    await sampler.close()
    return Raw(agents, args.workers, began, agents_ended, logs, sampler.samples, runs, drained)


async def warm_up(client: CompactdClient, transcripts: list[Transcript], slots: int) -> None:
    """One forced compaction per worker slot before the agents start, not measured: a worker's
    first runs pay for its SDK clients and connections (seconds on a loaded machine), which a
    fleet's long-running workers paid long ago."""
    # Enough history that a summary is shorter than what it replaces (else it is refused).
    replayed = replay(transcripts[0])
    steps = [m for _ in range(WARM_UP_STEPS) for m in next(replayed)]

    async def one(n: int) -> None:
        session = await client.create_session(f"warmup-{n:03d}", run_model=RUN_MODEL)
        await session.append(steps)
        await session.compact(force=True, timeout_s=OVERFLOW_WAIT_S)

    await asyncio.gather(*(one(n) for n in range(slots)))


def run_fleet(args: argparse.Namespace, transcripts: list[Transcript], fake_url: str,
              home: Path, agents: int, duration: float) -> tuple[dict[str, Any], Raw]:
    asyncio.run(reset_database(args.database_url))
    flush_redis(args.redis_url)
    policy = {"trigger": {"type": "fraction", "value": TRIGGER_FRACTION},
              "keep": {"type": "fraction", "value": KEEP_FRACTION}, "model_name": RUN_MODEL,
              "trim_tokens_to_summarize": 4 * args.window}
    with Stack(args.database_url, args.redis_url, home / f"fleet-{agents}", fake_url=fake_url,
               summarization=policy, worker={"concurrency": args.concurrency}) as stack:
        pids = [stack.start_worker(f"w{i}", concurrency=args.concurrency, ready_timeout=90).pid
                for i in range(args.workers)]
        stack.start_beat()
        planned, slowest = planned_run_s(transcripts, agents, args)
        print(f"[{agents} agents, {args.workers} worker(s) x {args.concurrency}] running "
              f"{duration:.0f} s; long enough for every agent: {planned:.0f} s (slowest growth "
              f"{slowest:.1f} tokens/s, trigger {headroom(args).trigger} of "
              f"{args.window} tokens, its runway {headroom(args).runway_s(slowest):.0f} s, "
              f"{CROSSINGS} crossings, x{RUN_LENGTH_MARGIN:g})", file=sys.stderr, flush=True)
        load_before = os.getloadavg()
        raw = asyncio.run(drive(stack, transcripts, pids, args, agents, duration))
        load_after = os.getloadavg()
    result = measure(raw, args)
    result.update(planned_run_s=round(planned, 1),
                  load_before=[round(x, 2) for x in load_before],
                  load_after=[round(x, 2) for x in load_after])
    result.update(holds=verdict(result) == HELD, criterion=verdict(result))
    return result, raw


# -------------------------------------------------------------------------------- measuring


def commits_by_session(runs: Sequence[RunRecord]) -> dict[str, list[float]]:
    return {sid: [a.finished for a in answers if a.committed]
            for sid, answers in answers_by_session(runs).items()}


@dataclass(frozen=True, order=True)
class Answer:
    """A run that ended with a checkpoint or found nothing to do: the worker's answer."""

    finished: float
    started: float
    committed: bool


def answers_by_session(runs: Sequence[RunRecord]) -> dict[str, list[Answer]]:
    out: dict[str, list[Answer]] = {}
    for run in runs:
        if run.status in ("committed", "nothing_to_do") and run.finished_at is not None:
            out.setdefault(run.session_id, []).append(Answer(
                run.finished_at.timestamp(), run.started_at.timestamp(),
                run.status == "committed"))
    for answers in out.values():
        answers.sort()
    return out


@dataclass
class Episodes:
    latencies: list[float] = field(default_factory=list)  # trigger to checkpoint, s
    opened: list[float] = field(default_factory=list)  # each latency's trigger (wall time)
    nothing_to_do: int = 0  # a run looked after the trigger and found nothing to compact
    unserved: int = 0  # no run answered the trigger
    open_since: float | None = None  # the unanswered trigger's append


def episodes(log: AgentLog, answers: Sequence[Answer]) -> Episodes:
    """An episode opens at the first append that fired after the session's last answer and
    closes at the next checkpoint's commit (any run's: it lowered the pressure), or at a run
    started after it that found nothing to compact (the kept tail alone is over the trigger:
    the policy's answer, not a lost signal)."""
    out = Episodes()
    opened: float | None = None

    def close(until: float) -> None:
        nonlocal opened
        assert opened is not None
        for a in answers:
            if a.finished <= opened or a.finished > until:
                continue
            if a.committed:
                out.latencies.append(a.finished - opened)
                out.opened.append(opened)
            elif a.started >= opened:
                out.nothing_to_do += 1
            else:
                continue
            opened = None
            return

    for t, fired in log.appends:
        if opened is not None:
            close(t)
        if fired and opened is None:
            opened = t
    if opened is not None:
        close(math.inf)
    out.unserved = int(opened is not None)
    out.open_since = opened
    return out


def unserved(logs: Sequence[AgentLog], runs: Sequence[RunRecord]) -> int:
    answers = answers_by_session(runs)
    return sum(episodes(log, answers.get(log.session_id, [])).unserved for log in logs)


def pickup_latencies(log: AgentLog, commits: Sequence[float]) -> list[float]:
    out = []
    for c in commits:
        k = bisect.bisect_left(log.pickups, c)
        if k < len(log.pickups):
            out.append(log.pickups[k] - c)
    return out


def busy_spans(runs: Sequence[RunRecord], until: float) -> list[tuple[float, float]]:
    """The union of the intervals in which at least one run was in flight."""
    spans = sorted((r.started_at.timestamp(),
                    r.finished_at.timestamp() if r.finished_at else until) for r in runs)
    merged: list[tuple[float, float]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def overlaps(spans: Sequence[tuple[float, float]], start: float, end: float) -> bool:
    k = bisect.bisect_right(spans, (end, math.inf))
    return k > 0 and spans[k - 1][1] >= start


def _round(value: float, digits: int) -> float | None:
    return None if math.isnan(value) else round(value, digits)


def _finite(value: float, digits: int) -> float | None:
    return round(value, digits) if math.isfinite(value) else None


@dataclass(frozen=True)
class Coverage:
    """What one agent's run showed: its measured growth, its runway at that growth, how often
    it crossed its trigger, and whether the run was long enough to say anything about it."""

    growth: float  # tokens per second, appended over its wall time
    runway_s: float
    crossings: int
    covered: bool  # crossed CROSSINGS times, or waited its whole runway for a checkpoint
    needed_s: float  # the run length its measured growth asks for
    thought_s: float
    span_s: float


def coverage(log: AgentLog, found: Episodes, room: Headroom, latency_s: float) -> Coverage:
    span = (log.steps[-1][1] - log.began) if log.steps else 0.0
    growth = log.appended_tokens / span if span > 0 else 0.0
    runway = room.runway_s(growth)
    crossings = len(found.latencies) + found.nothing_to_do + found.unserved
    # When the workers keep up, the run shows it by the crossings; when they do not, by a wait
    # as long as the runway (the session reached its window, or would have at this growth).
    waits = [*found.latencies]
    if found.open_since is not None and log.steps:
        waits.append(log.steps[-1][1] - found.open_since)
    waited_out = max(waits, default=0.0) >= runway
    return Coverage(growth, runway, crossings, crossings >= CROSSINGS or waited_out,
                    room.run_length_s(growth, log.envelope_tokens, latency_s), log.thought_s,
                    span)


HELD = "held"
OVERFLOW = "overflow"
P2C_OVER_RUNWAY = "p2c_over_runway"
QUEUE_GROWING = "queue_growing"
UNSERVED = "unserved"
AGENTS_BEHIND = "agents_behind"
TOO_SHORT = "too_short"


def verdict(result: dict[str, Any]) -> str:
    """The criterion that decides whether the fleet held: the first that fails, else HELD.

    An overflow, a pressure-to-checkpoint p99 at or past the least runway (that session would
    overflow given time, whatever this run saw), a wait growing so that it would pass the least
    runway had the run lasted as long again (the workers fall behind: a queue that grows
    overflows given time) or a trigger never answered is a failure. Agents
    that fell behind their pace, or a run too short for every agent to cross its trigger
    CROSSINGS times or use up its runway, say nothing either way: not held."""
    if result["overflows"]:
        return OVERFLOW
    p99, runway = result["pressure_to_checkpoint_p99_s"], result["runway_least_s"]
    if p99 is not None and runway is not None and p99 >= runway:
        return P2C_OVER_RUNWAY
    projected = result["pressure_to_checkpoint_p99_projected_s"]
    if projected is not None and runway is not None and projected >= runway:
        return QUEUE_GROWING
    if result["unserved_episodes"] or not result["drained"]:
        return UNSERVED
    if result["pace"] is None or result["pace"] < MIN_PACE:
        return AGENTS_BEHIND
    if result["agents_short_of_run"]:
        return TOO_SHORT
    return HELD


def wait_trend(opened: Sequence[float], waits: Sequence[float], since: float) -> float | None:
    """Seconds of pressure-to-checkpoint wait gained per second of run, over the episodes whose
    trigger came after ``since`` (least squares): about 0 while the workers keep up, the
    backlog's growth over their throughput when they do not."""
    points = [(t, w) for t, w in zip(opened, waits, strict=True) if t >= since]
    if len(points) < 3 or len({t for t, _ in points}) < 2:
        return None
    return statistics.linear_regression([t for t, _ in points], [w for _, w in points]).slope


def measure(raw: Raw, args: argparse.Namespace) -> dict[str, Any]:
    commits = commits_by_session(raw.runs)
    answers = answers_by_session(raw.runs)
    room = headroom(args)
    latencies: list[float] = []
    opened: list[float] = []
    pickups: list[float] = []
    covers: list[Coverage] = []
    missing = nothing = 0
    for log in raw.logs:
        found = episodes(log, answers.get(log.session_id, []))
        latencies += found.latencies
        opened += found.opened
        missing += found.unserved
        nothing += found.nothing_to_do
        covers.append(coverage(log, found, room, args.latency))
        mine = commits.get(log.session_id, [])
        pickups += pickup_latencies(log, [c for c in mine if c <= raw.agents_ended])
    growths = [c.growth for c in covers]
    runways = [c.runway_s for c in covers if math.isfinite(c.runway_s)]
    spans = sum(c.span_s for c in covers)
    in_flight = busy_spans(raw.runs, time.time())
    busy: list[float] = []
    rest: list[float] = []
    for log in raw.logs:
        for start, end, ms in log.steps:
            (busy if overlaps(in_flight, start, end) else rest).append(ms)
    phase = raw.agents_ended - raw.began
    # The second half: the first crossings all come within a climb of the start, a burst the
    # trend would read as a falling wait.
    trend = wait_trend(opened, latencies, raw.began + phase / 2)
    p99 = percentile(latencies, 99)
    committed = [r for r in raw.runs if r.status == "committed" and r.finished_at is not None
                 and r.finished_at.timestamp() <= raw.agents_ended]
    outcomes: dict[str, int] = {}
    for run in raw.runs:
        key = run.status + (f":{run.failure_class}" if run.failure_class else "")
        outcomes[key] = outcomes.get(key, 0) + 1
    triggers: dict[str, int] = {}
    for run in raw.runs:
        triggers[run.trigger] = triggers.get(run.trigger, 0) + 1
    agent_samples = [s for s in raw.samples if s.t <= raw.agents_ended]
    cpu = (agent_samples[-1].cpu_s - agent_samples[0].cpu_s) if len(agent_samples) > 1 else 0.0
    cpu_wall = (agent_samples[-1].t - agent_samples[0].t) if len(agent_samples) > 1 else 0.0
    waits = [w for log in raw.logs for w in log.overflow_waits]
    signalled = {log.session_id for log in raw.logs if any(f for _, f in log.appends)}
    checkpointed = {sid for sid in signalled if commits.get(sid)}
    steps = [s for log in raw.logs for s in log.steps]
    return {
        "agents": raw.agents,
        "workers": raw.workers,
        "overflows": sum(len(log.overflows) for log in raw.logs),
        "pressure_to_checkpoint_p50_s": _round(percentile(latencies, 50), 3),
        "pressure_to_checkpoint_p99_s": _round(p99, 3),
        "pickup_p99_s": _round(percentile(pickups, 99), 3),
        "step_p99_ms": _round(percentile(busy, 99), 2),
        "step_p99_ms_at_rest": _round(percentile(rest, 99), 2),
        "compactions_per_s": round(len(committed) / phase, 3) if phase > 0 else 0.0,
        "worker_cpu_percent": round(100 * cpu / cpu_wall, 1) if cpu_wall > 0 else None,
        "worker_rss_mb": round(max((s.rss_mb for s in raw.samples), default=0.0), 1),
        "urgent_wait_p99_s": _round(percentile(waits, 99), 3),
        "overflows_not_compacted": sum(log.overflow_failed for log in raw.logs),
        "pressure_episodes": len(latencies) + nothing + missing,
        "episodes_nothing_to_do": nothing,
        "unserved_episodes": missing,
        "signalled_sessions": len(signalled),
        "checkpointed_sessions": len(checkpointed),
        "steps": len(steps),
        "steps_busy": len(busy),
        "steps_at_rest": len(rest),
        "step_p50_ms": _round(percentile(busy, 50), 2),
        "pickup_p50_s": _round(percentile(pickups, 50), 3),
        "max_queue_depth": max((s.urgent + s.pressure for s in raw.samples), default=0),
        "max_oldest_signal_s": round(max((s.oldest_signal_s for s in raw.samples),
                                         default=0.0), 2),
        "runs": outcomes,
        "runs_by_trigger": triggers,
        "drained": raw.drained,
        "duration_s": round(phase, 1),
        "latency_s": args.latency,
        "concurrency": args.concurrency,
        "window_tokens": args.window,
        "trigger_tokens": room.trigger,
        "growth_tokens_per_s": {"min": _round(min(growths, default=math.nan), 1),
                                "p50": _round(percentile(growths, 50), 1),
                                "max": _round(max(growths, default=math.nan), 1)},
        "p2c_trend_s_per_min": None if trend is None else round(60 * trend, 3),
        # the p99 had the run lasted as long again at that trend (a falling one counts as flat)
        "pressure_to_checkpoint_p99_projected_s": _round(
            p99 + max(0.0, trend or 0.0) * phase, 3),
        "runway_least_s": _round(min(runways, default=math.nan), 1),
        "runway_p50_s": _round(percentile(runways, 50), 1),
        "trigger_crossings_min": min((c.crossings for c in covers), default=0),
        "agents_short_of_run": sum(1 for c in covers if not c.covered),
        "needed_run_s": _finite(RUN_LENGTH_MARGIN * max((c.needed_s for c in covers),
                                                        default=math.nan), 1),
        "pace": round(sum(c.thought_s for c in covers) / spans, 3) if spans > 0 else None,
    }


# ---------------------------------------------------------------------------------- charts


def plot(raw: Raw, result: dict[str, Any], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    t0 = raw.began
    title = (f"{raw.agents} agents, {raw.workers} worker(s) x {result['concurrency']}, "
             f"summary latency {result['latency_s']:g} s")
    paths = []

    fig, ax = plt.subplots(figsize=(8, 4))
    for log in raw.logs[:SAMPLE_AGENTS]:
        ax.step([t - t0 for t, _ in log.context], [n for _, n in log.context], where="post",
                label=log.session_id, linewidth=1)
    ax.axhline(result["trigger_tokens"], color="tab:orange", linestyle="--", label="trigger")
    ax.axhline(result["window_tokens"], color="tab:red", label="window")
    ax.set(xlabel="s", ylabel="context tokens (surface + envelope)", title=title)
    ax.legend(fontsize=7, loc="upper right")
    paths.append(_save(fig, out / "context.png"))

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 5), sharex=True)
    ts = [s.t - t0 for s in raw.samples]
    top.plot(ts, [s.urgent for s in raw.samples], label=QUEUE_URGENT)
    top.plot(ts, [s.pressure for s in raw.samples], label=QUEUE_PRESSURE)
    top.plot(ts, [s.leases for s in raw.samples], label="live leases", linestyle=":")
    top.axvline(raw.agents_ended - t0, color="grey", linewidth=0.8)
    top.set(ylabel="messages / leases", title=title)
    top.legend(fontsize=7)
    bottom.plot(ts, [s.oldest_signal_s for s in raw.samples], color="tab:purple")
    bottom.axvline(raw.agents_ended - t0, color="grey", linewidth=0.8)
    bottom.set(xlabel="s (grey: agents stop)", ylabel="oldest pending signal, s")
    paths.append(_save(fig, out / "queue.png"))

    commits = commits_by_session(raw.runs)
    answers = answers_by_session(raw.runs)
    latencies = [x for log in raw.logs
                 for x in episodes(log, answers.get(log.session_id, [])).latencies]
    pickups = [x for log in raw.logs
               for x in pickup_latencies(log, commits.get(log.session_id, []))]
    fig, ax = plt.subplots(figsize=(8, 4))
    if latencies or pickups:
        top_s = max([*latencies, *pickups])
        bins = [top_s * i / 40 for i in range(41)] if top_s > 0 else 10
        ax.hist(latencies, bins=bins, alpha=0.7, label="pressure -> checkpoint")
        ax.hist(pickups, bins=bins, alpha=0.5, label="checkpoint -> pickup")
    for key, style in (("pressure_to_checkpoint_p50_s", ":"),
                       ("pressure_to_checkpoint_p99_s", "--")):
        if result[key] is not None:
            ax.axvline(result[key], color="black", linestyle=style, label=key)
    ax.set(xlabel="s", ylabel="count", title=title)
    ax.legend(fontsize=7)
    paths.append(_save(fig, out / "latency.png"))
    return paths


def _save(fig: Any, path: Path) -> str:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return str(path)


# ------------------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    count, seconds = _positive(int), _positive(float)
    parser.add_argument("--agents", type=count, default=40, help="agents (asyncio tasks)")
    parser.add_argument("--workers", type=count, default=1, help="worker processes")
    parser.add_argument("--duration", type=seconds,
                        help=f"seconds the agents step for (default {DEFAULT_DURATION_S:g}; "
                        "with --search, the least: each size runs as long as its agents' "
                        "growth needs)")
    parser.add_argument("--latency", type=seconds, default=1.0,
                        help="the fake provider's seconds per summary call")
    parser.add_argument("--concurrency", type=count, default=4,
                        help="compactions in flight per worker (its threads)")
    parser.add_argument("--window", type=count, default=WINDOW_TOKENS,
                        help="the run model's context window, tokens")
    parser.add_argument("--think-scale", type=seconds, default=1.0,
                        help="multiplies the agents' 1-5 s think time (a smoke run: 0.1)")
    parser.add_argument("--transcripts", type=Path, default=DEFAULT_CORPUS,
                        help="folder of *.jsonl transcripts (default ../shared/corpus)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", type=Path, help="write the report here")
    parser.add_argument("--plots", type=Path, help="write the PNG charts into this folder")
    parser.add_argument("--search", action="store_true",
                        help="find the largest fleet that holds: 0 overflows, pressure-to-"
                        "checkpoint p99 under the least runway, runs long enough (several "
                        "runs of minutes each)")
    parser.add_argument("--home", type=Path,
                        help="keep the processes' config and logs here (default: a temporary "
                        "folder, removed at the end)")
    parser.add_argument("--database-url", default=pg_url("fleet"),
                        help="PostgreSQL database to use (EMPTIED)")
    parser.add_argument("--redis-url", default=REDIS_URL, help="Redis database (FLUSHDB'd)")
    args = parser.parse_args(argv)
    if not args.transcripts.is_dir() or not any(args.transcripts.rglob("*.jsonl")):
        parser.error(f"--transcripts: no *.jsonl transcripts under {args.transcripts} "
                     "(the corpus lives in ../shared/corpus beside the repository; "
                     "point --transcripts at a folder of OpenAI-shape JSONL files)")
    return args


def _raise_exit(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)


def search(args: argparse.Namespace, trial: Callable[[int], dict[str, Any]]
           ) -> tuple[int | None, list[dict[str, Any]]]:
    """Double the fleet from ``--agents`` while it holds (``verdict``), then bisect."""
    trials: list[dict[str, Any]] = []
    good, bad = 0, 0
    n = args.agents
    while len(trials) < SEARCH_TRIALS:
        result = trial(n)
        trials.append(result)
        if result["holds"]:
            good = n
        else:
            bad = n
        if not bad:
            n *= 2
        elif bad - good <= max(1, good // 10):
            break
        else:
            n = (good + bad) // 2 if good else max(1, bad // 2)
            if n in (good, bad):
                break
    return (good or None), trials


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _raise_exit)
    transcripts = load_transcripts(args.transcripts)
    info = machine()
    report: dict[str, Any]
    with fake_provider_process(args.latency) as fake_url, \
            tempfile.TemporaryDirectory(prefix="compactd-fleet-") as tmp:
        if args.home is not None:
            tmp = str(args.home)
        raws: dict[int, tuple[dict[str, Any], Raw]] = {}

        def run(n: int, duration: float) -> dict[str, Any]:
            raws[n] = run_fleet(args, transcripts, fake_url, Path(tmp), n, duration)
            print(json.dumps(raws[n][0]), file=sys.stderr, flush=True)
            return raws[n][0]

        def trial(n: int) -> dict[str, Any]:
            planned, _ = planned_run_s(transcripts, n, args)
            result = run(n, max(planned, args.duration or 0.0))
            # The plan comes from the transcripts at the intended pace; the agents' measured
            # growth can be slower (a loaded machine): once more, as long as that asks.
            needed = result["needed_run_s"]
            if result["criterion"] == TOO_SHORT and needed and needed > result["duration_s"]:
                short = {k: result[k] for k in ("duration_s", "criterion",
                                                "agents_short_of_run", "needed_run_s")}
                result = run(n, needed)
                result["shorter_run"] = short
            return result

        if args.search:
            largest, trials = search(args, trial)
            shown = largest or args.agents
            if shown not in raws:
                trial(shown)
            result, raw = raws[shown]
            report = {**result, "largest_fleet_without_overflow": largest, "trials": trials}
        else:
            run(args.agents, args.duration or DEFAULT_DURATION_S)
            result, raw = raws[args.agents]
            report = dict(result)
        report["plots"] = plot(raw, result, args.plots) if args.plots else []
    report.update({"machine": info, "transcripts": str(args.transcripts),
                   "transcript_files": len(transcripts),
                   "think_s": [x * args.think_scale for x in THINK_S]})
    print(f"machine: {machine_line(info)}")
    print_table(["agents", "workers", "run s", "overflows", "p2c p50 s", "p2c p99 s",
                 "least runway s", "pickup p99 s", "step p99 ms", "at rest ms", "compactions/s",
                 "worker CPU %", "RSS MB", "pace", "load before/after", "criterion"],
                [[r["agents"], r["workers"], r["duration_s"], r["overflows"],
                  r["pressure_to_checkpoint_p50_s"], r["pressure_to_checkpoint_p99_s"],
                  r["runway_least_s"], r["pickup_p99_s"], r["step_p99_ms"],
                  r["step_p99_ms_at_rest"], r["compactions_per_s"], r["worker_cpu_percent"],
                  r["worker_rss_mb"], r["pace"],
                  f"{r['load_before'][0]:g}/{r['load_after'][0]:g}", r["criterion"]]
                 for r in report.get("trials", [report])])
    if args.search:
        print(f"largest fleet without overflow: {report['largest_fleet_without_overflow']}")
    write_json(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
