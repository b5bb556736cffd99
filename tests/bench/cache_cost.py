"""What compaction costs at the provider's prefix cache: an agent loop over the long sessions.

    python tests/bench/cache_cost.py --json OUT [--sessions NAME,...] [--latency S] [--think S]
        [--trigger 16000] [--keep 6] [--trim 4000] [--window 128000] [--concurrency 4]
        [--corpus DIR | --transcripts DIR] [--quick]

Sessions: the long concatenations of 30k-150k conversation tokens that ``tests/bench/corpus.py``
builds from ``--corpus`` (default ``../shared/corpus`` beside the repository), or with
``--transcripts DIR`` every ``DIR/<group>/*.jsonl`` as it is; ``--sessions`` picks some by name.
Each session is replayed step by step (an assistant message with what follows it up to the next
one, as a runtime appends it). After every step the agent sends its model request to the fake
provider (``tests/support/fake_provider.py``, in a process of its own, prefix cache on) over HTTP
through the official openai SDK, with a stable ``prompt_cache_key`` per session; the request is
the session's system prompt plus what the side would send, and on a compactd side the answer
takes ``--think`` seconds (the agent's own model call, while the worker compacts). The sessions
of a side run concurrently; ``--quick`` takes the smallest one only, with shorter calls.

Sides, all with the same trigger (``--trigger`` tokens of the conversation, system prompt not
counted), keep (``--keep`` messages), summarizer input budget (``--trim`` tokens), run-model
window (``--window``), o200k token counter, and the same fake as the summary model (``fake-mini``,
answering after ``--latency`` seconds):

* ``langchain``: the real ``SummarizationMiddleware`` (LangChain 1.x) in-band, as it is: the step
  joins the state with LangGraph's ``add_messages``, ``abefore_model`` runs (its model is
  ``ChatOpenAI`` pointed at the fake: its summary calls are the summarizer's tokens) and its
  update is applied; the request is the state.
* ``merge``: compactd's default layout (``summarization.layout`` left unset) with a REAL worker
  (``celery -A worker.app worker``, PostgreSQL, Redis) compacting in the background. The agent
  appends the step through the runtime client, polls, and re-reads the surface only when the
  version moved; its request is the surface it holds (the last surface read, then its own steps
  as compactd renders them). It never waits for a compaction: a checkpoint is picked up at the
  first step after its commit. Checkpoints render in compactd's default form
  (``durable_context``); every other policy key is compactd's default.
* ``recallable``: the same, with ``summarization.layout: recallable`` in the config file the
  worker reads. Where the policy does not know that key, the side is reported as not available
  (a line in the table, ``null`` in the JSON).

Per side (sums over sessions; ``sessions`` has them per session):

* ``agent_input_tokens``, ``agent_cached_tokens``: the agent's requests as the fake reported them
  to the SDK (``prompt_tokens`` and ``prompt_tokens_details.cached_tokens``: the longest prefix
  shared with an earlier request of the session, in 128-token blocks past the first 1,024);
  ``agent_uncached_tokens`` is their difference.
* ``compaction_uncached_tokens``: over the requests that do not extend the session's previous
  request (a compaction replaced or rewrote part of what it had sent: LangChain's update, a
  compactd surface picked up), the uncached tokens minus the tokens of the step's own messages
  (new since the previous request, uncached whatever the side does), floored at 0. A request
  that extends the previous one counts 0 (its uncached tokens are its new step plus the cache's
  block rounding). ``compaction_requests`` counts the requests it is taken over.
* ``summarizer_input_tokens``, ``summarizer_cached_tokens``, ``summarizer_output_tokens``,
  ``summarizer_calls``: every summary call the fake answered during the side (from its request
  log), the worker's runs still in flight at the agent's last step included: a compactd side
  drains (no queued task, lease or pending signal) before it is counted.
* ``final_context_tokens``: the input tokens of each session's last request.
* ``cost_usd``: at ``PRICES`` (USD per million tokens for ``PRICE_MODEL``): uncached input,
  cached input and output, for the agent's input and the summarizer's input and output. The
  agent's own output is the transcript's on every side and is left out.
* ``overflows``: requests over the window; ``compactions``: LangChain updates applied, or compactd
  runs committed; ``pickups``: surfaces a compactd agent re-read.

Not comparable: compactd's checkpoints land some steps after their trigger (how many follows from
``--latency`` against ``--think``: by default both calls take 0.1 s), LangChain's before the
request that fired it. Nothing LangChain does depends on time, so its agent calls answer at once
and its ``seconds`` are its summary calls and the loop's own cost. The agent's requests go
through the SDK's ``post`` with the body ``chat.completions.create`` would send.

Databases: ``--database-url`` (default ``compactd_bench_cache_cost`` on
``COMPACTD_BENCH_DATABASE_URL``; created, migrated and EMPTIED for each compactd side) and
``--redis-url`` (default ``COMPACTD_BENCH_REDIS_URL``; FLUSHDB'd). Every process it starts is
stopped when it ends.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from langchain.agents.middleware import SummarizationMiddleware  # noqa: E402
from langchain_core.messages import AnyMessage  # noqa: E402
from openai import AsyncOpenAI  # noqa: E402
from openai.types.chat import ChatCompletion  # noqa: E402

from scheduler import args as cli_types  # noqa: E402
from scheduler.client import CompactdClient, parse_messages  # noqa: E402
from storage.errors import ConfigError  # noqa: E402
from storage.kinds import RunStatus  # noqa: E402
from storage.tokens import counter_for  # noqa: E402
from tests.bench.common import (  # noqa: E402
    DEFAULT_CORPUS,
    REDIS_URL,
    machine,
    machine_line,
    pg_url,
    print_table,
    write_json,
)
from tests.bench.corpus import (  # noqa: E402
    LCCounter,
    Session,
    corpus_sessions,
    long_sessions,
    openai_wire,
    wire,
)
from tests.bench.fleet import Sampler  # noqa: E402
from tests.bench.peers import add_step, apply_update, to_langchain  # noqa: E402
from tests.support.chat_models import fake_chat_openai  # noqa: E402
from tests.support.fake_provider import (  # noqa: E402
    Behaviour,
    PrefixCache,
    RemoteFake,
    fake_provider_process,
    request_segments,
)
from tests.support.services import flush_redis, reset_database  # noqa: E402
from tests.support.stack import Stack  # noqa: E402
from worker.compaction.policy import DEFAULT_INDEX_MAX_TOKENS  # noqa: E402
from worker.settings import load_config  # noqa: E402

AGENT_MODEL = "fake-gpt"
SUMMARY_MODEL = "fake-mini"
FAKE_KEY = "sk-fake-test-key"
# Marks the agent's requests in the fake's log: every other request there is a summary call.
AGENT_HEADER = "x-compactd-bench"
AGENT_ANSWER = "(the transcript's next step follows)"
SIDES = ("langchain", "merge", "recallable")
LAYOUTS = {"merge": None, "recallable": "recallable"}  # summarization.layout per compactd side
PRICE_MODEL = "gpt-4.1"
PRICES = {"input": 2.00, "cached_input": 0.50, "output": 8.00}  # USD per 1M tokens
# An agent call and a summary call take the same time by default: both are mostly their
# output, a few hundred tokens each.
THINK_S = LATENCY_S = 0.1
QUICK_THINK_S = QUICK_LATENCY_S = 0.02
DRAIN_S = 120.0
DRAIN_POLL_S = 0.5
IDLE_SAMPLES = 3
COUNTS = PrefixCache()  # the fake's own per-segment counting, memoized


# ----------------------------------------------------------------------------------- tallies


def compaction_uncached(input_tokens: int, cached_tokens: int, new_tokens: int, *,
                        extends_previous: bool) -> int:
    """The uncached tokens a request re-sent because a compaction changed the prefix it shared
    with the session's previous request (see the module docstring)."""
    if extends_previous:
        return 0
    return max(0, input_tokens - cached_tokens - new_tokens)


