"""What compaction costs at the provider's prefix cache: an agent loop over the long sessions.

    python tests/bench/cache_cost.py --json OUT [--sessions NAME,...] [--profiles fast,realistic]
        [--latency S --think S] [--triggers 16000[,8000,...]] [--keep 6] [--trim 4000]
        [--summary-tokens 400] [--window 128000] [--concurrency 4] [--sides langchain,before,after]
        [--corpus DIR | --transcripts DIR] [--no-usage] [--quick]

Sessions: the long concatenations of 30k-150k conversation tokens that ``tests/bench/corpus.py``
builds from ``--corpus`` (default ``../shared/corpus`` beside the repository), or with
``--transcripts DIR`` every ``DIR/<group>/*.jsonl`` as it is; ``--sessions`` picks some by name.
Each session is replayed step by step (an assistant message with what follows it up to the next
one, as a runtime appends it). After every step the agent sends its model request to the agent's
fake provider (``tests/support/fake_provider.py``, a process of its own, prefix cache on) over
HTTP through the official openai SDK, with a stable ``prompt_cache_key`` per session; the request
is the session's system prompt plus what the side would send. LangChain's summary calls go to a
second fake (``fake-mini``), which keeps their bodies; compactd's go where its run model is, the
agent's fake (the agent's cache, its summary calls' bodies kept), so what reached a summarizer
can be checked. A compactd session registers the agent's system prompt and cache key as its
envelope (its trigger raised by the envelope's tokens, so it still counts the conversation only).

Sides, all with the same trigger (tokens of the conversation, system prompt not counted), keep
(``--keep`` messages), summarizer input budget (``--trim``), run-model window (``--window``),
o200k token counter, and summaries of the same size: the summary fake answers every summary call
with one fixed text of ``--summary-tokens`` tokens, so the sides differ by mechanism, not by how
much the fake chose to write:

* ``langchain``: the real ``SummarizationMiddleware`` (LangChain 1.x) in-band, as it is: the step
  joins the state with LangGraph's ``add_messages``, ``abefore_model`` runs (its model is
  ``ChatOpenAI`` pointed at the summary fake) and its update is applied; the request is the
  state. Its agent calls answer at once (nothing it does depends on time); the seconds its
  summary calls take are its agent's stall.
* ``before``: compactd with every switch of issue 27's mechanisms off, a REAL worker
  (``celery -A compactd.worker.app worker``, PostgreSQL, Redis) compacting in the background. The
  agent appends the step through the runtime client, polls, and re-reads the surface only when the
  version moved; its request is the surface it holds. It never waits for a compaction.
* ``after``: the same with compactd's defaults (``COMPACTD_SIDES``). While the two sides set the
  same policy, ``after`` is not run again: its report is ``before``'s, marked ``same_as``.
* ``recallable`` (on request): ``summarization.layout: recallable``.

Usage (the default; ``--no-usage`` turns it off): both runtimes see the provider's usage of the
agent's last call, as each documents: compactd's reports it after the call (``report_usage``, as
``ops/examples/agent_loop.py`` does), so its pressure counts the provider's tokens; LangChain's
step carries it on its first assistant message (the model's response to that call:
``usage_metadata``, ``model_provider``), which ``SummarizationMiddleware`` fires on by default
(LangChain 1.x: a tokens trigger fires when the last AI message's reported ``total_tokens``
reach it, and its default counter scales by them). A real runtime's chat model puts that usage
on every response, so this is the count both sides see in use. Both report the conversation's
share (the request's input less the system prompt), since the trigger counts the conversation
only. With ``--no-usage``, both sides fire on compactd's o200k count of the messages, which on
tau-bench is 18% under the provider's (the fake's count of the request, JSON framing included),
while ``steps_over_trigger`` counts the provider's.

Profiles (``--profiles``; ``--think`` and ``--latency`` together give one of your own): ``fast``
(today's: agent call and summary call 0.1 s each, so the worker's own overheads, queueing, claims,
commits, the agent's poll, weigh as much as a step) and ``realistic`` (both 0.5 s: an agent step
takes about as long as a summary call, as with real models, and the overheads weigh less).
``--triggers`` runs every side at each trigger: the frontier of cost against stall (the
README's: ``--triggers 4000,6000,8000,16000,32000``).

Cache rules, applied to the same requests:

* ``openai``: the fake's own: the longest prefix shared with an earlier request of the session,
  in 128-token blocks past the first 1,024, cached reads at the cached price, no write charge.
* ``anthropic``: computed here (:class:`AnthropicCache`): explicit breakpoints (one after the
  system prompt, one on the request's last message, where agent runtimes put them), a hit only on
  an earlier breakpoint's prefix within 20 blocks (messages here) before a breakpoint, entries
  living 5 minutes from their last use, nothing cached under 1,024 tokens; reads at 0.1x input,
  writes (everything after the hit up to the last breakpoint) at 1.25x. A compactd summary call
  that shares the agent's cache (``summarization.share_cache``) begins with the agent's request
  and its breakpoints, so it reads that request's entry: under this rule it is counted as reading
  what the fake found cached; every other summary call sets no breakpoints and reads nothing.

Per side, trigger and profile (sums over sessions; ``sessions`` has them per session), and per
rule under ``rules``:

* ``agent_input_tokens``: the agent's requests' input tokens; ``final_context_tokens``: the input
  tokens of each session's last request; ``steps_over_trigger``: requests whose conversation was
  over the trigger; ``overflows``: requests over the window.
* ``coverage``: of the transcript's messages a compaction took out of the agent's request
  (weighted by their tokens; messages of under 40 characters, and checkpoints, are not judged),
  the share whose text reached a summary call's input (or is still in the final request, as a
  pruned result is). A range the local summarizer wrote reached no model call and counts as
  not covered.
* ``stall_s``: seconds the agent waited on compactions: LangChain's ``abefore_model`` calls that
  summarized; zero for compactd, whose agent never waits.
* per rule: ``cost_usd`` (agent input, summarizer input and output, at ``PRICES``; the agent's own
  output is the transcript's on every side and is left out), ``agent_cached_tokens``,
  ``agent_cache_write_tokens``, ``agent_uncached_tokens``, ``compaction_uncached_tokens`` (over
  the requests that do not extend the previous one, the uncached tokens less the step's own new
  messages) and ``compaction_uncached_per_compaction``, ``summarizer_cached_tokens``.
* ``summarizer_calls``, ``summarizer_input_tokens``, ``summarizer_output_tokens``,
  ``compactions`` (LangChain updates applied, compactd runs committed), ``pickups``.
* ``resent``: what the requests that did not extend the previous one re-sent, on average
  (messages a request, tokens a message) beside the tokens a message of the step each added;
  per session, ``breaks`` lists each such request (:func:`prefix_break`). In band the
  compaction comes on the step that crossed the trigger, which its request sends as its own;
  out of band the pickup comes steps later, and that step is among the re-sent.
* ``run_outcomes`` (compactd sides): the runs by how they ended (``committed``,
  ``nothing_to_do``, ...), summed over the sessions and per session: a trigger below the kept
  tail shows here as runs that changed nothing.
* ``run_tails`` (compactd sides): per committed run, on average, the messages it kept at its
  read and those that arrived while it ran (messages a run, tokens a message), beside the
  tokens a message of everything appended; per session, ``runs`` lists each (:func:`run_tail`).

A compactd side drains (no queued task, lease or pending signal) before it is counted: late
runs' summary calls are costs too. Databases: ``--database-url`` (default
``compactd_bench_cache_cost`` on ``COMPACTD_BENCH_DATABASE_URL``; created, migrated and EMPTIED
for each compactd run) and ``--redis-url`` (default ``COMPACTD_BENCH_REDIS_URL``; FLUSHDB'd).
Every process it starts is stopped when it ends.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime as dt
import hashlib
import html
import json
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from langchain.agents.middleware import SummarizationMiddleware  # noqa: E402
from langchain_core.messages import AIMessage, AnyMessage  # noqa: E402
from openai import AsyncOpenAI  # noqa: E402
from openai.types.chat import ChatCompletion  # noqa: E402

from compactd.scheduler import args as cli_types  # noqa: E402
from compactd.scheduler.client import CompactdClient, parse_messages  # noqa: E402
from compactd.storage.errors import ConfigError  # noqa: E402
from compactd.storage.kinds import RunStatus  # noqa: E402
from compactd.storage.store import envelope_tokens  # noqa: E402
from compactd.storage.tokens import counter_for  # noqa: E402
from compactd.worker.compaction.policy import DEFAULT_INDEX_MAX_TOKENS  # noqa: E402
from compactd.worker.compaction.prompt import SUMMARY_RULES  # noqa: E402
from compactd.worker.cost import Billed, Price, cost_usd  # noqa: E402
from compactd.worker.settings import load_config  # noqa: E402
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
    SECTIONS,
    Behaviour,
    PrefixCache,
    RemoteFake,
    fake_provider_process,
    request_segments,
)
from tests.support.services import flush_redis, reset_database  # noqa: E402
from tests.support.stack import Stack, fake_models  # noqa: E402

AGENT_MODEL = "fake-gpt"
SUMMARY_MODEL = "fake-mini"
FAKE_KEY = "sk-fake-test-key"
# Marks the agent's requests in the fake's log.
AGENT_HEADER = "x-compactd-bench"
AGENT_ANSWER = "(the transcript's next step follows)"
SIDES = ("langchain", "before", "after", "recallable")
DEFAULT_SIDES = ("langchain", "before", "after")
# The policy keys each compactd side sets beyond the shared ones. "before" turns every switch of
# issue 27's mechanisms off, "after" leaves compactd's defaults; a mechanism adds its switch to
# "before" (off) when it lands, and the two sides then differ by it.
COMPACTD_SIDES: dict[str, dict[str, Any]] = {
    "before": {"lead": 0, "lead_steps": False, "keep_at": "claim", "clear_at_least": 0,
               "share_cache": False},
    "after": {},
    # Its index calls have an instruction of their own: on the summary fake, as before.
    "recallable": {"layout": "recallable", "model_name": SUMMARY_MODEL},
}
CACHE_RULES = ("openai", "anthropic")
# USD per million tokens: a model of each provider whose cache rule is applied. List prices as
# last known to the author (not re-read: no network where this ran); the README's table names them.
PRICES: dict[str, tuple[str, Price]] = {
    "openai": ("gpt-4.1", Price(input=2.00, cached_input=0.50, cache_write=2.00, output=8.00)),
    "anthropic": ("claude-sonnet-4.5", Price(input=3.00, cached_input=0.30, cache_write=3.75,
                                             output=15.00)),
}
# (agent call, summary call) seconds.
PROFILES: dict[str, tuple[float, float]] = {"fast": (0.1, 0.1), "realistic": (0.5, 0.5)}
QUICK_THINK_S = QUICK_LATENCY_S = 0.02
SUMMARY_TOKENS = 400
DRAIN_S = 120.0
DRAIN_POLL_S = 0.5
IDLE_SAMPLES = 3
# A removed message shorter than this is not judged for coverage ("ok", an empty assistant
# turn): its text could be found anywhere.
COVERAGE_MIN_CHARS = 40
COVERAGE_SNIPPET_CHARS = 300
COUNTS = PrefixCache()  # the fake's own per-segment counting, memoized
# Text every compactd summary instruction holds and no agent request does: how the agent's fake
# tells the summary calls compactd's run model makes from the agent's own requests.
SUMMARY_MARK = SUMMARY_RULES.splitlines()[0]


# ----------------------------------------------------------------------------- cache rules


class AnthropicCache:
    """Anthropic's prompt cache as one session's agent meets it (see the module docstring).
    ``keys[i]`` names the prefix of the first ``i + 1`` messages; ``breakpoints`` are prefix
    lengths in messages."""

    TTL_S = 300.0
    LOOKBACK_BLOCKS = 20
    MIN_TOKENS = 1024

    def __init__(self) -> None:
        self.entries: dict[str, float] = {}  # prefix key -> expiry

    def request(self, keys: Sequence[str], sizes: Sequence[int], breakpoints: Iterable[int],
                now: float) -> tuple[int, int]:
        """(cached, written) tokens of one request."""
        prefix = [0]
        for size in sizes:
            prefix.append(prefix[-1] + size)
        marks = sorted({b for b in breakpoints if 0 < b <= len(keys)})
        hit = 0
        for mark in marks:
            for length in range(mark, max(0, mark - self.LOOKBACK_BLOCKS), -1):
                expiry = self.entries.get(keys[length - 1])
                if expiry is not None and expiry >= now:
                    if prefix[length] > prefix[hit]:
                        hit = length
                    break
        if hit:
            self.entries[keys[hit - 1]] = now + self.TTL_S
        cached = prefix[hit] if prefix[hit] >= self.MIN_TOKENS else 0
        last = marks[-1] if marks else 0
        if not last or prefix[last] < self.MIN_TOKENS:
            return cached, 0
        for mark in marks:
            if prefix[mark] >= self.MIN_TOKENS:
                self.entries[keys[mark - 1]] = now + self.TTL_S
        return cached, max(0, prefix[last] - cached)


def prefix_keys(messages: Sequence[dict[str, Any]]) -> list[str]:
    digest = hashlib.sha1(usedforsecurity=False)
    keys = []
    for m in messages:
        digest.update(json.dumps(m, sort_keys=True).encode())
        keys.append(digest.hexdigest())
    return keys


def fixed_summary(tokens: int) -> str:
    """A summary of about ``tokens`` o200k tokens in the eight sections, the same size on every
    side. Its first line names the call that wrote it (the fake's request id): two summaries a
    model writes are never byte-identical, so a new checkpoint is not served from the cache that
    held the one it replaces."""
    counter = counter_for(AGENT_MODEL)
    filler = "the work so far, its files, errors and decisions, carried forward"
    head = "Summary {request}\n"
    out = ""
    n = 0
    while not out or counter.count_text(out.replace("{request}", "req_fake_000000")) < tokens:
        n += 1
        out = head + "\n".join(f"## {name}\n- " + "; ".join([filler] * n) for name in SECTIONS)
    return out


# ----------------------------------------------------------------------------------- tallies


def compaction_uncached(input_tokens: int, cached_tokens: int, new_tokens: int, *,
                        extends_previous: bool) -> int:
    """The uncached tokens a request re-sent because a compaction changed the prefix it shared
    with the session's previous request (see the module docstring)."""
    if extends_previous:
        return 0
    return max(0, input_tokens - cached_tokens - new_tokens)


@dataclass
class RuleTally:
    """The agent's requests under one cache rule."""

    cached: int = 0
    written: int = 0
    compaction_uncached: int = 0


@dataclass
class Tally:
    """One session's requests."""

    requests: int = 0
    input_tokens: int = 0
    compaction_requests: int = 0
    final_context: int = 0
    overflows: int = 0
    over_trigger: int = 0
    compactions: int = 0
    pickups: int = 0
    stall_s: float = 0.0
    rules: dict[str, RuleTally] = field(
        default_factory=lambda: {rule: RuleTally() for rule in CACHE_RULES})

    def add(self, other: Tally) -> None:
        for f in dataclasses.fields(Tally):
            if f.name != "rules":
                setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        for rule, mine in self.rules.items():
            theirs = other.rules[rule]
            mine.cached += theirs.cached
            mine.written += theirs.written
            mine.compaction_uncached += theirs.compaction_uncached

    def report(self) -> dict[str, Any]:
        return {"requests": self.requests, "agent_input_tokens": self.input_tokens,
                "compaction_requests": self.compaction_requests,
                "final_context_tokens": self.final_context, "overflows": self.overflows,
                "steps_over_trigger": self.over_trigger, "compactions": self.compactions,
                "pickups": self.pickups, "stall_s": round(self.stall_s, 2),
                "rules": {rule: {"agent_cached_tokens": t.cached,
                                 "agent_cache_write_tokens": t.written,
                                 "agent_uncached_tokens": self.input_tokens - t.cached,
                                 "compaction_uncached_tokens": t.compaction_uncached}
                          for rule, t in self.rules.items()}}


def text_of(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, list):
        return "\n".join(str(b.get("text", "")) for b in content if isinstance(b, dict))
    return content if isinstance(content, str) else ""


class Agent:
    """One session's model calls through the openai SDK, with the session's cache key."""

    @property
    def conversation_tokens(self) -> int:
        """The provider's count of the last request less its system prompt."""
        return self.tally.final_context - sum(self.previous_sizes[:self.system])

    def __init__(self, sdk: AsyncOpenAI, cache_key: str, window: int, trigger: int,
                 system: int, originals: frozenset[str] = frozenset()) -> None:
        self.sdk = sdk
        self.cache_key = cache_key
        self.window = window
        self.trigger = trigger
        self.system = system  # leading system messages: not counted against the trigger
        self.previous: list[dict[str, Any]] | None = None
        self.previous_sizes: list[int] = []
        self.tally = Tally()
        self.counter = counter_for(AGENT_MODEL)
        self.anthropic = AnthropicCache()
        self.removed: list[tuple[str, int]] = []  # (text, tokens) compactions took out
        # The transcript's own message texts: only those are judged for coverage (a checkpoint
        # a later compaction replaces reaches the summarizer as its previous summary, not as
        # it was rendered).
        self.originals = originals
        # Per request that did not extend the previous one: what it re-sent (prefix_break).
        self.breaks: list[dict[str, int]] = []
        # A compactd session's appended messages, and per committed run what it kept at its
        # read and what arrived while it ran (run_tail).
        self.appended: list[Appended] = []
        self.runs: list[dict[str, int]] = []
        # A compactd session's runs by how they ended (committed, nothing_to_do, ...): what a
        # trigger the keep cannot get under costs in runs that change nothing.
        self.outcomes: dict[str, int] = {}
        # Per request, the conversation's tokens as the provider counted them (negative for a
        # request that did not extend the previous one): where each side's context went.
        self.trace: list[int] = []

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
        sizes = COUNTS.count(request_segments("openai", {"messages": messages}), self.counter)
        step_tokens = sum(sizes[len(sizes) - new:])
        a_cached, a_written = self.anthropic.request(
            prefix_keys(messages), sizes, (self.system, len(messages)), time.monotonic())
        t = self.tally
        t.requests += 1
        t.input_tokens += prompt
        t.compaction_requests += not extends
        for rule, hit, written in (("openai", cached, 0), ("anthropic", a_cached, a_written)):
            r = t.rules[rule]
            r.cached += hit
            r.written += written
            r.compaction_uncached += compaction_uncached(prompt, hit, step_tokens,
                                                         extends_previous=extends)
        t.final_context = prompt
        t.overflows += prompt > self.window
        t.over_trigger += sum(sizes[self.system:]) > self.trigger
        self.trace.append(sum(sizes[self.system:]) * (1 if extends else -1))
        if not extends and self.previous is not None:
            self.breaks.append(prefix_break(self.previous, messages, sizes, new, self.system))
            kept = {json.dumps(m, sort_keys=True) for m in messages}
            self.removed.extend(
                (text_of(m), size) for m, size in zip(self.previous, self.previous_sizes,
                                                      strict=True)
                if json.dumps(m, sort_keys=True) not in kept
                and text_of(m).strip() in self.originals)
        self.previous = list(messages)
        self.previous_sizes = sizes


def prefix_break(previous: Sequence[dict[str, Any]], messages: Sequence[dict[str, Any]],
                 sizes: Sequence[int], new: int, system: int) -> dict[str, int]:
    """Where a request left the previous one, and what it sent after that: the messages it
    re-sent (from the first changed one, a new checkpoint or summary, up to the step) and the
    step's own. ``break_at`` counts conversation messages; above 0, the request began with
    messages of the previous one after the system prompt (a summary identical to the last)."""
    at = next((i for i, (a, b) in enumerate(zip(previous, messages, strict=False)) if a != b),
              min(len(previous), len(messages)))
    step_from = max(at, len(messages) - new)
    return {"break_at": at - system, "resent_messages": step_from - at,
            "resent_tokens": sum(sizes[at:step_from]), "step_messages": len(messages) - step_from,
            "step_tokens": sum(sizes[step_from:])}


def resent_summary(breaks: Sequence[dict[str, int]]) -> dict[str, Any]:
    """What the requests after a compaction re-sent, on average: messages per request and their
    tokens per message, beside the tokens per message of the step each request added (which
    it sends uncached anyway). An in-band compaction happens on the step that crossed the
    trigger, so that step is its request's own; an out-of-band pickup comes steps later."""
    n = len(breaks)
    resent = sum(b["resent_messages"] for b in breaks)
    step = sum(b["step_messages"] for b in breaks)
    return {"requests": n,
            "messages_per_request": round(resent / n, 2) if n else None,
            "tokens_per_message": round(sum(b["resent_tokens"] for b in breaks) / resent)
            if resent else None,
            "step_tokens_per_message": round(sum(b["step_tokens"] for b in breaks) / step)
            if step else None,
            "summary_reused": sum(1 for b in breaks if b["break_at"] > 0)}


@dataclass(frozen=True)
class Appended:
    """A message a compactd session's agent appended: its seq, when, its tokens."""

    seq: int
    at: dt.datetime
    tokens: int


def run_tail(range_seqs: Iterable[int], started_at: dt.datetime, finished_at: dt.datetime,
             appended: Sequence[Appended]) -> dict[str, int]:
    """What a committed run left after its range: the messages it kept at its read (after the
    last message it replaced, appended by its claim, which the read follows by milliseconds)
    and those appended while it ran. Both are re-sent at the pickup, with what the agent
    appends before it."""
    replaced = set(range_seqs)
    last = max((a.seq for a in appended if a.seq in replaced), default=0)
    kept = [a for a in appended if a.seq > last and a.at <= started_at]
    arrived = [a for a in appended if started_at < a.at <= finished_at]
    return {"kept_at_read_messages": len(kept),
            "kept_at_read_tokens": sum(a.tokens for a in kept),
            "arrived_messages": len(arrived), "arrived_tokens": sum(a.tokens for a in arrived)}


def tail_summary(agents: Iterable[Agent]) -> dict[str, Any] | None:
    """Per committed run, on average: what it kept at its read and what arrived while it ran,
    in messages a run and tokens a message, beside the tokens a message of all appended."""
    runs = [r for a in agents for r in a.runs]
    appended = [m for a in agents for m in a.appended]
    if not runs or not appended:
        return None

    def per(messages: str, tokens: str) -> dict[str, float | None]:
        count = sum(r[messages] for r in runs)
        return {"messages_per_run": round(count / len(runs), 2),
                "tokens_per_message": round(sum(r[tokens] for r in runs) / count)
                if count else None}

    return {"runs": len(runs),
            "kept_at_read": per("kept_at_read_messages", "kept_at_read_tokens"),
            "arrived_during_run": per("arrived_messages", "arrived_tokens"),
            "appended_tokens_per_message": round(
                sum(m.tokens for m in appended) / len(appended))}


def run_outcomes(agents: Iterable[Agent]) -> dict[str, int]:
    """A compactd side's runs by how they ended, over its sessions (empty in band)."""
    out: dict[str, int] = {}
    for agent in agents:
        for status, n in agent.outcomes.items():
            out[status] = out.get(status, 0) + n
    return dict(sorted(out.items()))


def agent_sdk(fake_url: str) -> AsyncOpenAI:
    return AsyncOpenAI(api_key=FAKE_KEY, base_url=f"{fake_url}/v1", max_retries=0,
                       timeout=120, default_headers={AGENT_HEADER: "agent"})


@dataclass(frozen=True)
class Usage:
    calls: int = 0
    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    shared_calls: int = 0  # calls that began with the agent's request (its cache key)
    shared_cached: int = 0


def summarizer_usage(records: Iterable[dict[str, Any]]) -> Usage:
    """The summary calls in the fakes' logs: every answered request not the agent's."""
    calls = [r for r in records if AGENT_HEADER not in r["headers"] and r["status"] == 200]
    shared = [r for r in calls if (r.get("body") or {}).get("prompt_cache_key")]
    return Usage(len(calls), sum(r["input_tokens"] or 0 for r in calls),
                 sum(r["cached_tokens"] or 0 for r in calls),
                 sum(r["output_tokens"] or 0 for r in calls), len(shared),
                 sum(r["cached_tokens"] or 0 for r in shared))


def summary_inputs(records: Iterable[dict[str, Any]]) -> str:
    """Every summary call's messages as one text, unescaped (compactd escapes what it frames)."""
    parts: list[str] = []
    for r in records:
        if AGENT_HEADER in r["headers"] or r["status"] != 200 or not r.get("body"):
            continue
        parts.extend(text_of(m) for m in r["body"].get("messages") or ())
    return html.unescape("\n".join(parts))


def coverage(removed: Iterable[tuple[str, int]], haystack: str) -> float | None:
    """The share (by tokens) of removed messages whose text is found in ``haystack``."""
    judged = covered = 0
    for text, tokens in removed:
        snippet = text.strip()[:COVERAGE_SNIPPET_CHARS]
        if len(snippet) < COVERAGE_MIN_CHARS:
            continue
        judged += tokens
        covered += tokens if snippet in haystack else 0
    return round(covered / judged, 4) if judged else None


def side_report(agents: dict[str, Agent], summary: Usage, seconds: float,
                inputs: str) -> dict[str, Any]:
    total = Tally()
    for agent in agents.values():
        total.add(agent.tally)
    out: dict[str, Any] = total.report()
    finals = "\n".join(text_of(m) for a in agents.values() for m in a.previous or ())
    out["coverage"] = coverage((r for a in agents.values() for r in a.removed),
                               inputs + "\n" + html.unescape(finals))
    for rule, rep in out["rules"].items():
        price = PRICES[rule][1]
        # A summary call that begins with the agent's request carries its breakpoints (system,
        # last message) and reads the entry that request wrote: under Anthropic's rule it reads
        # what the fake found cached. Other summary calls set none and read nothing there.
        s_cached = summary.cached_tokens if rule == "openai" else summary.shared_cached
        agent_usd = cost_usd(Billed(input=total.input_tokens, cached=rep["agent_cached_tokens"],
                                cache_write=rep["agent_cache_write_tokens"]), price)
        summarizer_usd = cost_usd(Billed(input=summary.input_tokens, cached=s_cached,
                                     output=summary.output_tokens), price)
        rep.update({"summarizer_cached_tokens": s_cached,
                    "compaction_uncached_per_compaction": round(
                        rep["compaction_uncached_tokens"] / max(1, total.compactions)),
                    "cost_usd": round(agent_usd + summarizer_usd, 4),
                    "agent_cost_usd": round(agent_usd, 4),
                    "summarizer_cost_usd": round(summarizer_usd, 4)})
    out.update({
        "summarizer_calls": summary.calls, "summarizer_shared_calls": summary.shared_calls,
        "summarizer_input_tokens": summary.input_tokens,
        "summarizer_output_tokens": summary.output_tokens,
        "cost_usd": {rule: rep["cost_usd"] for rule, rep in out["rules"].items()},
        "seconds": round(seconds, 1),
        "resent": resent_summary([b for a in agents.values() for b in a.breaks]),
        "run_tails": tail_summary(agents.values()),
        "run_outcomes": run_outcomes(agents.values()),
        "sessions": {name: {**a.tally.report(), "breaks": a.breaks, "runs": a.runs,
                            "run_outcomes": a.outcomes,
                            "trace": a.trace}
                     for name, a in agents.items()},
    })
    return out


# ------------------------------------------------------------------------------ the sides


@dataclass(frozen=True)
class Fakes:
    """The agent's fake (prefix cache) and the summarizer's (bodies kept, the fixed summary)."""

    agent: RemoteFake
    summary: RemoteFake

    def prepare(self, think_s: float, latency_s: float, summary_text: str) -> None:
        """Fresh logs and caches; the agent answers after ``think_s``, every summary call after
        ``latency_s`` with ``summary_text``."""
        self.agent.reset()
        # compactd's summary calls with the run model reach the agent's fake (its cache is the
        # agent's): the same answer as on the summary fake. First: the agent's matches them too.
        self.agent.script(Behaviour(model=AGENT_MODEL, contains=SUMMARY_MARK, output="text",
                                    text=summary_text, latency_s=latency_s, times=-1,
                                    keep_body=True))
        self.agent.script(Behaviour(model=AGENT_MODEL, output="text", text=AGENT_ANSWER,
                                    latency_s=think_s, times=-1))
        self.summary.reset()
        self.summary.script(Behaviour(output="text", text=summary_text, latency_s=latency_s,
                                      times=-1))


def make_agents(sdk: AsyncOpenAI, sessions: Sequence[Session], prefix: str,
                args: argparse.Namespace, trigger: int) -> dict[str, Agent]:
    return {s.name: Agent(sdk, f"{prefix}:{s.name}", args.window, trigger, len(s.system),
                          frozenset(text_of(wire(m)).strip() for m in s.messages))
            for s in sessions}


async def langchain_session(session: Session, agent: Agent, args: argparse.Namespace,
                            trigger: int, summary_url: str) -> None:
    model = fake_chat_openai(f"{summary_url}/v1", SUMMARY_MODEL, api_key=FAKE_KEY,
                             max_retries=0)
    middleware: SummarizationMiddleware[Any, Any] = SummarizationMiddleware(
        model=model, trigger=("tokens", trigger), keep=("messages", args.keep),
        token_counter=LCCounter(), trim_tokens_to_summarize=args.trim)
    state: list[AnyMessage] = []
    n = 0
    for step in session.steps:
        ids = [f"m{n + i + 1}" for i in range(len(step))]
        n += len(step)
        new = to_langchain([wire(m) for m in step], ids=ids)
        if args.usage and agent.previous is not None:
            carry_usage(new, agent.conversation_tokens)
        state = add_step(state, new)
        started = time.perf_counter()
        update = await middleware.abefore_model({"messages": state}, None)  # type: ignore[arg-type]
        if update is not None:
            # In band: the agent's next model call waits for this one.
            agent.tally.stall_s += time.perf_counter() - started
            agent.tally.compactions += 1
            state = apply_update(state, update)
        # The step's messages still in the state (a keep shorter than the step cuts into it).
        own = sum(1 for m in state if m.id in ids)
        await agent.call(session.system + openai_wire(state), own)


def carry_usage(step: list[AnyMessage], input_tokens: int) -> None:
    """Put the usage of the call ``step`` answers on its first assistant message, as the
    provider's response carries it (its output: the message's own tokens)."""
    for m in step:
        if isinstance(m, AIMessage):
            output = LCCounter()([m])
            m.usage_metadata = {"input_tokens": input_tokens, "output_tokens": output,
                                "total_tokens": input_tokens + output}
            m.response_metadata = {**m.response_metadata, "model_provider": "openai"}
            return


async def run_langchain(sessions: Sequence[Session], args: argparse.Namespace, trigger: int,
                        fakes: Fakes) -> dict[str, Agent]:
    async with agent_sdk(fakes.agent.url) as sdk:
        agents = make_agents(sdk, sessions, f"langchain-{trigger}", args, trigger)
        await asyncio.gather(*(langchain_session(s, agents[s.name], args, trigger,
                                                 fakes.summary.url) for s in sessions))
    return agents


def compactd_policy(args: argparse.Namespace, side: str, trigger: int) -> dict[str, Any]:
    # No summary model: the session's run model summarizes (compactd's default), on the agent's
    # fake, where a call sharing the agent's cache reads it.
    policy: dict[str, Any] = {
        "trigger": {"type": "tokens", "value": trigger},
        "keep": {"type": "messages", "value": args.keep},
        "trim_tokens_to_summarize": args.trim,
        **COMPACTD_SIDES[side]}
    if policy.get("layout") == "recallable":
        # The policy refuses an index cap the index checkpoints alone could fire the trigger
        # with; the default cap stays where the trigger leaves room for it (a quarter, so the
        # state and the kept tail fit beside the index), and a small trigger gets its quarter.
        policy["index_max_tokens"] = min(DEFAULT_INDEX_MAX_TOKENS, trigger // 4)
    return policy


def session_envelope(session: Session, agent: Agent) -> dict[str, Any] | None:
    """What the agent sends besides the surface: its system prompt and its cache key (None when
    its system prompt is not one text message, which the envelope cannot hold)."""
    if len(session.system) != 1 or not isinstance(session.system[0].get("content"), str):
        return None
    return {"system": session.system[0]["content"], "prompt_cache_key": agent.cache_key}


async def compactd_session(client: CompactdClient, session: Session, agent: Agent,
                           usage: bool) -> None:
    envelope = session_envelope(session, agent)
    # The trigger counts the conversation only, as LangChain's does: pressure counts the
    # envelope too, so the session's trigger is raised by it.
    extra = envelope_tokens(envelope, AGENT_MODEL)
    handle = await client.create_session(
        session.name, run_model=AGENT_MODEL, context_window=agent.window, envelope=envelope,
        policy={"trigger": {"type": "tokens", "value": agent.trigger + extra}} if extra else None)
    held: list[dict[str, Any]] = []
    for step in session.steps:
        messages = parse_messages([wire(m) for m in step])
        appended = await handle.append(messages)
        # The runtime holds its steps as the surface renders them, so a re-read surface only
        # differs from what it held where a compaction changed it.
        sent = [wire(m.to_openai()) for m in messages]
        held = [*held, *sent]
        at = dt.datetime.now(dt.UTC)
        agent.appended.extend(
            Appended(appended.first_seq + i, at, size) for i, size in enumerate(
                COUNTS.count(request_segments("openai", {"messages": sent}), agent.counter)))
        if await handle.poll() is not None:
            held = [wire(m) for m in await handle.surface()]
            agent.tally.pickups += 1
        await agent.call(session.system + held, len(messages))
        if usage:
            # The whole request: the session's trigger is raised by its envelope. Before the
            # next step is appended, which the store then counts on top.
            await handle.report_usage(agent.tally.final_context, 0, response_appended=False)


async def drive_compactd(stack: Stack, sessions: Sequence[Session], args: argparse.Namespace,
                         trigger: int, agent_url: str) -> dict[str, Agent]:
    config = load_config(env=stack.env)
    async with CompactdClient(config) as client, agent_sdk(agent_url) as sdk:
        agents = make_agents(sdk, sessions, stack.home.name, args, trigger)
        await asyncio.gather(*(compactd_session(client, s, agents[s.name], args.usage)
                               for s in sessions))
        await client.drain()
        await drain(stack)
        runs = await client.store.recent_runs(limit=1_000_000)
    for run in sorted(runs, key=lambda r: r.started_at):
        if run.session_id in agents:
            outcomes = agents[run.session_id].outcomes
            outcomes[run.status] = outcomes.get(run.status, 0) + 1
        if run.status == RunStatus.COMMITTED and run.session_id in agents:
            agent = agents[run.session_id]
            agent.tally.compactions += 1
            if run.finished_at is not None:
                agent.runs.append(run_tail(run.range_seqs or (), run.started_at,
                                           run.finished_at, agent.appended))
    return agents


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
                 trigger: int, fakes: Fakes, home: Path) -> dict[str, Agent] | str:
    """The side's agents, or why it is not available (the policy refused its keys)."""
    # The run model is the agent's (its fake, its cache); the summary model the summary fake's.
    models = [m for m in fake_models(fakes.summary.url) if m["name"] != AGENT_MODEL]
    models += [m for m in fake_models(fakes.agent.url) if m["name"] == AGENT_MODEL]
    stack = Stack(args.database_url, args.redis_url, home / f"{side}-{trigger}",
                  fake_url=fakes.summary.url, models=models,
                  summarization=compactd_policy(args, side, trigger),
                  worker={"concurrency": args.concurrency})
    try:
        # What the worker reads at start: a key the policy does not know is refused here.
        load_config(env=stack.env)
    except ConfigError as exc:
        return str(exc)
    asyncio.run(reset_database(args.database_url))
    flush_redis(args.redis_url)
    with stack:
        stack.start_worker("w1", concurrency=args.concurrency, ready_timeout=90)
        return asyncio.run(drive_compactd(stack, sessions, args, trigger, fakes.agent.url))


def run_side(side: str, sessions: Sequence[Session], args: argparse.Namespace, trigger: int,
             profile: tuple[float, float], fakes: Fakes, home: Path) -> dict[str, Any] | str:
    think_s, latency_s = profile
    # In band, nothing LangChain does depends on time: its agent calls answer at once.
    fakes.prepare(0.0 if side == "langchain" else think_s, latency_s, args.summary_text)
    started = time.perf_counter()
    agents = (asyncio.run(run_langchain(sessions, args, trigger, fakes)) if side == "langchain"
              else run_compactd(side, sessions, args, trigger, fakes, home))
    if isinstance(agents, str):
        return agents
    records = [*fakes.summary.requests(bodies=True),
               *(r for r in fakes.agent.requests(bodies=True) if r.get("body"))]
    return side_report(agents, summarizer_usage(records), time.perf_counter() - started,
                       summary_inputs(records))


# ------------------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    count, seconds = cli_types.positive_int, cli_types.seconds
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--sessions", help="comma-separated session names (default: all)")
    parser.add_argument("--profiles", default="fast,realistic",
                        help=f"latency profiles, of {', '.join(PROFILES)} (default: both)")
    parser.add_argument("--latency", type=seconds, default=None,
                        help="seconds per summary call (with --think: one profile, 'custom')")
    parser.add_argument("--think", type=seconds, default=None,
                        help="seconds per agent call (with --latency)")
    parser.add_argument("--trigger", type=count, default=None,
                        help="one trigger, tokens (the same as --triggers N)")
    parser.add_argument("--triggers", default=None,
                        help="comma-separated triggers, tokens: every side at each "
                             "(default 16000)")
    parser.add_argument("--keep", type=count, default=6, help="keep, messages")
    parser.add_argument("--trim", type=count, default=4_000,
                        help="summarizer input budget, tokens (every side)")
    parser.add_argument("--summary-tokens", type=count, default=SUMMARY_TOKENS,
                        help="the size of every summary, tokens (every side)")
    parser.add_argument("--window", type=count, default=128_000,
                        help="the run model's context window, tokens")
    parser.add_argument("--concurrency", type=count, default=4,
                        help="the compactd worker's threads")
    parser.add_argument("--sides", default=",".join(DEFAULT_SIDES),
                        help=f"comma-separated, of {', '.join(SIDES)}")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS,
                        help="the corpus the long sessions are built from")
    source.add_argument("--transcripts", type=Path,
                        help="take every DIR/<group>/*.jsonl as a session as it is")
    parser.add_argument("--usage", action=argparse.BooleanOptionalAction, default=True,
                        help="both runtimes see the provider's usage of the agent's last call "
                        "(the default; --no-usage: both fire on compactd's count)")
    parser.add_argument("--quick", action="store_true",
                        help=f"a smoke run: the smallest session, agent and summary calls of "
                        f"{QUICK_THINK_S:g} s (unless given), one profile")
    parser.add_argument("--database-url", default=pg_url("cache_cost"),
                        help="PostgreSQL database to use (EMPTIED)")
    parser.add_argument("--redis-url", default=REDIS_URL, help="Redis database (FLUSHDB'd)")
    args = parser.parse_args(argv)
    args.profile_table = choose_profiles(parser, args)
    args.trigger_list = choose_triggers(parser, args)
    args.side_list = choose_list(parser, "--sides", args.sides, SIDES)
    root = args.transcripts or args.corpus
    if not root.is_dir() or not any(root.glob("*/*.jsonl")):
        flag = "--transcripts" if args.transcripts else "--corpus"
        parser.error(f"{flag}: no */*.jsonl transcripts under {root}")
    args.chosen = choose_sessions(parser, args)
    args.summary_text = fixed_summary(args.summary_tokens)
    return args


