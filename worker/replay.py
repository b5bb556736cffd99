"""A transcript replayed through the compaction pipeline, measured: what ``compactd eval`` reports
and what ``tests/bench/corpus.py`` compares with a peer, from the same code.

A transcript is a JSON-lines file as ``compactd ingest`` reads it (``storage.messages.read_jsonl``).
Its leading system messages are the runtime's system prompt, outside the compacted list (a
runtime sends them in its envelope); the rest is cut into steps (an assistant message with what
follows it up to the next one, as a runtime appends it). Each step is appended to a store, and
when the session is over its trigger one compaction runs in process (``worker.orchestration``,
the configured candidates); the request the model would get next is the system prompt and the
rendered surface.

Measured (:class:`Tally`): summarizer calls (every request a chain sends, seen through
``worker.chains.SUMMARY_OBSERVER``, as first asked: a request a model's context-length error
shrinks is counted at its first size) and their input tokens; compactions; coverage (the share of
the tokens of replaced messages that reached a summarizer input, by characters received); the
final request's tokens; the retention of the session's facts (:func:`facts_of`) in the final
request; the providers' usage of every run; and probes (``worker.probes``) extracted from every
range a compaction replaced: kept (a substring of the final request), found (among the first
five hits of ``history_search`` asked with :func:`worker.probes.query_words`), or lost.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

from compactd.storage.errors import BadInput, InvalidMessage
from compactd.storage.kinds import JournalKind, NodeKind, RunCause, RunStatus
from compactd.storage.messages import Message, ToolLinks, from_payload, parse, read_jsonl
from compactd.storage.tokens import counter_for
from compactd.worker import orchestration, probes
from compactd.worker.chains import SUMMARY_OBSERVER
from compactd.worker.compaction.render import render_surface
from compactd.worker.cost import total_usage
from compactd.worker.llm.fallback import SummaryRequest
from compactd.worker.llm.local import tool_result_facts
from compactd.worker.pressure import over_trigger
from compactd.worker.runtime import build_deps
from compactd.worker.settings import Config

WIRE_KEYS = ("role", "content", "tool_calls", "tool_call_id", "name")
FACT_KINDS = ("paths", "errors", "ids")
SEARCH_TOP = 5
REPLAY_ID = "replay_id"  # the meta key that follows a message through prunes and summaries
RENDER = "langchain"
MISSES_KEPT = 20  # lost probes listed per session in a report


@functools.cache
def counter() -> Any:
    """The replay's token counter, made at first use: loading its encoding is the slowest part
    of importing this module, which every CLI command does."""
    return counter_for(None)


class TranscriptError(BadInput):
    """A transcript that cannot be replayed: the message names the file and the line."""


# ------------------------------------------------------------------------------- sessions


@dataclass
class Session:
    name: str
    group: str
    system: list[dict[str, Any]]
    steps: list[list[dict[str, Any]]]
    facts: dict[str, list[str]]
    parts: int = 1

    @property
    def messages(self) -> list[dict[str, Any]]:
        return [m for step in self.steps for m in step]

    @property
    def tokens(self) -> int:
        return sum(tokens_of(m) for m in self.messages)


def tokens_of(message: dict[str, Any]) -> int:
    return sum(counter().count_message(m) for m in parse(wire(message), "openai"))


def wire(message: dict[str, Any]) -> dict[str, Any]:
    """The message with the keys a provider is sent (a rendered surface adds ``seq``,
    ``tokens`` and ``meta``)."""
    return {k: v for k, v in message.items() if k in WIRE_KEYS}


def read_transcript(path: Path, fmt: str = "openai") -> list[dict[str, Any]]:
    """The messages of a JSON-lines transcript as OpenAI chat dicts, read by ``compactd
    ingest``'s parser and checked as ingest checks a new session's tool links;
    :class:`TranscriptError` names the file and the line of the first problem."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise TranscriptError(f"cannot read the transcript {path}: {exc.strerror}") from None
    try:
        pairs = read_jsonl(raw.splitlines(), fmt)
    except InvalidMessage as exc:
        raise TranscriptError(f"{path}: {exc}") from None
    if not pairs:
        raise TranscriptError(f"{path}: holds no messages")
    messages = [m for _, m in pairs]
    conversation = [(line, m) for line, m in pairs if m.role != "system"]
    try:
        ToolLinks().check([m for _, m in conversation])
    except InvalidMessage as exc:
        line = conversation[exc.index or 0][0]
        raise TranscriptError(f"{path}: {exc.at_line(line)}") from None
    return [m.to_openai() for m in messages]


