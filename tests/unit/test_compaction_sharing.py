"""The call that shares the agent's prompt cache: what it sends, where its prefix ends, what
bounds it, the switch, and the breakpoints an Anthropic call carries."""

from __future__ import annotations

from pathlib import Path

import pytest

from compactd.worker.compaction.planner import plan
from compactd.worker.compaction.policy import PolicyError, parse_policy
from compactd.worker.compaction.render import render_surface
from compactd.worker.compaction.sharing import (
    WIRE_KEYS,
    CacheHints,
    cache_readable,
    kept_note,
    prefix_end,
    shared_call,
)
from compactd.worker.llm.anthropic_provider import anthropic_messages, with_breakpoints
from compactd.worker.settings import load_config
from tests.support.surfaces import COUNTER, NOW, ai, ckpt, nodes, tool, user

REPO = Path(__file__).resolve().parents[2]
ENVELOPE = {"system": "You are an agent.", "tools": [{"name": "bash"}],
            "prompt_cache_key": "agent-1"}


def _policy(window: int | None = None, **raw):
    base = {"trigger": ["tokens", 10], "keep": {"type": "messages", "value": 2}}
    return parse_policy({**base, **raw}).resolve(window)


def _surface():
    return nodes(ckpt("earlier work on the parser"), user("fix the parser " * 20),
                 ai("reading", ("c1", "cat", {"path": "p.py"})), tool("c1", "x = 1\n" * 40),
                 ai("found it " * 20), user("go on"), ai("done"))


def _step(surface, policy):
    step = plan(surface, policy=policy, now=NOW).summarize
    assert step is not None
    return step


def test_the_instruction_names_the_request_that_stays_inside_the_range():
    # "go on" is the latest request; the work before it and after it is one range.
    surface = nodes(user("fix the parser " * 20), ai("found it " * 20), user("go on"),
                    ai("patched " * 20), ai("tests pass " * 20), ai("done"))
    policy = _policy()
    step = _step(surface, policy)
    assert step.kept_inside == (surface[2].seq,)
    assert step.replace_seqs == (surface[0].seq, surface[1].seq, surface[3].seq)
    call = shared_call(surface, step.replace_seqs, policy, ENVELOPE, 10, COUNTER,
                       step.kept_inside)
    assert call is not None
    instruction = call.chat[-1]["content"]
    assert 'the user message "go on"' in instruction
    assert "word for word, before your summary" in instruction
    assert call.kept == 2


def test_the_call_is_the_envelope_the_served_surface_then_the_instruction():
    surface = _surface()
    policy = _policy()
    step = _step(surface, policy)
    call = shared_call(surface, step.replace_seqs, policy, ENVELOPE, 10, COUNTER)
    assert call is not None
    served = [{k: m[k] for k in WIRE_KEYS if k in m} for m in render_surface(surface)]
    assert list(call.chat) == [{"role": "system", "content": "You are an agent."}, *served,
                               call.chat[-1]]
    # the checkpoint as served (rendered, the authority contract in place), not a transcript
    assert "<turn" not in str(call.chat[:-1])
    assert call.chat[-1]["role"] == "user" and kept_note(2) in call.chat[-1]["content"]
    assert (call.prefix_messages, call.kept) == (len(surface), 2)
    assert call.tools == ({"name": "bash"},)
    assert call.cache == CacheHints(prompt_cache_key="agent-1")


def test_the_prefix_ends_before_a_turn_still_waiting_for_its_results():
    surface = nodes(user("task " * 50), ai("a " * 50), user("more " * 50), ai("b " * 50),
                    user("go"), ai("", ("c9", "bash")))
    assert prefix_end(surface) == 5
    policy = _policy()
    step = _step(surface, policy)
    call = shared_call(surface, step.replace_seqs, policy, None, 0, COUNTER)
    assert call is not None and call.prefix_messages == 5
    assert call.kept == 5 - (surface.index(next(n for n in surface
                                                if n.seq == step.replace_seqs[-1])) + 1)
    assert "system" not in {m["role"] for m in call.chat}


def test_the_run_models_window_bounds_the_call_not_the_summarizer_budget():
    surface = _surface()
    total = sum(n.tokens for n in surface)
    roomy = _policy(window=total + 3000, max_summary_tokens=500, trim_tokens_to_summarize=300)
    step = _step(surface, _policy(window=total + 3000, max_summary_tokens=500))
    # a budget smaller than the surface does not stop it: the agent sends all of it already
    assert shared_call(surface, step.replace_seqs, roomy, None, 0, COUNTER) is not None
    # the window must hold the prefix, the instruction and the summary it writes
    tight = _policy(window=total + 400, max_summary_tokens=500)
    assert shared_call(surface, step.replace_seqs, tight, None, 0, COUNTER) is None
    # the envelope counts too
    assert shared_call(surface, step.replace_seqs, roomy, None, 3000, COUNTER) is None


def test_the_switch_is_a_boolean_named_in_the_error_and_on_by_default():
    assert parse_policy({}).share_cache is True
    assert parse_policy({"share_cache": False}).share_cache is False
    with pytest.raises(PolicyError, match=r"summarization\.share_cache"):
        parse_policy({"share_cache": "yes"})
    assert parse_policy(parse_policy({"share_cache": False}).to_config()).share_cache is False
    example = load_config({}, path=str(REPO / "ops" / "compactd.example.yaml"))
    assert example.policy.share_cache is True


def test_hints_come_from_the_envelope_only_when_set():
    assert CacheHints.of(None) is None
    assert CacheHints.of({"system": "s", "prompt_cache_key": ""}) is None
    assert CacheHints.of({"cache_control": {"type": "ephemeral"}}) == CacheHints(
        cache_control={"type": "ephemeral"})


def test_an_anthropic_call_carries_the_runtimes_breakpoints_and_none_on_the_instruction():
    chat = [{"role": "system", "content": "You are an agent."},
            {"role": "user", "content": "task"}, {"role": "assistant", "content": "done"},
            {"role": "user", "content": "Summarize the conversation above."}]
    system, messages = anthropic_messages(chat)
    control = {"type": "ephemeral"}
    blocks, marked = with_breakpoints(system, messages, control)
    assert blocks == [{"type": "text", "text": "You are an agent.", "cache_control": control}]
    assert marked[:1] == messages[:1]
    assert marked[1] == {"role": "assistant", "content": [
        {"type": "text", "text": "done", "cache_control": control}]}
    assert marked[2] == messages[2] == {"role": "user",
                                        "content": "Summarize the conversation above."}


def test_an_anthropic_call_shares_only_with_the_runtimes_breakpoints():
    # Anthropic caches at breakpoints only: without them a shared call would read nothing
    # cached and pay the whole surface; OpenAI caches long prefixes on its own.
    assert cache_readable("openai", None) and cache_readable("openai-compatible", {})
    assert not cache_readable("anthropic", None)
    assert not cache_readable("anthropic", {"prompt_cache_key": "k"})
    assert cache_readable("anthropic", {"cache_control": {"type": "ephemeral"}})
