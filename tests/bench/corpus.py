"""The pipelines compared on real transcripts: what reaches the summarizer, what survives.

    python tests/bench/corpus.py --json OUT.json [--corpus DIR] [--triggers 4000,16000]
        [--keep 6] [--trim 4000] [--limit N]

Sessions: every ``*.jsonl`` under ``--corpus`` (default ``../shared/corpus`` beside the
repository: 22 SWE-agent and 100 tau-bench airline transcripts, about 0.2k to 13k conversation
tokens), plus long sessions made by concatenating them per folder to 30k, 60k, 100k and 150k
conversation tokens (as far as the folder has material), plus one generated coding session
(``scheduler.samples.coding_session``) whose facts are planted. In a concatenation the first
part's leading system messages are the system prompt and the other parts' are dropped (within a
folder they are the same agent's instructions); every tool-call id of part k is prefixed with
``p<k>_`` so no id is reused while open.

Each session is replayed step by step (a step is an assistant message with what follows it up to
the next assistant message, as a runtime appends it). Before every model call, i.e. after every
step, each side does what it does in-band, with the SAME trigger (``--triggers`` tokens), keep
(``--keep`` messages), summarizer input budget (``--trim``, default 4000 = both projects'
default) and the SAME summarizer: compactd's model-free ``summarize_local`` (max 2000 tokens).
The system prompt is outside the compacted list on both sides (LangChain's ``system_prompt``;
compactd's envelope, not counted in the trigger here, so both triggers measure the same list),
and both count tokens with compactd's o200k counter, so their triggers fire on the same counts.

* **compactd**: ``Store.append`` of the step (SQLite, in a temporary directory), then, when the
  session is over its trigger, ``worker.orchestration.compact`` in process: prune, plan, the
  local summarizer as the only candidate, validation, commit under the lease. Checkpoints render
  in LangChain's form ("Here is a summary of the conversation to date:").
* **langchain** (the real ``langchain`` 1.x package): the step is added to the state with
  LangGraph's ``add_messages``, ``SummarizationMiddleware.before_model`` runs with
  ``summarizer=`` a callable that hands the messages it receives to ``summarize_local`` (a
  leading earlier-summary message is passed as ``existing_summary``, as compactd does), and
  its update is applied. The request the model would get is then built by
  ``ContextEditingMiddleware(edits=[ClearToolUsesEdit(trigger=<half the trigger>, keep=3)])``'s
  ``wrap_model_call`` (below the summarization trigger, as LangChain's guidance has it: at the
  same trigger the edit would never apply, since summarization runs first and brings the state
  under it). ``langchain_summary_only`` is the same run's state sent as is, without the edit.

Reported per side (sums over sessions unless said):

* ``calls``: summarizer invocations; ``compactions``: history replacements. LangChain's
  ``canned`` compactions replaced history with "Previous conversation was too long to
  summarize." without calling the summarizer (its trimmed input, which must start at a human
  message, came out empty).
* ``input_tokens``: tokens of the messages (and earlier summary) handed to the summarizer.
* ``final_tokens``: tokens of the last model request (system prompt included).
* ``coverage``: share of the tokens of the messages a compaction replaced that reached a
  summarizer input, measured from what the summarizer was actually given (text characters
  received per message, weighted by the message's tokens; earlier summaries are not counted
  here, see ``summary_carried``). For compactd a replaced message may be a pruned tool result
  (head and tail kept, the middle replaced by a marker, journaled, before any summary):
  ``coverage`` counts it as it stood on the surface, ``coverage_of_original`` against the
  message as appended. LangChain's summarizer always reads the state's full messages, so its two
  numbers are equal.
* ``summary_carried``: of the compactions that replaced an earlier summary, the share whose
  summarizer received that summary (a summary that is replaced without being read loses
  everything it carried).
* ``tool_pair_errors``: model requests (one per step) a provider would reject: a tool result
  without its call right before it, or a call without its result. ``pair_problems`` counts the
  individual problems.
* ``retention``: facts of the source session still present (as substrings) in the final
  request. Facts: file paths and exception names found in tool results (the definitions of
  ``worker.llm.local.tool_result_facts``), ticket-like ids (``ABC-123``) anywhere in the
  conversation, and the string values of tool-call arguments named ``id`` or ``*_id``; facts that
  also appear in the system prompt are left out (both sides always keep it). The generated
  session uses its planted facts. Note the summarizer is built to keep exactly the paths and
  exception names it is given, so what differs between the sides is what the pipeline gives it.

Configurations: the headline trigger is 4000 tokens (the first of ``--triggers``; about half the
corpus sessions reach it), over every session. The second, 16000 tokens, is the case LangChain's
documentation warns about, a trigger above ``trim_tokens_to_summarize``: each compaction's range
is then larger than what the peer's summarizer may read. It runs only the sessions longer than
16000 tokens (the others never compact on either side). The JSON's top-level ``compactd`` /
``langchain`` keys are the headline; ``configs`` holds every configuration.

Goals (issue 8): compactd coverage 100% and zero tool-pair errors; compactd retention above the
peer's. Not comparable: compactd's compaction runs in process here (in production it runs in a
worker, in the background, and lands a few steps later); timing is not measured.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from langchain.agents.middleware import (
    ClearToolUsesEdit,
    ContextEditingMiddleware,
    SummarizationMiddleware,
)
from langchain.agents.middleware.types import ModelRequest
from langchain_core.language_models.fake_chat_models import FakeListChatModel
from langchain_core.messages import AIMessage, AnyMessage, BaseMessage, SystemMessage

from compactd.scheduler.samples import coding_session
from compactd.worker import replay
from compactd.worker.llm.errors import LocalSummaryError
from compactd.worker.llm.local import summarize_local
from compactd.worker.replay import (
    Session,
    counter,
    cut_steps,
    facts_of,
    finish,
    read_transcript,
    session_of,
    split_system,
    tokens_of,
    wire,
)
from compactd.worker.settings import Config, Settings, build_config
from tests.bench.common import (
    DEFAULT_CORPUS,
    machine,
    machine_line,
    prepare_sqlite,
    print_table,
    write_json,
)
from tests.bench.peers import (
    SUMMARY_PREFIX,
    add_step,
    apply_update,
    is_summary,
    to_compactd,
    to_langchain,
    to_openai,
)
from tests.support.pairs import request_problems

LONG_TARGETS = (30_000, 60_000, 100_000, 150_000)
MAX_SUMMARY_TOKENS = 2000
CLEAR_KEEP = 3
CANNED = ("Previous conversation was too long to summarize.",
          "No previous conversation history.")


# ----------------------------------------------------------------------------------- sessions
# A session, its steps and facts, and the compactd side's replay and measures are the product's
# (``worker.replay``, what ``compactd eval`` runs), so the two cannot disagree.


def read(path: Path) -> list[dict[str, Any]]:
    return read_transcript(path)


def renumber(messages: list[dict[str, Any]], prefix: str) -> list[dict[str, Any]]:
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [{**c, "id": prefix + c["id"]} for c in m["tool_calls"]]
        if m.get("tool_call_id"):
            m["tool_call_id"] = prefix + m["tool_call_id"]
        out.append(m)
    return out


def corpus_sessions(root: Path) -> list[Session]:
    return [session_of(path.stem, path.parent.name, read(path))
            for path in sorted(root.glob("*/*.jsonl"))]


def long_sessions(root: Path) -> list[Session]:
    out = []
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        files = sorted(folder.glob("*.jsonl"))
        if not files:
            continue
        total = sum(sum(tokens_of(m) for m in split_system(read(f))[1]) for f in files)
        for n, target in enumerate(t for t in LONG_TARGETS if t <= total):
            system: list[dict[str, Any]] = []
            conversation: list[dict[str, Any]] = []
            tokens = parts = 0
            start = (n * 7) % len(files)
            for k in range(len(files)):
                part_system, rest = split_system(read(files[(start + k) % len(files)]))
                if not system:
                    system = part_system
                rest = renumber(rest, f"p{k}_")
                conversation += rest
                tokens += sum(tokens_of(m) for m in rest)
                parts += 1
                if tokens >= target:
                    break
            name = f"long-{folder.name}-{target // 1000}k"
            out.append(Session(name, "long", system, cut_steps(conversation),
                               facts_of(system, conversation), parts=parts))
    return out


def sample_session() -> Session:
    sample = coding_session(steps=60, seed=11)
    system, rest = split_system(sample.messages)
    facts = {k: list(v) for k, v in sample.facts.items()}
    return Session("sample-coding-60", "sample", system, cut_steps(rest), facts)


def all_sessions(root: Path, limit: int = 0) -> list[Session]:
    """Every transcript under ``root`` (the first ``limit`` only, when given), the long
    concatenations, and the generated session with planted facts, in that order."""
    sessions = corpus_sessions(root)
    if limit:
        sessions = sessions[:limit]
    return [*sessions, *long_sessions(root), sample_session()]


# ----------------------------------------------------------------------------------- tallies


@dataclass
class Tally(replay.Tally):
    """The product's tally, and what only the comparison counts: LangChain's canned
    compactions, and the requests a provider would reject."""

    canned: int = 0
    requests: int = 0
    rejected: int = 0
    pair_problems: int = 0

    def add(self, other: replay.Tally) -> None:
        super().add(other)
        for name in ("canned", "requests", "rejected", "pair_problems"):
            setattr(self, name, getattr(self, name) + getattr(other, name, 0))

    def report(self) -> dict[str, Any]:
        return {**super().report(), "canned": self.canned,
                "tool_pair_errors": self.rejected, "pair_problems": self.pair_problems,
                "requests": self.requests}


def pair_problems(messages: Sequence[dict[str, Any]]) -> int:
    """How many things a provider would reject in this request (``request_problems``)."""
    return len(request_problems(messages))


def request(tally: Tally, messages: list[dict[str, Any]]) -> None:
    problems = pair_problems(messages)
    tally.requests += 1
    tally.pair_problems += problems
    tally.rejected += problems > 0


# ------------------------------------------------------------------------------------ compactd


def compactd_config(url: str, policy: dict[str, Any]) -> Config:
    return build_config({"summarization": policy},
                        settings=Settings(database_url=url, broker_url="memory://"))


async def run_compactd(session: Session, url: str, policy: dict[str, Any]) -> Tally:
    """compactd's side: the product's replay (``worker.replay``), every request checked for
    tool pairs."""
    requests = Tally()
    measured = await replay.replay(session, compactd_config(url, policy),
                                   on_request=lambda final: request(requests, final))
    tally = Tally()
    tally.add(measured)
    tally.missing = measured.missing
    for name in ("requests", "rejected", "pair_problems"):
        setattr(tally, name, getattr(requests, name))
    return tally


# ----------------------------------------------------------------------------------- langchain


class LangChainSummarizer:
    """compactd's local summarizer as SummarizationMiddleware's ``summarizer``."""

    def __init__(self) -> None:
        self.received: list[list[BaseMessage]] = []
        self.refused = 0

    def __call__(self, messages: list[AnyMessage]) -> str:
        self.received.append(list(messages))
        existing = None
        body: list[BaseMessage] = list(messages)
        if body and is_summary(body[0]):
            existing = str(body[0].content).removeprefix(SUMMARY_PREFIX)
            body = body[1:]
        try:
            return summarize_local(to_compactd(body), existing_summary=existing,
                                   max_tokens=MAX_SUMMARY_TOKENS)
        except LocalSummaryError:
            self.refused += 1
            return existing or "(nothing to summarize)"


class LCCounter:
    """compactd's o200k count of LangChain messages, memoized (the middleware counts the whole
    state at every step)."""

    def __init__(self) -> None:
        self.memo: dict[tuple[Any, ...], int] = {}

    def __call__(self, messages: Iterable[Any]) -> int:
        return sum(self.one(m) for m in messages)

    def one(self, m: BaseMessage) -> int:
        calls = tuple((c.get("id"), json.dumps(c.get("args"), sort_keys=True))
                      for c in getattr(m, "tool_calls", None) or ())
        content = m.content if isinstance(m.content, str) else json.dumps(m.content)
        key = (m.type, content, calls, getattr(m, "tool_call_id", None))
        if key not in self.memo:
            self.memo[key] = sum(counter().count_message(x) for x in to_compactd([m]))
        return self.memo[key]


def _lc_chars(m: BaseMessage) -> int:
    content = m.content if isinstance(m.content, str) else json.dumps(m.content)
    calls = m.tool_calls if isinstance(m, AIMessage) else []
    return len(content) + sum(len(json.dumps(c.get("args"))) for c in calls)


def run_langchain(session: Session, *, trigger: int, keep: int, trim: int | None
                  ) -> tuple[Tally, Tally]:
    """The peer with ClearToolUsesEdit, and the same run's state as sent without it."""
    tally, plain = Tally(), Tally()
    counter = LCCounter()
    summarizer = LangChainSummarizer()
    model = FakeListChatModel(responses=["(the agent's model is not called)"])
    middleware: SummarizationMiddleware[Any, Any] = SummarizationMiddleware(
        model=model, trigger=("tokens", trigger), keep=("messages", keep),
        token_counter=counter, trim_tokens_to_summarize=trim, summarizer=summarizer)
    editing: ContextEditingMiddleware[Any, Any] = ContextEditingMiddleware(
        edits=[ClearToolUsesEdit(trigger=trigger // 2, keep=CLEAR_KEEP)], token_counter=counter)
    system = SystemMessage("\n\n".join(str(m.get("content") or "") for m in session.system))
    state: list[AnyMessage] = []
    n = 0
    view: list[dict[str, Any]] = []
    raw: list[dict[str, Any]] = []
    for step in session.steps:
        ids = [f"m{n + i + 1}" for i in range(len(step))]
        n += len(step)
        state = add_step(state, to_langchain([wire(m) for m in step], ids=ids))
        summarizer.received = []
        before = list(state)
        update = middleware.before_model({"messages": state}, None)  # type: ignore[arg-type]
        if update is not None:
            _lc_compaction(before, update, summarizer.received, counter, tally)
            state = apply_update(state, update)
        req = ModelRequest(model=model, messages=list(state), system_message=system)
        sent = editing.wrap_model_call(req, lambda r: r.messages)  # type: ignore[arg-type,return-value]
        view = session.system + openai_wire(sent)  # type: ignore[arg-type]
        raw = session.system + openai_wire(state)
        request(tally, view)
        request(plain, raw)
    for name in ("calls", "compactions", "canned", "failed", "input_tokens", "replaced_tokens",
                 "covered_tokens", "replaced_original", "covered_original",
                 "summaries_replaced", "summaries_carried"):
        setattr(plain, name, getattr(tally, name))
    finish(tally, session, view)
    finish(plain, session, raw)
    return tally, plain


def openai_wire(messages: Sequence[BaseMessage]) -> list[dict[str, Any]]:
    """What a LangChain state is sent as: OpenAI chat dicts with the wire keys only."""
    return [wire(m) for m in to_openai(messages)]


def _lc_compaction(before: list[AnyMessage], update: dict[str, Any],
                   received: list[list[BaseMessage]], counter: LCCounter, tally: Tally) -> None:
    tally.compactions += 1
    kept = {m.id for m in update["messages"] if getattr(m, "id", None)}
    new_summary = next((m for m in update["messages"] if is_summary(m)), None)
    if new_summary is not None and any(c in str(new_summary.content) for c in CANNED):
        tally.canned += 1
    tally.calls += len(received)
    got: Counter[str | None] = Counter()
    carried = False
    for messages in received:
        tally.input_tokens += counter(messages)
        for m in messages:
            if is_summary(m):
                carried = True
            else:
                got[m.id] += _lc_chars(m)
    for m in before:
        if m.id in kept:
            continue
        if is_summary(m):
            tally.summaries_replaced += 1
            tally.summaries_carried += carried
            continue
        tokens = counter.one(m)
        chars = _lc_chars(m)
        share = min(1.0, got[m.id] / chars) if chars else float(m.id in got)
        tally.replaced_tokens += tokens
        tally.covered_tokens += tokens * share
        tally.replaced_original += tokens
        tally.covered_original += tokens * share


# ------------------------------------------------------------------------------------ main


SIDES = ("compactd", "langchain", "langchain_summary_only")
KEYS = ["calls", "compactions", "canned", "input_tokens", "final_tokens", "coverage",
        "coverage_of_original", "summary_carried", "tool_pair_errors", "retention"]


def run_config(sessions: list[Session], url: str, *, trigger: int, keep: int, trim: int
               ) -> dict[str, Any]:
    """Both sides over ``sessions`` with one trigger, keep and budget."""
    policy = {"trigger": {"type": "tokens", "value": trigger},
              "keep": {"type": "messages", "value": keep},
              "trim_tokens_to_summarize": trim, "max_summary_tokens": MAX_SUMMARY_TOKENS,
              "render": "langchain"}
    totals = {side: Tally() for side in SIDES}
    groups: dict[str, dict[str, Tally]] = {}
    rows: list[dict[str, Any]] = []
    started = time.perf_counter()
    for i, session in enumerate(sessions, 1):
        cd = asyncio.run(run_compactd(session, url, policy))
        lc, plain = run_langchain(session, trigger=trigger, keep=keep, trim=trim)
        row: dict[str, Any] = {"session": session.name, "group": session.group,
                               "tokens": session.tokens, "steps": len(session.steps),
                               "parts": session.parts}
        for side, tally in zip(SIDES, (cd, lc, plain), strict=True):
            totals[side].add(tally)
            groups.setdefault(session.group, {s: Tally() for s in SIDES})[side].add(tally)
            row[side] = {**tally.report(), "missing": tally.missing}
        rows.append(row)
        if session.group in ("long", "sample") or i % 25 == 0:
            print(f"  trigger {trigger}: {i}/{len(sessions)} {session.name}: {session.tokens} "
                  f"tokens, compactd {cd.compactions} compactions / langchain {lc.compactions}"
                  f" ({time.perf_counter() - started:.0f} s)", flush=True)
    out: dict[str, Any] = {
        "trigger_tokens": trigger, "keep_messages": keep, "trim_tokens_to_summarize": trim,
        "clear_tool_uses": {"trigger": trigger // 2, "keep": CLEAR_KEEP},
        "sessions_count": len(sessions),
        **{side: totals[side].report() for side in SIDES},
        "by_group": {g: {s: t.report() for s, t in sides.items()} for g, sides in groups.items()},
        "seconds": round(time.perf_counter() - started, 1),
    }
    cd_r, lc_r = out["compactd"], out["langchain"]
    out["goals"] = {
        "compactd_coverage_100": cd_r["coverage"] in (None, 1.0),
        "compactd_zero_tool_pair_errors": cd_r["tool_pair_errors"] == 0,
        "compactd_retention_above_peer": (cd_r["retention"] or 0) > (lc_r["retention"] or 0),
    }
    out["sessions"] = rows
    return out


def print_config(result: dict[str, Any]) -> None:
    print(f"\ntrigger {result['trigger_tokens']} tokens, keep {result['keep_messages']} "
          f"messages, trim {result['trim_tokens_to_summarize']} tokens: "
          f"{result['sessions_count']} sessions")
    table = []
    for group in [*sorted(result["by_group"]), "all"]:
        for side in SIDES:
            r = result[side] if group == "all" else result["by_group"][group][side]
            table.append([group, side, *[r[k] for k in KEYS]])
    print_table(["group", "side", *KEYS], table)
    print("goals: " + ", ".join(f"{k} {'ok' if v else 'MISSED'}"
                                for k, v in result["goals"].items()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS)
    parser.add_argument("--triggers", default="4000,16000",
                        help="comma-separated trigger token counts; the first is the headline")
    parser.add_argument("--keep", type=int, default=6, help="keep, messages")
    parser.add_argument("--trim", type=int, default=4000,
                        help="summarizer input budget, tokens (both sides)")
    parser.add_argument("--limit", type=int, default=0,
                        help="only the first N corpus files (a quick look)")
    args = parser.parse_args(argv)
    if not sorted(args.corpus.glob("*/*.jsonl")):
        print(f"no transcripts under {args.corpus}", file=sys.stderr)
        return 2
    # The orchestration logs every loop-guard flag; here sessions are driven in process.
    logging.getLogger("compactd.worker").setLevel(logging.ERROR)
    info = machine()
    triggers = [int(t) for t in args.triggers.split(",") if t.strip()]
    sessions = all_sessions(args.corpus, args.limit)
    results = []
    with tempfile.TemporaryDirectory(prefix="compactd-corpus-") as tmp:
        for n, trigger in enumerate(triggers):
            # A session that never reaches the trigger is the same on both sides: the
            # headline counts it, the other configurations leave it out.
            chosen = sessions if n == 0 else [s for s in sessions if s.tokens > trigger]
            url = prepare_sqlite(Path(tmp) / f"t{trigger}")
            results.append(run_config(chosen, url, trigger=trigger, keep=args.keep,
                                      trim=args.trim))
    head = results[0]
    report: dict[str, Any] = {
        "machine": info, "corpus": str(args.corpus),
        "config": {"trigger_tokens": triggers[0], "keep_messages": args.keep,
                   "trim_tokens_to_summarize": args.trim,
                   "max_summary_tokens": MAX_SUMMARY_TOKENS,
                   "clear_tool_uses": {"trigger": triggers[0] // 2, "keep": CLEAR_KEEP},
                   "summarizer": "compactd.worker.llm.local.summarize_local (both sides)",
                   "token_counter": "o200k (compactd's, both sides)"},
        **{side: head[side] for side in SIDES},
        "goals": head["goals"], "ok": all(all(r["goals"].values()) for r in results),
        "configs": results,
    }
    print(f"machine: {machine_line(info)}")
    print("summarizer: compactd's local one on both sides; tokens: o200k on both sides")
    for result in results:
        print_config(result)
    write_json(args.json, report)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