@dataclass
class Tally:
    """One session's requests, as the fake reported them."""

    requests: int = 0
    input_tokens: int = 0
    cached_tokens: int = 0
    compaction_requests: int = 0
    compaction_uncached: int = 0
    final_context: int = 0
    overflows: int = 0
    compactions: int = 0
    pickups: int = 0

    def report(self) -> dict[str, int]:
        return {"requests": self.requests, "agent_input_tokens": self.input_tokens,
                "agent_cached_tokens": self.cached_tokens,
                "agent_uncached_tokens": self.input_tokens - self.cached_tokens,
                "compaction_requests": self.compaction_requests,
                "compaction_uncached_tokens": self.compaction_uncached,
                "final_context_tokens": self.final_context, "overflows": self.overflows,
                "compactions": self.compactions, "pickups": self.pickups}


class Agent:
    """One session's model calls through the openai SDK, with the session's cache key."""

    def __init__(self, sdk: AsyncOpenAI, cache_key: str, window: int) -> None:
        self.sdk = sdk
        self.cache_key = cache_key
        self.window = window
        self.previous: list[dict[str, Any]] | None = None
        self.tally = Tally()
        self.counter = counter_for(AGENT_MODEL)

    async def call(self, messages: list[dict[str, Any]], new: int) -> None:
        """Send ``messages``, of which the last ``new`` are the step's own."""
        # The SDK's own POST with the body as chat.completions.create sends it: create() walks
        # every message of the request to transform it, which would dominate the run time.
        done = await self.sdk.post("/chat/completions", cast_to=ChatCompletion, body={
            "model": AGENT_MODEL, "messages": messages, "max_tokens": 16,
            "prompt_cache_key": self.cache_key})
        usage = done.usage
        assert usage is not None and usage.prompt_tokens_details is not None
        prompt, cached = usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens or 0
        extends = self.previous is None or messages[:len(self.previous)] == self.previous
        step_tokens = sum(COUNTS.count(request_segments(
            "openai", {"messages": messages[len(messages) - new:]}), self.counter))
        t = self.tally
        t.requests += 1
        t.input_tokens += prompt
        t.cached_tokens += cached
        t.compaction_requests += not extends
        t.compaction_uncached += compaction_uncached(prompt, cached, step_tokens,
                                                     extends_previous=extends)
        t.final_context = prompt
        t.overflows += prompt > self.window
        self.previous = list(messages)


