"""The wait for growth after a run that could not relieve its session, on both backends: the
run's end writes the mark on the session row, the append's signal, the sweep's decision and the
follow-up hold back below it, and a replacing commit since makes it stale."""

from __future__ import annotations

import dataclasses

from compactd.storage.kinds import RunStatus
from compactd.storage.messages import Message, parse_openai
from compactd.storage.records import Claim, RunEnd
from compactd.storage.store import Store
from compactd.worker.pressure import over_trigger, wants_run
from compactd.worker.settings import build_config

CONFIG = build_config({"summarization": {"trigger": {"type": "tokens", "value": 300},
                                         "keep": {"type": "messages", "value": 2}, "lead": 0}})


def words(n: int, i: int = 0) -> Message:
    return parse_openai({"role": "user", "content": " ".join(f"w{i}x{k}" for k in range(n))})


async def test_a_run_that_could_not_relieve_holds_the_session_back_until_it_grows(
        store: Store) -> None:
    await store.create_session("s1", run_model="gpt-4o")
    info = (await store.append("s1", [words(500)])).session
    assert wants_run(info, CONFIG) and over_trigger(info, CONFIG)
    claim = await store.claim("s1", owner="w", trigger="pressure", lease_s=30)
    assert isinstance(claim, Claim)
    refire = info.surface_tokens + 100
    assert await store.finish("s1", run_id=claim.run_id, fence=claim.fence,
                              end=RunEnd(outcome=RunStatus.NOTHING_TO_DO,
                                         refire=(refire, info.compacted_version)))
    held = await store.get_session("s1")
    assert (held.refire_tokens, held.refire_version) == (refire, info.compacted_version)
    assert not wants_run(held, CONFIG) and not over_trigger(held, CONFIG)

    small = (await store.append("s1", [words(20, 1)])).session
    assert small.surface_tokens < refire
    assert not wants_run(small, CONFIG) and not over_trigger(small, CONFIG)
    grown = (await store.append("s1", [words(120, 2)])).session
    assert grown.surface_tokens >= refire
    assert wants_run(grown, CONFIG) and over_trigger(grown, CONFIG)

    # A commit that replaced part of the surface since (another compacted_version): stale.
    stale = dataclasses.replace(small, compacted_version=(small.compacted_version or 0) + 1)
    assert wants_run(stale, CONFIG) and over_trigger(stale, CONFIG)


async def test_a_session_waiting_for_growth_fires_at_its_window_whatever_it_waits_for(
        store: Store) -> None:
    """The wait is a saving on runs that change nothing, never a reason to let a session reach
    its context window: there a run summarizes whatever it frees."""
    await store.create_session("s2", run_model="gpt-4o", context_window=5_000)
    info = (await store.append("s2", [words(500)])).session
    claim = await store.claim("s2", owner="w", trigger="pressure", lease_s=30)
    assert isinstance(claim, Claim)
    # A growth to wait for that ends past the window (a rest over the trigger by itself).
    refire = 10_000
    assert await store.finish("s2", run_id=claim.run_id, fence=claim.fence,
                              end=RunEnd(outcome=RunStatus.NOTHING_TO_DO,
                                         refire=(refire, info.compacted_version)))
    held = (await store.append("s2", [words(20, 1)])).session
    assert held.surface_tokens < 5_000
    assert not wants_run(held, CONFIG) and not over_trigger(held, CONFIG)
    full = (await store.append("s2", [words(800, 2)])).session
    assert 5_000 <= full.surface_tokens < refire
    assert wants_run(full, CONFIG) and over_trigger(full, CONFIG)
