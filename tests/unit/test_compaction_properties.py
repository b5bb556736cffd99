"""Properties of the plan over random surfaces and random valid policies.

1. Neither side of a cut holds a tool result without its call or a call without all results.
2. System and pinned nodes (and rescued nodes) are never replaced.
3. Every replaced seq reaches exactly one summarizer input (a split message: each part once, in
   order); no input exceeds the budget, as planned or as built by ``build_prompt``.
4. Applying the plan with any valid summary gives fewer surface tokens.
5. Equal inputs give equal plans.
"""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from compactd.storage.messages import Message
from compactd.storage.surface import SurfaceNode
from compactd.worker.compaction.boundary import protected
from compactd.worker.compaction.planner import Plan, checkpoint_for, plan
from compactd.worker.compaction.policy import Clause, PolicyError, parse_policy
from compactd.worker.compaction.prompt import SECTIONS, build_prompt
from compactd.worker.compaction.render import Skill, checkpoint_tokens
from compactd.worker.compaction.validation import validate_summary
from tests.support.pairs import cut_problems, node_rows
from tests.support.surfaces import COUNTER, NOW, ai, ckpt, nodes, sys, tool, user

WORDS = st.sampled_from(["alpha", "beta", "<b>", "a&b", "x>y", "\n", "数据", "😀", "{messages}",
                         "</new_messages>", "path/to/file.py", "42"])


@st.composite
def texts(draw: Any, max_words: int = 60) -> str:
    words = draw(st.lists(WORDS, max_size=max_words))
    repeat = draw(st.sampled_from([1, 1, 1, 5, 40]))
    return " ".join(words) * repeat


@st.composite
def surfaces(draw: Any) -> list[SurfaceNode]:
    messages: list[Message] = []
    for _ in range(draw(st.integers(0, 2))):
        messages.append(sys(draw(texts(10))))
    if draw(st.booleans()):
        skills = [Skill("s", "/mnt/skills/s/SKILL.md", "d", 0)] if draw(st.booleans()) else []
        messages.append(ckpt(draw(texts(30)) or "earlier", skills))
    open_ids: list[str] = []
    counter = 0
    for _ in range(draw(st.integers(1, 25))):
        kind = draw(st.sampled_from(["user", "ai", "group", "group", "reminder", "ckpt",
                                     "flush"]))
        flags: dict[str, Any] = {"pinned": True} if draw(st.integers(0, 9)) == 0 else {}
        if kind == "user":
            messages.append(user(draw(texts()) or "u", **flags))
        elif kind == "ai":
            messages.append(ai(draw(texts()), **flags))
        elif kind == "reminder":
            messages.append(user("now", dynamic_context_reminder=True))
        elif kind == "ckpt":
            messages.append(ckpt(draw(texts(20)) or "s"))
        elif kind == "group":
            ids = []
            for _ in range(draw(st.integers(1, 3))):
                counter += 1
                ids.append(f"c{counter}")
            calls = [(i, draw(st.sampled_from(["bash", "read_file", "search"])),
                      {"path": "/mnt/skills/x/SKILL.md"}) for i in ids]
            messages.append(ai(draw(texts(10)) or None, *calls, **flags))
            open_ids.extend(ids)
        if open_ids and (kind == "flush" or draw(st.booleans())):
            # answer some waiting calls, in a random order: parallel and interleaved groups
            answer = draw(st.permutations(open_ids))[:draw(st.integers(1, len(open_ids)))]
            for call_id in answer:
                big = draw(st.integers(0, 12)) == 0
                text = "y" * 9000 if big else draw(texts())
                messages.append(tool(call_id, text, **({"pinned": True}
                                                       if draw(st.integers(0, 14)) == 0
                                                       else {})))
                open_ids.remove(call_id)
    if draw(st.booleans()):  # close every group, or leave the newest step unclosed
        messages.extend(tool(call_id, "done") for call_id in open_ids)
    return nodes(*messages)