def agent_sdk(fake_url: str) -> AsyncOpenAI:
    return AsyncOpenAI(api_key=FAKE_KEY, base_url=f"{fake_url}/v1", max_retries=0,
                       timeout=120, default_headers={AGENT_HEADER: "agent"})


@dataclass(frozen=True)
class Usage:
    calls: int = 0
    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0


def summarizer_usage(records: Iterable[dict[str, Any]]) -> Usage:
    """The summary calls in the fake's log: every answered request not the agent's."""
    calls = [r for r in records if AGENT_HEADER not in r["headers"] and r["status"] == 200]
    return Usage(len(calls), sum(r["input_tokens"] or 0 for r in calls),
                 sum(r["cached_tokens"] or 0 for r in calls),
                 sum(r["output_tokens"] or 0 for r in calls))


def cost_usd(uncached: int, cached: int, output: int) -> float:
    return (uncached * PRICES["input"] + cached * PRICES["cached_input"]
            + output * PRICES["output"]) / 1e6


def side_report(tallies: dict[str, Tally], summary: Usage, seconds: float) -> dict[str, Any]:
    total = Tally()
    for tally in tallies.values():
        for f in dataclasses.fields(Tally):
            setattr(total, f.name, getattr(total, f.name) + getattr(tally, f.name))
    out: dict[str, Any] = total.report()
    agent_cost = cost_usd(total.input_tokens - total.cached_tokens, total.cached_tokens, 0)
    summary_cost = cost_usd(summary.input_tokens - summary.cached_tokens,
                            summary.cached_tokens, summary.output_tokens)
    out.update({
        "summarizer_calls": summary.calls, "summarizer_input_tokens": summary.input_tokens,
        "summarizer_cached_tokens": summary.cached_tokens,
        "summarizer_output_tokens": summary.output_tokens,
        "cost_usd": round(agent_cost + summary_cost, 4),
        "agent_cost_usd": round(agent_cost, 4), "summarizer_cost_usd": round(summary_cost, 4),
        "seconds": round(seconds, 1),
        "sessions": {name: t.report() for name, t in tallies.items()},
    })
    return out


# ------------------------------------------------------------------------------ the sides


def script_agent(fake: RemoteFake, think_s: float) -> None:
    """A fresh log and cache, and the agent's answers after its think time (the summary model
    keeps the fake's own latency)."""
    fake.reset()
    fake.script(Behaviour(model=AGENT_MODEL, output="text", text=AGENT_ANSWER,
                          latency_s=think_s, times=-1))


