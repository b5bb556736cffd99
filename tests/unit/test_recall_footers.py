"""Recall footers on the nodes a compaction commits: checkpoints name their span, pruned results
name their original, both outside the summary text, and the non-shrinking guard counts them."""

from __future__ import annotations

import pytest

from compactd.storage.messages import RESERVED_META
from compactd.storage.surface import SurfaceNode
from compactd.worker.compaction.planner import checkpoint_for, checkpoint_recall, plan
from compactd.worker.compaction.policy import ClearToolUsesConfig, PruneConfig, parse_policy
from compactd.worker.compaction.pruning import clear_tool_uses, prune_tool_results
from compactd.worker.compaction.recall import (
    checkpoint_footer,
    checkpoint_ref,
    pruned_note,
    pruned_ref,
)
from compactd.worker.compaction.render import checkpoint_parts, checkpoint_tokens, render_node
from compactd.worker.compaction.validation import framed_tokens, validate_summary
from tests.support.surfaces import COUNTER, NOW, ai, ckpt, nodes, tool, user

FORMS = ("durable_context", "compacted_summary", "langchain")


def _policy(render: str = "durable_context"):
    return parse_policy({"trigger": ["messages", 3], "keep": ["messages", 1],
                         "render": render, "summary_prompt": "Summarize {messages}"}
                        ).resolve(None)


def _chat(first: int = 1):
    out = [user("start " + "detail " * 40)]
    for i in range(4):
        out += [ai(f"step {i} " + "words " * 40), user(f"more {i} " + "detail " * 40)]
    return nodes(*out, ai("last"), start=first)


@pytest.mark.parametrize("form", FORMS)
def test_a_checkpoint_ends_with_its_footer_outside_the_summary(form: str) -> None:
    policy = _policy(form)
    step = plan(_chat(first=12), policy=policy, now=NOW, force=True).summarize
    assert step is not None
    first, last = step.replace_seqs[0], step.replace_seqs[-1]
    message = checkpoint_for(step, "We fixed bug 12.", policy, run_id="r")
    footer = checkpoint_footer(checkpoint_ref(first, last))
    content = message.content
    assert isinstance(content, str)
    assert footer in content and footer not in checkpoint_parts(message)[0]
    # the footer is the last thing before the block closes, after the summary
    assert content.index("We fixed bug 12.") < content.index(footer)
    tail = content[content.index(footer) + len(footer):]
    assert tail.strip() in ("", "</durable_context_data>", "</compacted-summary>")
    assert message.meta["recall"] == {"ref": f"c{first}-{last}", "first": first, "last": last,
                                      "footer": footer}


OPENAI_READ = {"type": "function", "function": {"name": "history_read", "parameters": {}}}
ANTHROPIC_SEARCH = {"name": "history_search", "input_schema": {"type": "object"}}
OTHER_TOOL = {"type": "function", "function": {"name": "bash", "parameters": {}}}


@pytest.mark.parametrize(("envelope", "footer"), [
    (None, True),  # nothing registered: compactd cannot tell, and names the tool
    ({"system": "You are an agent.", "tools": [OTHER_TOOL, OPENAI_READ]}, True),
    ({"tools": [ANTHROPIC_SEARCH]}, True),
    ({"system": "You are an agent."}, False),
    ({"system": "You are an agent.", "tools": [OTHER_TOOL]}, False),
])
def test_the_footer_is_written_only_where_the_runtime_offers_the_recall_tools(
        envelope, footer: bool) -> None:
    policy = _policy()
    step = plan(_chat(first=12), policy=policy, now=NOW, force=True, envelope=envelope).summarize
    assert step is not None
    message = checkpoint_for(step, "We fixed bug 12.", policy)
    first, last = step.replace_seqs[0], step.replace_seqs[-1]
    line = checkpoint_footer(checkpoint_ref(first, last))
    assert (line in str(message.content)) is footer
    assert ("history_read" in str(message.content)) is footer
    # the reference and span stay either way: recall reads them, whatever the model was told
    assert {k: message.meta["recall"][k] for k in ("ref", "first", "last")} == {
        "ref": f"c{first}-{last}", "first": first, "last": last}
    assert ("footer" in message.meta["recall"]) is footer


