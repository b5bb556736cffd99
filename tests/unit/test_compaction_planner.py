"""The plan as a whole: gating, pruning before summarizing, the JSON contract, re-planning."""

from __future__ import annotations

import json
import time

import pytest

from compactd.storage.surface import SurfaceNode
from compactd.storage.tokens import counter_for
from compactd.worker.compaction.planner import checkpoint_for, plan, replan_smaller
from compactd.worker.compaction.policy import Clause, parse_policy
from compactd.worker.compaction.prompt import estimate, kept_piece
from compactd.worker.compaction.render import Skill, checkpoint_tokens
from tests.support.surfaces import NOW, ai, ckpt, nodes, sys, tool, user


def _policy(**raw):
    base = {"trigger": ["tokens", 200], "keep": {"type": "messages", "value": 2}}
    return parse_policy({**base, **raw}).resolve(None)


def _chat(turns=6, size=20):
    out = [sys()]
    for i in range(turns):
        out += [user(f"question {i} " + "detail " * size), ai(f"answer {i} " + "words " * size)]
    return nodes(*out)


def test_under_the_trigger_nothing_to_do():
    surface = _chat(turns=1)
    result = plan(surface, policy=_policy(), now=NOW)
    assert not result.fired and result.summarize is None and result.prune == ()
    assert result.nothing_to_do is not None and "did not fire" in result.nothing_to_do
    assert result.to_json()["summarize"] is None


def test_pruning_alone_brings_pressure_under_the_trigger():
    surface = nodes(sys(), user("read it"), ai("", ("c1", "cat")), tool("c1", "data " * 6000),
                    ai("done"))
    before = sum(n.tokens for n in surface)
    result = plan(surface, policy=_policy(trigger=["tokens", 3000]), now=NOW)
    assert result.fired and before > 3000
    [action] = result.prune
    assert action.seq == 4 and action.tokens_after < action.tokens_before
    assert result.tokens_after_prune == before - action.saved < 3000
    assert result.summarize is None and result.nothing_to_do is None
    assert result.why_no_summary == "pruning alone brought pressure under the trigger"


def test_prune_then_summarize_reads_the_pruned_text():
    surface = nodes(sys(), user("read it"), ai("", ("c1", "cat")), tool("c1", "data " * 6000),
                    ai("done " * 50), user("next"), ai("ok"))
    result = plan(surface, policy=_policy(trigger=["tokens", 300],
                                          trim_tokens_to_summarize=None), now=NOW)
    step = result.summarize
    assert step is not None and result.prune
    piece = next(p for p in step.calls[0].pieces if p.seq == 4)
    assert "tool result middle pruned" in piece.message.text
    assert step.replaced_tokens == sum(n.tokens for n in surface if n.seq in (2, 3, 5)) + (
        result.prune[0].tokens_after)


def test_a_deferred_summary_is_left_for_the_pruned_surface():
    """What a worker asks first: the prunes, and whether a summary must follow them."""
    surface = nodes(sys(), user("read it"), ai("", ("c1", "cat")), tool("c1", "data " * 6000),
                    ai("done " * 50), user("next"), ai("ok"))
    policy = _policy(trigger=["tokens", 300], trim_tokens_to_summarize=None)
    full = plan(surface, policy=policy, now=NOW)
    first = plan(surface, policy=policy, now=NOW, defer_summary=True)
    assert first.prune == full.prune and first.summary_deferred
    assert first.summarize is None and first.nothing_to_do is None
    # Relieved by pruning alone, or nothing to prune: the plan is the full one.
    relieved = plan(surface, policy=_policy(trigger=["tokens", 3000]), now=NOW,
                    defer_summary=True)
    assert relieved.prune and not relieved.summary_deferred
    assert relieved.why_no_summary == "pruning alone brought pressure under the trigger"
    chat = _chat()
    assert plan(chat, policy=_policy(), now=NOW, defer_summary=True) == plan(
        chat, policy=_policy(), now=NOW)


def test_forced_plan_ignores_trigger_and_keep():
    surface = _chat(turns=3, size=40)  # room for the checkpoint's footer
    result = plan(surface, policy=_policy(trigger=["tokens", 10**6]), now=NOW, force=True)
    assert not result.fired and result.forced
    assert result.summarize is not None
    # plain chat: the last assistant message and the latest request stay
    assert result.summarize.keep_seqs == (1, 6, 7)


def test_forced_with_everything_protected_is_nothing_to_do():
    surface = nodes(sys(), user("only the request"), ai("", ("c1", "bash")))
    result = plan(surface, policy=_policy(), now=NOW, force=True)
    assert result.summarize is None and result.nothing_to_do


