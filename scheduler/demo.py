"""``compactd demo``: the embedded default, end to end, on a bare machine."""

from __future__ import annotations

import datetime as dt
import json

from scheduler.cli import emit, open_store, say
from scheduler.samples import coding_session
from storage.messages import parse_openai
from worker.settings import Config

DEMO_RUN_MODEL = "gpt-4o"
DEMO_WINDOW = 128_000


async def run_demo(config: Config, *, steps: int, as_json: bool) -> int:
    sample = coding_session(steps=steps)
    session_id = "demo-" + dt.datetime.now(dt.UTC).strftime("%Y%m%d-%H%M%S-%f")
    messages = [parse_openai(m) for m in sample.messages]
    async with open_store(config) as store:
        await store.create_session(session_id, run_model=DEMO_RUN_MODEL,
                                   context_window=DEMO_WINDOW)
        await store.append(session_id, messages)
        surface = await store.read_surface(session_id)
    if as_json:
        emit({"session": session_id, "database": config.database_url,
              "messages": len(surface.nodes), "tokens": surface.tokens})
        return 0
    say(f"compactd demo: database {config.database_url}")
    say(f"session {session_id}: {len(surface.nodes)} messages, {surface.tokens} tokens "
        f"(run model {DEMO_RUN_MODEL}, window {DEMO_WINDOW})")
    for node in surface.nodes:
        text = node.message.text or json.dumps([c.name for c in node.message.tool_calls])
        say(f"{node.seq:>5} {node.role:<9} {node.tokens:>6}  {' '.join(text.split())[:70]}")
    say(f"total: {surface.tokens} tokens")
    return 0