def choose_list(parser: argparse.ArgumentParser, flag: str, text: str,
                known: Sequence[str]) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if not names or unknown:
        parser.error(f"{flag}: unknown {', '.join(map(repr, unknown)) or repr('')} "
                     f"(expected some of {', '.join(known)})")
    return list(dict.fromkeys(names))


def choose_profiles(parser: argparse.ArgumentParser, args: argparse.Namespace
                    ) -> dict[str, tuple[float, float]]:
    if (args.think is None) != (args.latency is None):
        parser.error("--think and --latency: give both (one profile of your own) or neither")
    if args.think is not None:
        return {"custom": (args.think, args.latency)}
    if args.quick:
        return {"quick": (QUICK_THINK_S, QUICK_LATENCY_S)}
    return {name: PROFILES[name] for name in choose_list(parser, "--profiles", args.profiles,
                                                         list(PROFILES))}


def choose_triggers(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[int]:
    if args.trigger is not None and args.triggers is not None:
        parser.error("--trigger and --triggers: give one of them")
    if args.triggers is None:
        return [args.trigger or 16_000]
    out = []
    for text in args.triggers.split(","):
        try:
            out.append(cli_types.positive_int(text.strip()))
        except argparse.ArgumentTypeError as exc:
            parser.error(f"argument --triggers: {exc}")
    return list(dict.fromkeys(out))


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
        "triggers_tokens": args.trigger_list, "keep_messages": args.keep,
        "trim_tokens_to_summarize": args.trim, "window_tokens": args.window,
        "summary_tokens": args.summary_tokens, "usage_reports": args.usage,
        "profiles": {name: {"think_s": t, "summary_latency_s": s}
                     for name, (t, s) in args.profile_table.items()},
        "sides": args.side_list,
        "compactd_sides": {side: COMPACTD_SIDES[side] for side in args.side_list
                           if side in COMPACTD_SIDES},
        "worker_concurrency": args.concurrency, "agent_model": AGENT_MODEL,
        "summary_model": SUMMARY_MODEL, "token_counter": "o200k (compactd's, every side)",
        "compactd_render": "durable_context (the default)",
        "prices": {rule: {"model": model, "usd_per_million_tokens": dataclasses.asdict(price)}
                   for rule, (model, price) in PRICES.items()},
    }