def test_json_contract():
    surface = _chat()
    data = plan(surface, policy=_policy(), now=NOW).to_json()
    json.dumps(data)
    assert set(data) >= {"pressure", "trigger", "prune", "tokens_after_prune", "summarize"}
    assert set(data["pressure"]) == {"tokens", "messages", "fraction"}
    assert set(data["trigger"]) == {"fired", "reason"}
    summarize = data["summarize"]
    assert set(summarize) >= {"replace_seqs", "keep_seqs", "calls"}
    assert all(set(c) >= {"seqs", "input_tokens"} for c in summarize["calls"])
    assert sorted(summarize["replace_seqs"] + summarize["keep_seqs"]) == [n.seq for n in surface]


def test_existing_checkpoint_and_skills_carry_into_the_plan():
    skill = Skill("pdf", "/mnt/skills/pdf/SKILL.md", "PDFs", 2)
    surface = nodes(sys(), ckpt("We did X.", [skill]), user("q " * 80), ai("a " * 80),
                    user("latest"), ai("z"))
    step = plan(surface, policy=_policy(trigger=["tokens", 100]), now=NOW).summarize
    assert step is not None
    assert step.existing_summary == "We did X."
    assert step.skills == (skill,)
    message = checkpoint_for(step, "merged summary", _policy())
    assert message.meta["skills"][0]["path"] == skill.path


def test_replan_smaller_halves_the_call_budget():
    surface = _chat(turns=30, size=40)
    first = plan(surface, policy=_policy(trim_tokens_to_summarize=6000,
                                         max_summary_tokens=300), now=NOW)
    assert first.summarize is not None
    again = replan_smaller(first, 0.5)
    assert again.summarize is not None
    largest = max(c.input_tokens for c in first.summarize.calls)
    assert again.inputs.policy.trim_tokens_to_summarize == int(min(6000, largest) * 0.5)
    assert len(again.summarize.calls) > len(first.summarize.calls)
    assert all(c.input_tokens <= largest * 0.5 for c in again.summarize.calls)
    with pytest.raises(ValueError):
        replan_smaller(first, 1.0)


def test_equal_inputs_equal_plans():
    surface = _chat()
    a = plan(surface, policy=_policy(), now=NOW, keep_override=Clause("messages", 3))
    b = plan(list(surface), policy=_policy(), now=NOW, keep_override=Clause("messages", 3))
    assert a == b and a.to_json() == b.to_json()


def test_applying_the_plan_shrinks_the_surface():
    surface = _chat(turns=8)
    result = plan(surface, policy=_policy(), now=NOW)
    step = result.summarize
    assert step is not None
    message = checkpoint_for(step, "short summary", _policy())
    tokens = checkpoint_tokens(message, None)
    kept = sum(n.tokens for n in surface if n.seq in step.keep_seqs)
    assert kept + tokens < sum(n.tokens for n in surface)


def _big_surface(messages: int, tokens_per_message: int = 100) -> list[SurfaceNode]:
    out: list = [sys()]
    while len(out) < messages:
        i = len(out)
        out += [user(f"q{i}"), ai("", (f"c{i}", "bash")), tool(f"c{i}", "x"), ai(f"a{i}")]
    return nodes(*out[:messages], tokens=[tokens_per_message] * messages)


@pytest.mark.timed
def test_planning_is_fast_enough_for_a_long_surface():
    # the benchmark (tests/bench/plan_speed.py) measures; this only guards a regression
    surface = _big_surface(2000)
    policy = parse_policy({"trigger": ["tokens", 100_000], "keep": ["messages", 20],
                           "trim_tokens_to_summarize": 16000}).resolve(None)
    plan(surface, policy=policy, now=NOW)
    started = time.perf_counter()
    result = plan(surface, policy=policy, now=NOW)
    assert time.perf_counter() - started < 0.5
    assert result.summarize is not None


def test_a_token_keep_is_the_providers_tokens_when_it_counts_more():
    """The runtime's report counts the request at twice compactd's count of its nodes (plus the
    envelope): the tail kept is half the keep in compactd's counts, so it is the keep as the
    provider counts it. A message count is no count of tokens and stays as it is."""
    surface = _chat(turns=12, size=10)
    counted = sum(n.tokens for n in surface)
    tokens_keep = _policy(keep={"type": "tokens", "value": 120})

    def kept(policy, reported=None):
        step = plan(surface, policy=policy, envelope_tokens=300, reported_input_tokens=reported,
                    now=NOW).summarize
        assert step is not None
        return sum(n.tokens for n in surface if n.seq in step.keep_seqs and n.seq > 1)

    alone = kept(tokens_keep)
    assert 60 < alone <= 120
    assert kept(tokens_keep, reported=counted + 300) == alone  # the counts agree
    assert kept(tokens_keep, reported=counted * 2 + 300) <= 60
    assert kept(_policy(), reported=counted * 2 + 300) == kept(_policy())