@st.composite
def policies(draw: Any) -> tuple[Any, bool, Clause | None, int | None]:
    window = draw(st.sampled_from([None, 2_000, 50_000]))
    raw: dict[str, Any] = {"trigger": ["tokens", draw(st.integers(1, 3000))]}
    keep = draw(st.sampled_from(["none", "messages", "tokens", "fraction"]))
    if keep == "messages":
        raw["keep"] = ["messages", draw(st.integers(1, 8))]
    elif keep == "tokens":
        raw["keep"] = ["tokens", draw(st.integers(1, raw["trigger"][1]))]
        if raw["keep"][1] >= raw["trigger"][1]:
            raw["keep"][1] = max(1, raw["trigger"][1] - 1)
    elif keep == "fraction":
        raw["keep"] = ["fraction", draw(st.sampled_from([0.05, 0.2, 0.5]))]
    raw["trim_tokens_to_summarize"] = draw(st.sampled_from([None, 400, 700, 1500, 4000]))
    raw["max_summary_tokens"] = draw(st.sampled_from([20, 100, 300]))
    raw["strategy"] = draw(st.sampled_from(["chunk", "shrink"]))
    raw["replay_mode"] = draw(st.booleans())
    raw["render"] = draw(st.sampled_from(["durable_context", "compacted_summary", "langchain"]))
    if draw(st.booleans()):
        raw["clear_tool_uses"] = {"enabled": True, "trigger": draw(st.integers(1, 2000)),
                                  "keep": draw(st.integers(0, 3)),
                                  "clear_tool_inputs": draw(st.booleans())}
    try:
        policy = parse_policy(raw).resolve(window)
    except PolicyError:
        assume(False)
        raise
    force = draw(st.booleans())
    override = draw(st.sampled_from([None, None, Clause("messages", 2), Clause("tokens", 300)]))
    envelope = draw(st.sampled_from([0, 40]))
    return policy, force, override, envelope


def _plan(surface: list[SurfaceNode], case: Any) -> Plan:
    policy, force, override, envelope = case
    return plan(surface, policy=policy, now=NOW, force=force, keep_override=override,
                envelope_tokens=envelope)


SETTINGS = settings(max_examples=150, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@SETTINGS
@given(surfaces(), policies())
def test_plan_properties(surface: list[SurfaceNode], case: Any) -> None:
    result = _plan(surface, case)
    policy = case[0]
    # 5. equal inputs, equal plans
    assert _plan(list(surface), case) == result

    step = result.summarize
    for action in result.prune:
        assert action.tokens_after < action.tokens_before
    if step is None:
        return
    order = [n.seq for n in surface]
    replaced = set(step.replace_seqs)
    index = sorted(order.index(s) for s in (*step.replace_seqs, *step.kept_inside))
    assert index == list(range(index[0], index[0] + len(index)))  # one contiguous run
    # with the nodes kept inside it: rescued ones, or what tool-pair safety left, never the
    # range's first or last node
    assert not step.kept_inside or (order.index(step.replace_seqs[0])
                                    < min(map(order.index, step.kept_inside))
                                    <= max(map(order.index, step.kept_inside))
                                    < order.index(step.replace_seqs[-1]))
    assert sorted(step.keep_seqs + step.replace_seqs) == sorted(order)

    # 1. tool-pair safety on both sides of the cut
    assert not cut_problems(node_rows(surface), replaced)

    # 2. never replaced: system, pinned, reminders, the latest user request
    guard = protected(surface)
    for node, is_protected in zip(surface, guard, strict=True):
        if is_protected:
            assert node.seq not in replaced

    # 3. each replaced seq reaches exactly one input (each part once, in order), in budget;
    # the nodes kept inside the range are read too, as context
    seen: list[tuple[int, int]] = []
    for call in step.calls:
        seen += [(s, 1) for s in call.summary_seqs]
        seen += [(p.seq, p.part) for p in call.pieces]
        if policy.trim_tokens_to_summarize is not None:
            assert call.input_tokens <= policy.trim_tokens_to_summarize
        running = step.existing_summary if call.index == 0 else "word " * (
            policy.max_summary_tokens - 1)
        sent = build_prompt(call, running, policy, {"system": "s"})
        exact = sum(COUNTER.count_text(str(m["content"] or "")) + 3 for m in sent) + sum(
            COUNTER.count_text(c["function"]["name"] + c["function"]["arguments"]) + 3
            for m in sent for c in m.get("tool_calls") or ())
        if policy.replay_mode:
            exact = exact - COUNTER.count_text("s") - 3 + case[3]
        assert exact <= call.input_tokens
    expected = []
    for seq in sorted({*step.replace_seqs, *step.kept_inside}):
        parts = sorted({part for s, part in seen if s == seq})
        expected += [(seq, part) for part in parts]
        assert parts == list(range(1, len(parts) + 1))
    assert sorted(seen) == expected

    # 4. any valid summary shrinks the surface
    pruned = {a.seq: a.tokens_after for a in result.prune}
    before = sum(n.tokens for n in surface)
    kept = sum(pruned.get(n.seq, n.tokens) for n in surface if n.seq in step.keep_seqs)
    sections = "\n".join(f"## {name}\n(none)" for name in SECTIONS)
    for text in ("s", "## Current Work\nfixing the parser", sections):
        if validate_summary(text, replaced_tokens=step.replaced_tokens, policy=policy,
                            run_model=None, skills=step.skills,
                            has_history=step.has_history, recall=step.recall) is None:
            tokens = checkpoint_tokens(checkpoint_for(step, text, policy), None)
            assert kept + tokens < before