def split_system(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]],
                                                          list[dict[str, Any]]]:
    """The leading system messages (the system prompt), and the conversation without any
    system message."""
    head = 0
    while head < len(messages) and messages[head]["role"] == "system":
        head += 1
    return messages[:head], [m for m in messages[head:] if m["role"] != "system"]


def cut_steps(messages: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    steps: list[list[dict[str, Any]]] = []
    for message in messages:
        if message["role"] == "assistant" or not steps:
            steps.append([])
        steps[-1].append(message)
    return steps


def facts_of(system: list[dict[str, Any]], conversation: list[dict[str, Any]]
             ) -> dict[str, list[str]]:
    """File paths and exception names in tool results, ticket-like ids anywhere and id
    arguments of tool calls, less those the system prompt holds (it is always sent)."""
    system_text = "\n".join(str(m.get("content") or "") for m in system)
    messages = [m for d in conversation for m in parse(wire(d), "openai")]
    paths, errors = tool_result_facts(messages)
    ids: dict[str, None] = {}
    for m in messages:
        ids.update(dict.fromkeys(probes.identifiers(m)))
    return {kind: [f for f in found if f not in system_text]
            for kind, found in (("paths", paths), ("errors", errors), ("ids", list(ids)))}


def session_of(name: str, group: str, messages: list[dict[str, Any]]) -> Session:
    system, rest = split_system(messages)
    return Session(name, group, system, cut_steps(rest), facts_of(system, rest))


def context_text(messages: Iterable[dict[str, Any]]) -> str:
    parts = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            content = "\n".join(str(b.get("text", "")) for b in content if isinstance(b, dict))
        parts.append(str(content or ""))
        parts += [c["function"]["arguments"] for c in m.get("tool_calls") or ()]
    return "\n".join(parts)


# ------------------------------------------------------------------------------- tallies


@functools.cache
def _summed_fields() -> tuple[str, ...]:
    """The tally's counts, which a total adds up: every field with a plain default (the lists
    and counters of probes have factories and are merged or kept per session)."""
    return tuple(f.name for f in fields(Tally) if f.default is not MISSING)


@dataclass
class Tally:
    calls: int = 0
    compactions: int = 0
    failed: int = 0
    input_tokens: int = 0
    replaced_tokens: float = 0
    covered_tokens: float = 0
    replaced_original: float = 0
    covered_original: float = 0
    summaries_replaced: int = 0
    summaries_carried: int = 0
    source_tokens: int = 0  # the session as a request without compaction (system prompt too)
    final_tokens: int = 0
    facts: int = 0
    retained: int = 0
    missing: list[str] = field(default_factory=list)
    probes: Counter[str] = field(default_factory=Counter)  # by kind
    kept: Counter[str] = field(default_factory=Counter)
    found: Counter[str] = field(default_factory=Counter)
    lost: list[str] = field(default_factory=list)  # "kind: value -> query"
    usages: list[dict[str, Any] | None] = field(default_factory=list)

    def add(self, other: Tally) -> None:
        for name in _summed_fields():
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.probes.update(other.probes)
        self.kept.update(other.kept)
        self.found.update(other.found)
        self.usages += other.usages

    def report(self) -> dict[str, Any]:
        return {
            "calls": self.calls, "compactions": self.compactions, "failed": self.failed,
            "input_tokens": self.input_tokens, "final_tokens": self.final_tokens,
            "coverage": ratio(self.covered_tokens, self.replaced_tokens),
            "coverage_of_original": ratio(self.covered_original, self.replaced_original),
            "replaced_tokens": round(self.replaced_tokens),
            "summary_carried": ratio(self.summaries_carried, self.summaries_replaced),
            "retention": ratio(self.retained, self.facts), "facts": self.facts,
            "facts_retained": self.retained,
        }

    def probe_report(self) -> dict[str, Any]:
        by_kind = {kind: {"probes": self.probes[kind], "kept": self.kept[kind],
                          "found": self.found[kind],
                          "lost": self.probes[kind] - self.kept[kind] - self.found[kind]}
                   for kind in probes.KINDS}
        total = sum(self.probes.values())
        held = sum(self.kept.values()) + sum(self.found.values())
        return {"probes": total, "kept": sum(self.kept.values()),
                "found": sum(self.found.values()), "retention": ratio(held, total),
                "by_kind": by_kind}

    def usage(self) -> dict[str, Any]:
        return total_usage(self.usages)


def ratio(part: float, whole: float) -> float | None:
    return round(part / whole, 4) if whole else None


def finish(tally: Tally, session: Session, final: list[dict[str, Any]]) -> None:
    """The final request's tokens and the session's facts it still holds."""
    tally.final_tokens = sum(tokens_of(m) for m in final)
    text = context_text(final)
    facts = [f for kind in FACT_KINDS for f in session.facts.get(kind, ())]
    tally.facts = len(facts)
    tally.retained = sum(f in text for f in facts)
    tally.missing = [f for f in facts if f not in text]


# ------------------------------------------------------------------------------- replay


def chars(message: Message) -> int:
    return len(message.text) + sum(len(c.arguments) for c in message.tool_calls)


def message_text(message: Message) -> str:
    return "\n".join([message.text, *(c.arguments for c in message.tool_calls)])


@dataclass
class _Appended:
    """What the replay appended: by replay id, the message, its seq, tokens and characters."""

    messages: dict[str, Message] = field(default_factory=dict)
    seqs: dict[str, int] = field(default_factory=dict)
    sizes: dict[str, tuple[int, int]] = field(default_factory=dict)
    replaced: dict[str, None] = field(default_factory=dict)  # in the order they were replaced


RequestHook = Callable[[list[dict[str, Any]]], None]


async def replay(session: Session, config: Config, *, session_id: str | None = None,
                 on_request: RequestHook | None = None, run_model: str | None = None,
                 context_window: int | None = None) -> Tally:
    """``session`` step by step through the pipeline ``config`` configures, in process, on the
    store it names, as a session of ``run_model`` with ``context_window`` (what a fraction
    trigger is a fraction of); ``on_request`` sees the request the model would get after every
    step."""
    tally = Tally(source_tokens=sum(tokens_of(m) for m in session.system) + session.tokens)
    deps = await build_deps(config, pool_size=2)
    calls: list[tuple[list[Message], str | None]] = []

    def observe(request: SummaryRequest) -> None:
        calls.append((list(request.messages), request.existing_summary))

    token = SUMMARY_OBSERVER.set(observe)
    appended = _Appended()
    sid = session_id or session.name
    final: list[dict[str, Any]] = []
    try:
        store = deps.store
        await store.create_session(sid, run_model=run_model,
                                   context_window=context_window)
        for step in session.steps:
            batch = []
            for d in step:
                rid = f"m{len(appended.messages) + 1}"
                m = parse(wire(d), "openai")[0]
                m = m.model_copy(update={"meta": {REPLAY_ID: rid}})
                appended.messages[rid] = m
                appended.sizes[rid] = (counter().count_message(m), chars(m))
                batch.append(m)
            result = await store.append(sid, batch)
            appended.seqs.update(zip([m.meta[REPLAY_ID] for m in batch],
                                     range(result.first_seq, result.last_seq + 1), strict=True))
            info = result.session
            if over_trigger(info, config):
                calls.clear()
                await _compact(deps, sid, info.last_seq, calls, appended, tally)
            if on_request is not None:
                # The request the agent sends next: only a caller that watches each one needs
                # the surface read after every step.
                final = await _request(store, sid, session)
                on_request(final)
        if session.steps and on_request is None:
            final = await _request(store, sid, session)
        finish(tally, session, final)
        await _probe(store, sid, session, appended, final, tally)
    finally:
        SUMMARY_OBSERVER.reset(token)
        await deps.aclose()
    return tally


async def _request(store: Any, sid: str, session: Session) -> list[dict[str, Any]]:
    """What the agent sends as its context now: the system prompt and the rendered surface."""
    surface = await store.read_surface(sid)
    return session.system + [wire(m) for m in render_surface(surface.nodes, RENDER)]


async def _compact(deps: Any, sid: str, last_seq: int,
                   calls: list[tuple[list[Message], str | None]], appended: _Appended,
                   tally: Tally) -> None:
    before = await deps.store.read_surface(sid)
    nodes = {node.seq: (node.message, node.tokens, node.kind) for node in before.nodes}
    outcome = await orchestration.compact(deps, sid, trigger=RunCause.PRESSURE)
    # A partial run committed some rounds, then failed: a failure, as status counts it.
    tally.failed += outcome.outcome in (RunStatus.FAILED, RunStatus.PARTIAL)
    tally.usages.append(outcome.usage)
    tally.calls += len(calls)
    received: Counter[str] = Counter()
    carried = False
    for messages, existing in calls:
        tally.input_tokens += sum(counter().count_message(m) for m in messages)
        tally.input_tokens += counter().count_text(existing) if existing else 0
        carried = carried or bool(existing)
        for m in messages:
            if REPLAY_ID in m.meta:
                received[m.meta[REPLAY_ID]] += chars(m)
            elif m.meta.get("checkpoint"):
                carried = True
    for event in await deps.store.read_events(sid, after_seq=last_seq):
        if event.kind in (NodeKind.PRUNED, NodeKind.CHECKPOINT):
            nodes[event.seq] = (from_payload(event.payload["message"]),
                                event.tokens or 0, event.kind)
        if event.kind != JournalKind.SUMMARY:
            continue
        tally.compactions += 1
        for seq in event.payload["replaced_seqs"]:
            message, tokens, kind = nodes[seq]
            if kind == NodeKind.CHECKPOINT:
                tally.summaries_replaced += 1
                tally.summaries_carried += carried
                continue
            _covered(tally, message, tokens, received, appended)


def _covered(tally: Tally, message: Message, tokens: int, received: Counter[str],
             appended: _Appended) -> None:
    rid = message.meta[REPLAY_ID]
    appended.replaced[rid] = None
    got = received[rid]
    size = chars(message)
    orig_tokens, orig_chars = appended.sizes[rid]
    tally.replaced_tokens += tokens
    tally.covered_tokens += tokens * (min(1.0, got / size) if size else float(rid in received))
    tally.replaced_original += orig_tokens
    tally.covered_original += orig_tokens * (min(1.0, got / orig_chars) if orig_chars
                                             else float(rid in received))


async def _probe(store: Any, sid: str, session: Session, appended: _Appended,
                 final: list[dict[str, Any]], tally: Tally) -> None:
    """Every probe of the replaced messages: kept in the final request, found by words among
    ``history_search``'s first five hits, or lost."""
    system_text = context_text(session.system)
    replaced = [appended.messages[rid] for rid in appended.replaced]
    found_in = [p for p in probes.extract(replaced) if p.value not in system_text]
    if not found_in:
        return
    final_text = context_text(final)
    texts = {appended.seqs[rid]: message_text(m) for rid, m in appended.messages.items()}
    counts = probes.vocabulary(texts.values())
    for probe in found_in:
        tally.probes[probe.kind] += 1
        if probe.value in final_text:
            tally.kept[probe.kind] += 1
            continue
        holders = [seq for seq, text in texts.items() if probe.value in text]
        query = probes.query_words(probe, texts[holders[0]], counts) if holders else ""
        if query and await _found(store, sid, query, set(holders)):
            tally.found[probe.kind] += 1
        elif len(tally.lost) < MISSES_KEPT:
            tally.lost.append(f"{probe.kind}: {probe.value} -> {query!r}")


async def _found(store: Any, sid: str, query: str, holders: set[int]) -> bool:
    result = await store.history_search(sid, query)
    return bool(holders & {hit.seq for hit in result.hits[:SEARCH_TOP]})
