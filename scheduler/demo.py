"""``compactd demo``: the embedded default, end to end, on a bare machine.

A generated coding-agent session (large tool outputs, planted facts) goes into the SQLite file;
the same orchestration a worker runs compacts it under the lease protocol with the local
summarizer; the demo prints what each stage did and the checkpoint the agent would now read, and
ends by recalling a planted fact the checkpoint dropped from the originals the log still holds.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

from compactd.scheduler.output import emit, say
from compactd.scheduler.samples import SampleSession, coding_session
from compactd.storage.kinds import RunCause, Stage
from compactd.storage.messages import parse_openai
from compactd.storage.recall import SearchHit
from compactd.storage.records import SessionInfo, VerifyResult
from compactd.storage.surface import Surface
from compactd.worker.compaction.render import render_surface
from compactd.worker.orchestration import compact
from compactd.worker.run import Outcome
from compactd.worker.runtime import open_deps
from compactd.worker.settings import Config

DEMO_WINDOW = 128_000
# The demo session's own policy: low enough that the sample (about 60k tokens) is over it.
DEMO_POLICY = {"trigger": [{"type": "tokens", "value": 20_000}],
               "keep": {"type": "messages", "value": 12}}


@dataclass
class _Demo:
    """What the demo did and found, for either output."""

    session_id: str
    before: SessionInfo
    outcome: Outcome
    surface: Surface
    verified: VerifyResult
    checkpoint: dict[str, Any] | None
    kept: list[str]
    planted: list[str]
    recalled: tuple[str, SearchHit | None] | None

    @property
    def ok(self) -> bool:
        return (not self.outcome.failed and self.verified.ok
                and (self.recalled is None or self.recalled[1] is not None))


async def run_demo(config: Config, *, steps: int, as_json: bool) -> int:
    demo = await _run(config, steps)
    if as_json:
        _emit_json(demo, config)
    else:
        _say_text(demo, config)
    return 0 if demo.ok else 1


async def _run(config: Config, steps: int) -> _Demo:
    sample = coding_session(steps=steps)
    session_id = "demo-" + dt.datetime.now(dt.UTC).strftime("%Y%m%d-%H%M%S-%f")
    async with open_deps(config, owner="compactd-demo") as deps:
        store = deps.store
        await store.create_session(session_id, context_window=DEMO_WINDOW, policy=DEMO_POLICY)
        appended = await store.append(session_id, [parse_openai(m) for m in sample.messages])
        outcome = await compact(deps, session_id, trigger=RunCause.PRESSURE)
        surface = await store.read_surface(session_id)
        verified = await store.verify(session_id)
        rendered = render_surface(surface.nodes)
        checkpoint = next((m for m in rendered
                           if (m.get("meta") or {}).get("checkpoint") and m["role"] == "user"),
                          None)
        planted = [f for facts in sample.facts.values() for f in facts]
        kept = [f for f in planted if checkpoint and f in str(checkpoint["content"])]
        dropped = _dropped(sample, planted, rendered)
        recalled = None
        if checkpoint is not None and dropped:
            found = await store.history_search(session_id, dropped[0], limit=1)
            recalled = (dropped[0], found.hits[0] if found.hits else None)
    return _Demo(session_id, appended.session, outcome, surface, verified, checkpoint, kept,
                 planted, recalled)


def _dropped(sample: SampleSession, planted: list[str],
             rendered: list[dict[str, Any]]) -> list[str]:
    """Details the summary dropped: planted facts on the surface nowhere (not in the
    checkpoint, not in the kept tail), else lines of a tool's output naming one."""
    shown = "\n".join(str(m) for m in rendered)
    return [f for f in planted if f not in shown] or [
        line.strip() for m in sample.messages if m.get("role") == "tool"
        for line in str(m.get("content") or "").splitlines()
        if line.strip() not in shown and any(f in line for f in planted)]


def _emit_json(demo: _Demo, config: Config) -> None:
    before, surface, recalled = demo.before, demo.surface, demo.recalled
    emit({"session": demo.session_id, "database": config.database_url,
          "messages_before": before.surface_messages, "tokens_before": before.surface_tokens,
          "messages_after": len(surface.nodes), "tokens_after": surface.tokens,
          "outcome": demo.outcome.to_json(), "verified": demo.verified.ok,
          "facts_kept": len(demo.kept), "facts_planted": len(demo.planted),
          "recalled": None if recalled is None else {
              "detail": recalled[0],
              "hit": recalled[1].to_json() if recalled[1] is not None else None}})


def _say_text(demo: _Demo, config: Config) -> None:
    before, outcome = demo.before, demo.outcome
    say(f"compactd demo - embedded default: {config.database_url}")
    say(f"  a generated coding-agent session: {before.surface_messages} messages, "
        f"{before.surface_tokens} tokens (trigger: 20000 tokens, keep the last 12 messages)")
    say("")
    say(f"compaction {outcome.outcome}"
        + (f" ({outcome.failure_class}: {outcome.error})" if outcome.failed else ""))
    if Stage.PRUNE in outcome.stages:
        say(f"  stage 1, prune (no model call): {outcome.pruned} large tool results cut to "
            "head + marker + tail")
    if Stage.SUMMARY in outcome.stages:
        say(f"  stage 2, summary ({outcome.model} summarizer): {len(outcome.replaced_seqs)} "
            "nodes replaced by one checkpoint")
    say(f"  tokens: {outcome.tokens_before} -> {outcome.tokens_after} "
        f"({len(demo.surface.nodes)} nodes now); log replay check: "
        f"{'ok' if demo.verified.ok else 'FAILED'}")
    say(f"  planted facts still in the checkpoint: {len(demo.kept)}/{len(demo.planted)}")
    if demo.checkpoint is not None:
        say("")
        say("checkpoint the agent reads at its next step:")
        say("-" * 72)
        say(str(demo.checkpoint["content"]))
        say("-" * 72)
    if demo.recalled is not None:
        _say_recall(*demo.recalled)


def _say_recall(detail: str, hit: SearchHit | None) -> None:
    say("")
    say(f"recall: {detail!r} is on the surface no more; history_search finds it "
        + (f"in the originals of {hit.checkpoint}, message {hit.seq}:" if hit else
           "nowhere (the index missed it)"))
    if hit is not None:
        for line in hit.snippet.splitlines()[:3]:
            say(f"  | {line}")
        say(f"  (history_read(checkpoint=\"{hit.checkpoint}\") returns the whole original)")