def test_a_kept_request_larger_than_the_budget_does_not_cost_the_range_the_work_done_on_it():
    # An earlier turn, then the latest request (a pasted spec over the summarizer's budget),
    # then twenty steps of work on it: the work is what the agent carries on every step.
    spec = "please read this whole spec carefully " * 1500
    surface = nodes(sys(), user("old question " * 50), ai("old answer " * 50), user(spec),
                    *(ai(f"work {i} " + "step detail " * 150) for i in range(20)), ai("done"))
    policy = parse_policy({"trigger": ["tokens", 10], "keep": {"type": "messages", "value": 2},
                           "strategy": "shrink"}).resolve(None)
    step = plan(surface, policy=policy, now=NOW).summarize
    assert step is not None
    work = {node.seq for node in surface[4:-2]}
    assert work & set(step.replace_seqs), step.replace_seqs
    assert step.replaced_tokens > 3000, step.replaced_tokens


def _spec_surface(steps, *, request=None, earlier=True):
    """An earlier turn, the latest request (by default a pasted spec over the summarizer's
    budget), ``steps`` steps of work on it, and a last message."""
    spec = "please read this whole spec carefully " * 1500 if request is None else request
    turn = (user("old question " * 50), ai("old answer " * 50)) if earlier else ()
    return nodes(sys(), *turn, user(spec),
                 *(ai(f"work {i} " + "step detail " * 150) for i in range(steps)), ai("done"))


def _chunked(surface):
    policy = parse_policy({"trigger": ["tokens", 10], "keep": {"type": "messages", "value": 2},
                           "strategy": "chunk"}).resolve(None)
    step = plan(surface, policy=policy, now=NOW).summarize
    assert step is not None
    return step, sum(call.input_tokens for call in step.calls)


def test_a_kept_request_larger_than_the_budget_is_read_once_and_cut_by_the_chunk_strategy():
    # The review's surface: the request was read in parts, by more calls than the same surface
    # with a one-line request makes, and by every run until a newer request arrives.
    step, total = _chunked(_spec_surface(20))
    short, short_total = _chunked(_spec_surface(20, request="please read the spec"))
    request = _spec_surface(20)[3]
    assert step.kept_inside == (request.seq,) and step.replace_seqs == short.replace_seqs
    assert [p.seq for call in step.calls for p in call.pieces].count(request.seq) == 1
    assert len(step.calls) == len(short.calls)
    assert total <= short_total + kept_piece(request, counter_for(None)).tokens


def test_the_split_range_costs_the_chunk_strategy_only_what_it_adds_to_the_range():
    # Before the split range (bd691e4) the same plan replaced the work alone: the plan of the
    # surface without the earlier turn. Now the earlier turn goes too, for what it adds.
    counter = counter_for(None)
    surface = _spec_surface(18)
    step, total = _chunked(surface)
    before, before_total = _chunked(_spec_surface(18, earlier=False))
    added = sum(estimate(node, counter) for node in surface[1:3])
    assert step.replace_seqs[:2] == (surface[1].seq, surface[2].seq)
    assert step.replaced_tokens == before.replaced_tokens + sum(n.tokens for n in surface[1:3])
    assert len(step.calls) <= len(before.calls)
    assert total <= before_total + added + kept_piece(surface[3], counter).tokens


def test_a_shrink_that_stops_after_a_kept_node_leaves_it_out_of_the_calls():
    # The work after the reminder does not fit one call: the range ends before the reminder,
    # which then stays after the checkpoint, so the call must not read it as staying before.
    surface = nodes(sys(), user("old question " * 150),
                    user("today is Monday", dynamic_context_reminder=True), ai("answer " * 900),
                    user("next"), ai("ok"))
    policy = parse_policy({"trigger": ["tokens", 10], "keep": {"type": "messages", "value": 2},
                           "strategy": "shrink", "trim_tokens_to_summarize": 1000}).resolve(None)
    step = plan(surface, policy=policy, now=NOW).summarize
    assert step is not None
    assert step.replace_seqs == (2,) and step.kept_inside == ()
    assert [piece.seq for call in step.calls for piece in call.pieces] == [2]