def same_config(side: str, earlier: str) -> bool:
    return (side in COMPACTD_SIDES and earlier in COMPACTD_SIDES
            and COMPACTD_SIDES[side] == COMPACTD_SIDES[earlier])


def run_all(args: argparse.Namespace, fakes: Fakes, home: Path) -> list[dict[str, Any]]:
    runs = []
    for profile, timing in args.profile_table.items():
        for trigger in args.trigger_list:
            sides: dict[str, Any] = {}
            not_available: dict[str, str] = {}
            for side in args.side_list:
                twin = next((done for done in sides if same_config(side, done)), None)
                if twin is not None:
                    sides[side] = {**sides[twin], "same_as": twin}
                    continue
                result = run_side(side, args.chosen, args, trigger, timing, fakes, home)
                if isinstance(result, str):
                    not_available[side] = result
                    continue
                sides[side] = result
                print(f"{profile} trigger {trigger} {side}: {result['seconds']} s",
                      file=sys.stderr, flush=True)
            runs.append({"profile": profile, "think_s": timing[0],
                         "summary_latency_s": timing[1], "trigger": trigger, "sides": sides,
                         "not_available": not_available})
    return runs


def ratios(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each compactd side against LangChain at the same profile and trigger."""
    out = []
    for run in runs:
        peer = run["sides"].get("langchain")
        if peer is None:
            continue
        for side, rep in run["sides"].items():
            if side == "langchain":
                continue
            row: dict[str, Any] = {"profile": run["profile"], "trigger": run["trigger"],
                                   "side": side}
            for rule in CACHE_RULES:
                mine, theirs = rep["rules"][rule], peer["rules"][rule]
                row[f"cost_{rule}"] = _ratio(mine["cost_usd"], theirs["cost_usd"])
                row[f"compaction_uncached_per_compaction_{rule}"] = _ratio(
                    mine["compaction_uncached_per_compaction"],
                    theirs["compaction_uncached_per_compaction"])
            row["steps_over_trigger_share"] = round(
                rep["steps_over_trigger"] / max(1, rep["requests"]), 4)
            out.append(row)
    return out


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b else None


def frontier(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per profile, side and trigger: the cost under each rule and the agent's stall."""
    return [{"profile": run["profile"], "trigger": run["trigger"], "side": side,
             **{f"cost_{rule}": rep["rules"][rule]["cost_usd"] for rule in CACHE_RULES},
             "stall_s": rep["stall_s"]}
            for run in runs for side, rep in run["sides"].items()]


def print_report(report: dict[str, Any]) -> None:
    c = report["config"]
    print(f"keep {c['keep_messages']} messages, trim {c['trim_tokens_to_summarize']} tokens, "
          f"window {c['window_tokens']} tokens, summaries {c['summary_tokens']} tokens on "
          f"every side; prices per 1M tokens: " + "; ".join(
              f"{rule} ({p['model']}) ${p['usd_per_million_tokens']['input']:.2f} in / "
              f"${p['usd_per_million_tokens']['cached_input']:.2f} cached / "
              f"${p['usd_per_million_tokens']['cache_write']:.2f} write / "
              f"${p['usd_per_million_tokens']['output']:.2f} out"
              for rule, p in c["prices"].items()))
    for run in report["runs"]:
        print(f"\n{run['profile']}: agent call {run['think_s']:g} s, summary call "
              f"{run['summary_latency_s']:g} s; trigger {run['trigger']} tokens")
        rows = []
        for side, rep in run["sides"].items():
            for rule in CACHE_RULES:
                r = rep["rules"][rule]
                rows.append([side + (f" (= {rep['same_as']})" if rep.get("same_as") else ""),
                             rule, r["cost_usd"], rep["agent_input_tokens"],
                             r["agent_uncached_tokens"], r["compaction_uncached_per_compaction"],
                             rep["steps_over_trigger"], rep["coverage"],
                             rep["final_context_tokens"], r["summarizer_cached_tokens"],
                             rep["compactions"], rep["stall_s"]])
        print_table(["side", "rule", "cost $", "agent in", "uncached",
                     "compaction uncached / compaction", "steps over trigger", "coverage",
                     "final context", "summarizer cached", "compactions", "stall s"], rows)
        for side, rep in run["sides"].items():
            r = rep["resent"]
            if r["requests"]:
                print(f"{side}: {r['requests']} requests after a compaction re-sent "
                      f"{r['messages_per_request']} messages each at {r['tokens_per_message']} "
                      f"tokens a message; their own steps {r['step_tokens_per_message']} tokens "
                      f"a message")
            if rep.get("run_outcomes"):
                print(f"{side}: runs " + ", ".join(
                    f"{status} {n}" for status, n in rep["run_outcomes"].items())
                      + f"; {rep['summarizer_calls']} summarizer calls")
            tails = rep.get("run_tails")
            if tails:
                kept, arrived = tails["kept_at_read"], tails["arrived_during_run"]
                print(f"{side}: its {tails['runs']} runs kept {kept['messages_per_run']} "
                      f"messages each at their read ({kept['tokens_per_message']} tokens a "
                      f"message) and {arrived['messages_per_run']} arrived while each ran "
                      f"({arrived['tokens_per_message']}); all appended: "
                      f"{tails['appended_tokens_per_message']} tokens a message")
        for side, reason in run["not_available"].items():
            print(f"{side}: not available ({reason})")
    if len({run["trigger"] for run in report["runs"]}) > 1:
        print("\nfrontier: cost against the agent's stall")
        print_table(["profile", "trigger", "side", *(f"cost $ {r}" for r in CACHE_RULES),
                     "stall s"],
                    [[f["profile"], f["trigger"], f["side"],
                      *(f[f"cost_{r}"] for r in CACHE_RULES), f["stall_s"]]
                     for f in report["frontier"]])


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    sessions: list[Session] = args.chosen
    info = machine()
    print(f"machine: {machine_line(info)}")
    print("sessions: " + ", ".join(f"{s.name} ({s.tokens} tokens, {len(s.steps)} steps)"
                                   for s in sessions), flush=True)
    report: dict[str, Any] = {"machine": info, "config": config_report(args),
                              "sessions": [{"name": s.name, "tokens": s.tokens,
                                            "steps": len(s.steps)} for s in sessions]}
    started = time.perf_counter()
    with fake_provider_process(0.0, prefix_cache=True) as agent_url, \
            fake_provider_process(0.0, prefix_cache=True, keep_bodies=True) as summary_url, \
            tempfile.TemporaryDirectory(prefix="compactd-cache-cost-") as tmp:
        fakes = Fakes(RemoteFake(agent_url), RemoteFake(summary_url))
        report["runs"] = run_all(args, fakes, Path(tmp))
    report["ratios"] = ratios(report["runs"])
    report["frontier"] = frontier(report["runs"])
    report["seconds"] = round(time.perf_counter() - started, 1)
    print_report(report)
    write_json(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