async def langchain_session(session: Session, agent: Agent, args: argparse.Namespace,
                            fake_url: str) -> None:
    model = fake_chat_openai(f"{fake_url}/v1", SUMMARY_MODEL, api_key=FAKE_KEY, max_retries=0)
    middleware: SummarizationMiddleware[Any, Any] = SummarizationMiddleware(
        model=model, trigger=("tokens", args.trigger), keep=("messages", args.keep),
        token_counter=LCCounter(), trim_tokens_to_summarize=args.trim)
    state: list[AnyMessage] = []
    n = 0
    for step in session.steps:
        ids = [f"m{n + i + 1}" for i in range(len(step))]
        n += len(step)
        state = add_step(state, to_langchain([wire(m) for m in step], ids=ids))
        update = await middleware.abefore_model({"messages": state}, None)  # type: ignore[arg-type]
        if update is not None:
            agent.tally.compactions += 1
            state = apply_update(state, update)
        # The step's messages still in the state (a keep shorter than the step cuts into it).
        own = sum(1 for m in state if m.id in ids)
        await agent.call(session.system + openai_wire(state), own)


async def run_langchain(sessions: Sequence[Session], args: argparse.Namespace,
                        fake_url: str) -> dict[str, Tally]:
    async with agent_sdk(fake_url) as sdk:
        agents = {s.name: Agent(sdk, f"langchain:{s.name}", args.window) for s in sessions}
        await asyncio.gather(*(langchain_session(s, agents[s.name], args, fake_url)
                               for s in sessions))
    return {name: a.tally for name, a in agents.items()}