def test_a_merge_names_the_whole_span_and_does_not_feed_the_old_footer_back() -> None:
    policy = _policy()
    earlier = ckpt("We fixed bug 12.")
    earlier = earlier.model_copy(update={
        "content": earlier.content,
        "meta": {**earlier.meta, "recall": checkpoint_recall(2, 40)}})
    surface = [SurfaceNode(seq=41, kind="checkpoint", message=earlier,
                           tokens=checkpoint_tokens(earlier, None), position=0),
               *nodes(*[user("more " + "detail " * 40) for _ in range(4)], ai("z"), start=45)]
    step = plan(surface, policy=policy, now=NOW, force=True).summarize
    assert step is not None and step.replace_seqs[0] == 41
    assert step.span == (2, step.replace_seqs[-1])
    assert step.existing_summary == "We fixed bug 12."  # no footer in what the model reads
    assert "history_read" not in step.existing_summary


def test_rendering_in_another_form_keeps_the_footer() -> None:
    policy = _policy("durable_context")
    step = plan(_chat(), policy=policy, now=NOW, force=True).summarize
    assert step is not None
    message = checkpoint_for(step, "summary", policy)
    node = SurfaceNode(seq=99, kind="checkpoint", message=message, tokens=1)
    for form in FORMS:
        [*_, rendered] = render_node(node, form)
        assert message.meta["recall"]["footer"] in rendered["content"]
        assert rendered["meta"]["recall"]["ref"] == step.recall["ref"]


def test_the_guard_counts_the_footer() -> None:
    """A summary that would shrink the range without its footer, but not with it, is refused."""
    policy = _policy()
    recall = checkpoint_recall(100_000, 200_000)
    summary = "We fixed bug 12."
    bare = framed_tokens(summary, (), policy, None)
    with_footer = framed_tokens(summary, (), policy, None, recall)
    assert with_footer > bare
    replaced = bare + 1  # shrinks without the footer
    assert validate_summary(summary, replaced_tokens=replaced, policy=policy, run_model=None,
                            recall=None) is None
    reason = validate_summary(summary, replaced_tokens=replaced, policy=policy, run_model=None,
                              recall=recall)
    assert reason is not None and "not fewer than" in reason
    assert validate_summary(summary, replaced_tokens=with_footer + 1, policy=policy,
                            run_model=None, recall=recall) is None


def test_a_range_too_small_for_a_checkpoint_with_its_footer_is_not_planned() -> None:
    policy = _policy()
    surface = nodes(user("a"), ai("b"), user("c"), ai("d"))
    result = plan(surface, policy=policy, now=NOW, force=True)
    assert result.summarize is None
    assert "not larger than an empty checkpoint" in (result.why_no_summary or "") or \
        "nothing" in (result.why_no_summary or "").lower()


@pytest.mark.parametrize("content", ["word " * 3000,
                                     [{"type": "text", "text": "word " * 3000},
                                      {"type": "image_url", "image_url": {"url": "x"}}]])
def test_a_pruned_result_names_its_original(content) -> None:
    surface = nodes(ai("", ("c1", "bash")), tool("c1", content), start=56)
    config = PruneConfig(threshold_chars=100, head_chars=20, tail_chars=10)
    [action] = prune_tool_results(surface, config, COUNTER)
    note = pruned_note(pruned_ref(57))
    pruned = action.message.content
    if isinstance(pruned, str):
        assert pruned.endswith("\n" + note)
    else:
        assert pruned[-1] == {"type": "text", "text": note}
        assert pruned[-2]["type"] == "image_url"
    assert action.message.meta["recall"] == {"ref": "r57", "first": 57, "last": 57,
                                             "footer": note}
    assert action.tokens_after == COUNTER.count_message(action.message)


def test_a_pruned_node_pruned_again_keeps_its_original_name() -> None:
    config = PruneConfig(threshold_chars=100, head_chars=20, tail_chars=10)
    [first] = prune_tool_results(nodes(ai("", ("c1", "bash")), tool("c1", "w " * 3000),
                                       start=56), config, COUNTER)
    # the committed pruned node has its own seq (80); its note still names r57
    again = SurfaceNode(seq=80, kind="pruned", message=first.message, tokens=first.tokens_after)
    assert prune_tool_results([again], config, COUNTER) == []  # never cut twice
    call = nodes(ai("", ("c1", "bash")), start=79)[0]
    [cleared] = clear_tool_uses([call, again], ClearToolUsesConfig(enabled=True, trigger=1, keep=0),
                                COUNTER, pressure_tokens=10**6)
    assert cleared.message.meta["recall"]["ref"] == "r57"
    assert str(cleared.message.content).endswith(pruned_note(pruned_ref(57)))


def test_recall_is_reserved() -> None:
    assert "recall" in RESERVED_META
