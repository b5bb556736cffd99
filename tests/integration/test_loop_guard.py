"""The loop guard and its metrics, in process on the embedded SQLite with the local summarizer.

A session whose kept tail alone is over its trigger is compacted again after every step of the
agent and never relieved. The second committed run within the window must flag it (with
``max_compactions: 1``) and count the flag, whatever round the run ended in.
"""

from __future__ import annotations

from pathlib import Path

from compactd.storage.messages import Message, parse_openai
from compactd.worker.metrics import metrics
from compactd.worker.orchestration import compact
from compactd.worker.runtime import open_deps
from compactd.worker.settings import Settings, build_config

BIG = " ".join(f"ledger{i} entry rounding" for i in range(300))


def step(n: int) -> list[Message]:
    """One agent step: small talk, then two large messages that the keep policy keeps."""
    small = [parse_openai({"role": "user" if i % 2 == 0 else "assistant",
                           "content": f"step {n} message {i} " + "x y z " * 30})
             for i in range(10)]
    return [*small, parse_openai({"role": "assistant", "content": f"step {n}: {BIG}"}),
            parse_openai({"role": "user", "content": f"step {n} again: {BIG}"})]


def _sample(name: str, **labels: str) -> float:
    value = metrics().registry.get_sample_value(name, labels or None)
    return value or 0.0


async def test_a_session_never_relieved_is_flagged_and_counted(tmp_path: Path) -> None:
    # clear_at_least 0: by default a summary that cannot relieve the session and frees little
    # is not asked for (test_low_trigger.py); the loop guard is the net when one is committed.
    raw = {"summarization": {"trigger": [{"type": "tokens", "value": 1000}],
                             "keep": {"type": "messages", "value": 2}, "clear_at_least": 0},
           "worker": {"loop_guard": {"max_compactions": 1, "margin": 0.0}}}
    config = build_config(raw, settings=Settings(home=str(tmp_path)), home=tmp_path)
    flags_before = _sample("compactd_loop_guard_flags_total")
    observed_before = _sample("compactd_session_compactions_count")
    async with open_deps(config, owner="test") as deps:
        await deps.store.create_session("s1", run_model="gpt-4o")
        outcomes = []
        for n in range(2):
            await deps.store.append("s1", step(n))
            out = await compact(deps, "s1", trigger="pressure")
            outcomes.append((out.outcome, "summary" in out.stages))
            assert out.tokens_after is not None and out.tokens_after > 1000, "never relieved"
        info = await deps.store.get_session("s1")
    assert outcomes == [("committed", True), ("committed", True)]
    assert info.flagged_reason is not None and "without pressure falling" in info.flagged_reason
    assert info.cooldown_until is not None
    assert _sample("compactd_loop_guard_flags_total") == flags_before + 1
    # Compactions per session: observed at the end of each committed summary run.
    assert _sample("compactd_session_compactions_count") == observed_before + 2


async def test_a_session_brought_under_its_trigger_but_not_by_the_margin_is_flagged(
        tmp_path: Path) -> None:
    # Every run gets the session under its trigger, and under the default margin's relief too;
    # with margin 0.99 relief is pressure below a hundredth of the trigger, which none reaches.
    raw = {"summarization": {"trigger": [{"type": "tokens", "value": 2000}],
                             "keep": {"type": "messages", "value": 2}, "clear_at_least": 0},
           "worker": {"loop_guard": {"max_compactions": 1, "margin": 0.99}}}
    config = build_config(raw, settings=Settings(home=str(tmp_path)), home=tmp_path)
    async with open_deps(config, owner="test") as deps:
        await deps.store.create_session("s1", run_model="gpt-4o")
        for n in range(2):
            await deps.store.append("s1", step(n)[:10] * 4)
            out = await compact(deps, "s1", trigger="pressure")
            assert out.outcome == "committed", out
            assert out.tokens_after is not None and out.tokens_after < 1800, out.tokens_after
        info = await deps.store.get_session("s1")
    assert info.flagged_reason is not None and "without pressure falling" in info.flagged_reason