def compactd_policy(args: argparse.Namespace, layout: str | None) -> dict[str, Any]:
    policy: dict[str, Any] = {
        "model_name": SUMMARY_MODEL,
        "trigger": {"type": "tokens", "value": args.trigger},
        "keep": {"type": "messages", "value": args.keep},
        "trim_tokens_to_summarize": args.trim}
    if layout is not None:
        policy["layout"] = layout
    if layout == "recallable":
        # The policy refuses an index cap the index checkpoints alone could fire the trigger
        # with; the default cap stays where the trigger leaves room for it (a quarter, so the
        # state and the kept tail fit beside the index), and a small trigger gets its quarter.
        policy["index_max_tokens"] = min(DEFAULT_INDEX_MAX_TOKENS, args.trigger // 4)
    return policy


async def compactd_session(client: CompactdClient, session: Session, agent: Agent) -> None:
    # No envelope: the trigger counts the conversation only, as LangChain's does.
    handle = await client.create_session(session.name, run_model=AGENT_MODEL,
                                         context_window=agent.window)
    held: list[dict[str, Any]] = []
    for step in session.steps:
        messages = parse_messages([wire(m) for m in step])
        await handle.append(messages)
        # The runtime holds its steps as the surface renders them, so a re-read surface only
        # differs from what it held where a compaction changed it.
        held = [*held, *(wire(m.to_openai()) for m in messages)]
        if await handle.poll() is not None:
            held = [wire(m) for m in await handle.surface()]
            agent.tally.pickups += 1
        await agent.call(session.system + held, len(messages))


async def drive_compactd(stack: Stack, sessions: Sequence[Session], args: argparse.Namespace,
                         fake_url: str) -> dict[str, Tally]:
    config = load_config(env=stack.env)
    async with CompactdClient(config) as client, agent_sdk(fake_url) as sdk:
        agents = {s.name: Agent(sdk, f"{stack.home.name}:{s.name}", args.window)
                  for s in sessions}
        await asyncio.gather(*(compactd_session(client, s, agents[s.name]) for s in sessions))
        await client.drain()
        await drain(stack)
        runs = await client.store.recent_runs(limit=1_000_000)
    for run in runs:
        if run.status == RunStatus.COMMITTED and run.session_id in agents:
            agents[run.session_id].tally.compactions += 1
    return {name: a.tally for name, a in agents.items()}


async def drain(stack: Stack) -> bool:
    """Wait until the worker has nothing left: no queued task, live lease or pending signal on
    ``IDLE_SAMPLES`` samples in a row (the summary calls of late runs are costs too)."""
    sampler = Sampler(stack.database_url, stack.redis_url, [])
    idle = 0
    deadline = time.monotonic() + DRAIN_S
    try:
        while time.monotonic() < deadline:
            s = await sampler.sample()
            idle = 0 if (s.urgent or s.pressure or s.leases or s.oldest_signal_s) else idle + 1
            if idle >= IDLE_SAMPLES:
                return True
            await asyncio.sleep(DRAIN_POLL_S)
        return False
    finally:
        await sampler.close()


def run_compactd(side: str, sessions: Sequence[Session], args: argparse.Namespace,
                 fake: RemoteFake, home: Path) -> dict[str, Any] | str:
    """The side's report, or why it is not available (the policy refused its layout)."""
    stack = Stack(args.database_url, args.redis_url, home / side, fake_url=fake.url,
                  summarization=compactd_policy(args, LAYOUTS[side]),
                  worker={"concurrency": args.concurrency})
    try:
        # What the worker reads at start: a layout the policy does not know is refused here.
        load_config(env=stack.env)
    except ConfigError as exc:
        return str(exc)
    asyncio.run(reset_database(args.database_url))
    flush_redis(args.redis_url)
    script_agent(fake, args.think)
    started = time.perf_counter()
    with stack:
        stack.start_worker("w1", concurrency=args.concurrency, ready_timeout=90)
        tallies = asyncio.run(drive_compactd(stack, sessions, args, fake.url))
    seconds = time.perf_counter() - started
    return side_report(tallies, summarizer_usage(fake.requests()), seconds)


# ------------------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    count, seconds = cli_types.positive_int, cli_types.seconds
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--sessions", help="comma-separated session names (default: all)")
    parser.add_argument("--latency", type=seconds, default=None,
                        help=f"seconds the fake takes per summary call (default {LATENCY_S:g})")
    parser.add_argument("--think", type=seconds, default=None,
                        help=f"seconds the fake takes per agent call (default {THINK_S:g})")
    parser.add_argument("--trigger", type=count, default=16_000, help="trigger, tokens")
    parser.add_argument("--keep", type=count, default=6, help="keep, messages")
    parser.add_argument("--trim", type=count, default=4_000,
                        help="summarizer input budget, tokens (both sides)")
    parser.add_argument("--window", type=count, default=128_000,
                        help="the run model's context window, tokens")
    parser.add_argument("--concurrency", type=count, default=4,
                        help="the compactd worker's threads")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS,
                        help="the corpus the long sessions are built from")
    source.add_argument("--transcripts", type=Path,
                        help="take every DIR/<group>/*.jsonl as a session as it is")
    parser.add_argument("--quick", action="store_true",
                        help=f"a smoke run: the smallest session, agent and summary calls of "
                        f"{QUICK_THINK_S:g} s (unless given)")
    parser.add_argument("--database-url", default=pg_url("cache_cost"),
                        help="PostgreSQL database to use (EMPTIED)")
    parser.add_argument("--redis-url", default=REDIS_URL, help="Redis database (FLUSHDB'd)")
    args = parser.parse_args(argv)
    if args.think is None:
        args.think = QUICK_THINK_S if args.quick else THINK_S
    if args.latency is None:
        args.latency = QUICK_LATENCY_S if args.quick else LATENCY_S
    root = args.transcripts or args.corpus
    if not root.is_dir() or not any(root.glob("*/*.jsonl")):
        flag = "--transcripts" if args.transcripts else "--corpus"
        parser.error(f"{flag}: no */*.jsonl transcripts under {root}")
    args.chosen = choose_sessions(parser, args)
    return args


def choose_sessions(parser: argparse.ArgumentParser, args: argparse.Namespace
                    ) -> list[Session]:
    available = (corpus_sessions(args.transcripts) if args.transcripts
                 else long_sessions(args.corpus))
    if not available:
        parser.error(f"--corpus: {args.corpus} has no folder long enough for a "
                     "30k-token session")
    chosen = available
    if args.sessions is not None:
        names = [n.strip() for n in args.sessions.split(",") if n.strip()]
        known = {s.name: s for s in available}
        unknown = [n for n in names if n not in known]
        if not names or unknown:
            parser.error(f"--sessions: unknown session {', '.join(unknown) or repr('')} "
                         f"(available: {', '.join(known)})")
        chosen = [known[n] for n in names]
    if args.quick:
        chosen = [min(chosen, key=lambda s: s.tokens)]
    return chosen


