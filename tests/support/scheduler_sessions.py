"""Configurations and sessions for the scheduler's decisions in this process (no worker): a
trigger of a few hundred tokens, texts of an exact token count, a session just over its trigger.

    config = make_config(db_url)
    handle = await over(client, "s1")      # over the trigger, its signal mark free
"""

from __future__ import annotations

from typing import Any

from compactd.scheduler.client import CompactdClient, SessionHandle
from compactd.storage.store import Store
from compactd.worker.limits import LocalLimiter
from compactd.worker.runtime import Deps
from compactd.worker.settings import Config, Settings, build_config

TRIGGER = 400


def make_config(db_url: str, *, broker: str = "memory://", trigger: int = TRIGGER,
                keep: int = 2, worker: dict[str, Any] | None = None,
                summarization: dict[str, Any] | None = None) -> Config:
    # The step lead off: these sessions' single appends are large next to their trigger, and
    # their tests place the firing append at the trigger (tests/unit/test_compaction_lead.py
    # and tests/acceptance/test_lead.py test the step lead).
    raw = {"summarization": {"trigger": {"type": "tokens", "value": trigger},
                             "keep": {"type": "messages", "value": keep},
                             "lead_steps": False, **(summarization or {})},
           "worker": {"metrics_port": 0, **(worker or {})}}
    return build_config(raw, settings=Settings(database_url=db_url, broker_url=broker))


WORDS = ("apple", "river", "stone", "cloud", "green", "table", "light", "house", "water", "paper")


def text(tokens: int, tag: str = "") -> str:
    # One token per word for these common words (o200k and cl100k); the tag keeps texts apart.
    body = " ".join(WORDS[i % len(WORDS)] for i in range(tokens - 1 if tag else tokens))
    return f"{tag} {body}" if tag else body


def user(tokens: int, tag: str = "") -> dict[str, Any]:
    return {"role": "user", "content": text(tokens, tag)}


async def over(client: CompactdClient, sid: str = "s1", **kw: Any) -> SessionHandle:
    """A session over the trigger whose signal mark is free (as after a lost signal)."""
    handle = await client.create_session(sid, run_model="gpt-4o", **kw)
    await client.store.append(sid, [parsed(user(TRIGGER + 50))])
    return handle


def parsed(raw: dict[str, Any]) -> Any:
    """The OpenAI-shaped message as compactd stores it."""
    from compactd.storage.messages import parse_openai

    return parse_openai(raw)


def deps_for(config: Config, store: Store) -> Deps:
    return Deps(config=config, store=store, limiter=LocalLimiter(), owner="test-worker")
