"""``compactd demo``: the embedded default, end to end, on a bare machine.

A generated coding-agent session (large tool outputs, planted facts) goes into the SQLite file;
the same orchestration a worker runs compacts it under the lease protocol with the local
summarizer; the demo prints what each stage did and the checkpoint the agent would now read, and
ends by recalling a planted fact the checkpoint dropped from the originals the log still holds.
"""

from __future__ import annotations

import datetime as dt

from scheduler.output import emit, say
from scheduler.samples import coding_session
from storage.kinds import RunCause, Stage
from storage.messages import parse_openai
from worker.compaction.render import render_surface
from worker.orchestration import compact
from worker.runtime import open_deps
from worker.settings import Config

DEMO_WINDOW = 128_000
# The demo session's own policy: low enough that the sample (about 60k tokens) is over it.
DEMO_POLICY = {"trigger": [{"type": "tokens", "value": 20_000}],
               "keep": {"type": "messages", "value": 12}}


async def run_demo(config: Config, *, steps: int, as_json: bool) -> int:
    sample = coding_session(steps=steps)
    session_id = "demo-" + dt.datetime.now(dt.UTC).strftime("%Y%m%d-%H%M%S-%f")
    async with open_deps(config, owner="compactd-demo") as deps:
        store = deps.store
        await store.create_session(session_id, context_window=DEMO_WINDOW, policy=DEMO_POLICY)
        appended = await store.append(session_id, [parse_openai(m) for m in sample.messages])
        before = appended.session
        outcome = await compact(deps, session_id, trigger=RunCause.PRESSURE)
        surface = await store.read_surface(session_id)
        verified = await store.verify(session_id)
        rendered = render_surface(surface.nodes)
        checkpoint = next((m for m in rendered
                           if (m.get("meta") or {}).get("checkpoint") and m["role"] == "user"),
                          None)
        planted = [f for facts in sample.facts.values() for f in facts]
        kept = [f for f in planted if checkpoint and f in str(checkpoint["content"])]
        # A detail the summary dropped: a planted fact on the surface nowhere (not in the
        # checkpoint, not in the kept tail), else a line of a tool's output naming one.
        shown = "\n".join(str(m) for m in rendered)
        dropped = [f for f in planted if f not in shown] or [
            line.strip() for m in sample.messages if m.get("role") == "tool"
            for line in str(m.get("content") or "").splitlines()
            if line.strip() not in shown and any(f in line for f in planted)]
        recalled = None
        if checkpoint is not None and dropped:
            found = await store.history_search(session_id, dropped[0], limit=1)
            recalled = (dropped[0], found.hits[0] if found.hits else None)
    ok = not outcome.failed and verified.ok and (recalled is None or recalled[1] is not None)
    if as_json:
        emit({"session": session_id, "database": config.database_url,
              "messages_before": before.surface_messages, "tokens_before": before.surface_tokens,
              "messages_after": len(surface.nodes), "tokens_after": surface.tokens,
              "outcome": outcome.to_json(), "verified": verified.ok,
              "facts_kept": len(kept), "facts_planted": len(planted),
              "recalled": None if recalled is None else {
                  "detail": recalled[0],
                  "hit": recalled[1].to_json() if recalled[1] is not None else None}})
        return 0 if ok else 1
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
        f"({len(surface.nodes)} nodes now); log replay check: "
        f"{'ok' if verified.ok else 'FAILED'}")
    say(f"  planted facts still in the checkpoint: {len(kept)}/{len(planted)}")
    if checkpoint is not None:
        say("")
        say("checkpoint the agent reads at its next step:")
        say("-" * 72)
        say(str(checkpoint["content"]))
        say("-" * 72)
    if recalled is not None:
        detail, hit = recalled
        say("")
        say(f"recall: {detail!r} is on the surface no more; history_search finds it "
            + (f"in the originals of {hit.checkpoint}, message {hit.seq}:" if hit else
               "nowhere (the index missed it)"))
        if hit is not None:
            for line in hit.snippet.splitlines()[:3]:
                say(f"  | {line}")
            say(f"  (history_read(checkpoint=\"{hit.checkpoint}\") returns the whole original)")
    return 0 if ok else 1