def config_report(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "trigger_tokens": args.trigger, "keep_messages": args.keep,
        "trim_tokens_to_summarize": args.trim, "window_tokens": args.window,
        "think_s": args.think, "summary_latency_s": args.latency,
        "worker_concurrency": args.concurrency, "agent_model": AGENT_MODEL,
        "summary_model": SUMMARY_MODEL, "token_counter": "o200k (compactd's, every side)",
        "compactd_render": "durable_context (the default)",
        "prices": {"model": PRICE_MODEL, "usd_per_million_tokens": PRICES},
    }


def print_report(report: dict[str, Any]) -> None:
    c = report["config"]
    print(f"trigger {c['trigger_tokens']} tokens, keep {c['keep_messages']} messages, trim "
          f"{c['trim_tokens_to_summarize']} tokens, window {c['window_tokens']} tokens; agent "
          f"call {c['think_s']:g} s, summary call {c['summary_latency_s']:g} s; prices: "
          f"{PRICE_MODEL} ${PRICES['input']:.2f} / ${PRICES['cached_input']:.2f} cached / "
          f"${PRICES['output']:.2f} output per 1M tokens")
    keys = ["agent_input_tokens", "agent_uncached_tokens", "compaction_uncached_tokens",
            "summarizer_input_tokens", "summarizer_output_tokens", "final_context_tokens",
            "compactions", "cost_usd", "seconds"]
    rows = [[side, *[report[side][k] for k in keys]] for side in SIDES if report[side]]
    print_table(["side", "agent in", "uncached", "compaction uncached", "summarizer in",
                 "summarizer out", "final context", "compactions", "cost $", "s"], rows)
    for side, reason in report["not_available"].items():
        print(f"{side}: not available ({reason})")


def goal(report: dict[str, Any]) -> dict[str, Any] | None:
    """Issue 17's goal: recallable re-sends at least 30% fewer uncached tokens than merge
    because of compaction, with a final context no more than 10% larger."""
    merge, recallable = report["merge"], report["recallable"]
    if not merge or not recallable or not merge["compaction_uncached_tokens"]:
        return None
    fewer = 1 - recallable["compaction_uncached_tokens"] / merge["compaction_uncached_tokens"]
    larger = recallable["final_context_tokens"] / merge["final_context_tokens"] - 1
    return {"compaction_uncached_reduction": round(fewer, 4),
            "final_context_growth": round(larger, 4), "met": fewer >= 0.3 and larger <= 0.1}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    sessions: list[Session] = args.chosen
    info = machine()
    print(f"machine: {machine_line(info)}")
    print("sessions: " + ", ".join(f"{s.name} ({s.tokens} tokens, {len(s.steps)} steps)"
                                   for s in sessions), flush=True)
    report: dict[str, Any] = {"machine": info, "config": config_report(args),
                              "sessions": [{"name": s.name, "tokens": s.tokens,
                                            "steps": len(s.steps)} for s in sessions],
                              "not_available": {}}
    started = time.perf_counter()
    with fake_provider_process(args.latency, prefix_cache=True) as fake_url, \
            tempfile.TemporaryDirectory(prefix="compactd-cache-cost-") as tmp:
        fake = RemoteFake(fake_url)
        # In-band, nothing LangChain does depends on time: its agent calls answer at once.
        script_agent(fake, 0.0)
        t0 = time.perf_counter()
        tallies = asyncio.run(run_langchain(sessions, args, fake_url))
        report["langchain"] = side_report(tallies, summarizer_usage(fake.requests()),
                                          time.perf_counter() - t0)
        print(f"langchain: {report['langchain']['seconds']} s", file=sys.stderr, flush=True)
        for side in ("merge", "recallable"):
            result = run_compactd(side, sessions, args, fake, Path(tmp))
            if isinstance(result, str):
                report[side] = None
                report["not_available"][side] = result
            else:
                report[side] = result
                print(f"{side}: {result['seconds']} s", file=sys.stderr, flush=True)
    report["goal"] = goal(report)
    report["seconds"] = round(time.perf_counter() - started, 1)
    print_report(report)
    write_json(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
