"""Model-free pruning tables: oversized tool results and LangChain-style tool-use clearing."""

from __future__ import annotations

import pytest

from compactd.worker.compaction.policy import ClearToolUsesConfig, PruneConfig, parse_policy
from compactd.worker.compaction.pruning import (
    PRUNE_MARKER,
    apply_actions,
    clear_tool_uses,
    cut_middle,
    merge_actions,
    prune_message,
    prune_tool_results,
    text_chars,
)
from compactd.worker.compaction.recall import pruned_note, pruned_ref
from tests.support.surfaces import COUNTER, ai, nodes, tool, user

CONFIG = PruneConfig()
SMALL = PruneConfig(threshold_chars=20, head_chars=4, tail_chars=3)


@pytest.mark.parametrize(
    ("content", "pruned"),
    [
        ("x" * 8192, None),  # at the threshold: left alone
        ("h" * 4096 + "m" * 4000 + "t" * 1024, "h" * 4096 + PRUNE_MARKER + "t" * 1024),
        # code points, not UTF-16 units: astral characters are never split in half
        ("😀" * 9000, "😀" * 4096 + PRUNE_MARKER + "😀" * 1024),
    ],
)
def test_prune_string_results(content, pruned):
    message = tool("c1", content)
    got = prune_message(message, CONFIG)
    if pruned is None:
        assert got is None
        return
    assert got is not None
    assert got.content == pruned
    assert isinstance(got.content, str)
    got.content.encode("utf-8")  # valid UTF-8: no lone surrogate
    assert got.meta["pruned"] is True


@pytest.mark.parametrize(
    ("blocks", "expected"),
    [
        # image blocks survive in order; the marker lands where the head ends
        ([{"type": "text", "text": "abcdefghij"}, {"type": "image", "source": "i1"},
          {"type": "text", "text": "klmnopqrstuvwxyz"}],
         [{"type": "text", "text": "abcd" + PRUNE_MARKER}, {"type": "image", "source": "i1"},
          {"type": "text", "text": "xyz"}]),
        ([{"type": "image", "source": "i0"}, {"type": "text", "text": "a" * 30}],
         [{"type": "image", "source": "i0"},
          {"type": "text", "text": "aaaa" + PRUNE_MARKER + "aaa"}]),
        # the head ends exactly at a block edge: the marker opens the next text block
        ([{"type": "text", "text": "abcd"}, {"type": "doc", "id": 7},
          {"type": "text", "text": "e" * 20}],
         [{"type": "text", "text": "abcd"}, {"type": "doc", "id": 7},
          {"type": "text", "text": PRUNE_MARKER + "eee"}]),
    ],
)
def test_prune_block_results(blocks, expected):
    got = prune_message(tool("c1", blocks), SMALL)
    assert got is not None
    assert got.content == expected


def test_prune_keeps_every_other_field_and_never_prunes_twice():
    message = tool("c9", "z" * 50, name="bash", is_error=True, custom={"k": 1})
    got = prune_message(message, SMALL)
    assert got is not None
    assert (got.role, got.tool_call_id, got.name) == ("tool", "c9", "bash")
    assert got.meta == {"is_error": True, "custom": {"k": 1}, "pruned": True}
    assert prune_message(got, SMALL) is None
    assert prune_message(ai("y" * 50), SMALL) is None  # only tool results are pruned


def test_cut_middle_is_exact_on_code_points():
    text = "".join(chr(0x1F600 + i % 50) for i in range(100))
    out = cut_middle(text, 10, 5)
    assert out == text[:10] + PRUNE_MARKER + text[-5:]
    assert text_chars([{"type": "text", "text": "ab"}, {"type": "image"}]) == 2


def test_prune_actions_report_tokens_saved():
    surface = nodes(user(), ai("", ("c1", "bash")), tool("c1", "word " * 5000))
    [action] = prune_tool_results(surface, CONFIG, COUNTER)
    assert action.seq == 3
    assert action.tokens_before == surface[2].tokens
    assert action.tokens_after == COUNTER.count_message(action.message)
    assert action.saved > 0
    assert prune_tool_results(surface, PruneConfig(enabled=False), COUNTER) == []


def test_the_prune_keys_of_a_config_reach_the_pruning():
    # The keys as a config file gives them: the tables above build their configs directly.
    policy = parse_policy({"prune": {"threshold_chars": 100, "head_chars": 10,
                                     "tail_chars": 5}})
    got = prune_message(tool("c1", "h" * 50 + "m" * 30 + "t" * 40), policy.prune)
    assert got is not None and got.content == "h" * 10 + PRUNE_MARKER + "t" * 5
    off = parse_policy({"prune": {"enabled": False}})
    assert prune_tool_results(nodes(tool("c1", "x" * 10_000)), off.prune, COUNTER) == []


def _clearing_surface():
    return nodes(
        user("go"),
        ai("", ("c1", "search", {"q": "alpha " * 40})), tool("c1", "one " * 200, name="search"),
        ai("", ("c2", "read", {"path": "/a"})), tool("c2", "two " * 200, name="read"),
        ai("", ("c3", "search", {"q": "gamma"})), tool("c3", "three " * 200, name="search"),
        ai("", ("c4", "search", {"q": "delta"})), tool("c4", "four " * 200),
    )


@pytest.mark.parametrize(
    ("config", "pressure", "cleared", "inputs_cleared"),
    [
        (ClearToolUsesConfig(enabled=False, trigger=1), 10**6, [], []),
        (ClearToolUsesConfig(enabled=True, trigger=1000), 1000, [], []),  # not above trigger
        (ClearToolUsesConfig(enabled=True, trigger=1000, keep=1), 1001, [3, 5, 7], []),
        (ClearToolUsesConfig(enabled=True, trigger=1000, keep=3), 5000, [3], []),
        (ClearToolUsesConfig(enabled=True, trigger=1000, keep=4), 5000, [], []),
        (ClearToolUsesConfig(enabled=True, trigger=1000, keep=0), 5000, [3, 5, 7, 9], []),
        # excluded by the result's name, or by its call's name when the result has none (c4)
        (ClearToolUsesConfig(enabled=True, trigger=1000, keep=0, exclude_tools=("search",)),
         5000, [5], []),
        (ClearToolUsesConfig(enabled=True, trigger=1000, keep=2, clear_tool_inputs=True),
         5000, [3, 5], [2, 4]),
        (ClearToolUsesConfig(enabled=True, trigger=1000, keep=0, clear_at_least=1),
         5000, [3], []),
        (ClearToolUsesConfig(enabled=True, trigger=1000, keep=0, clear_at_least=350),
         5000, [3, 5], []),
    ],
)
def test_clear_tool_uses(config, pressure, cleared, inputs_cleared):
    surface = _clearing_surface()
    actions = clear_tool_uses(surface, config, COUNTER, pressure_tokens=pressure)
    results = [a.seq for a in actions if a.message.role == "tool"]
    calls = [a.seq for a in actions if a.message.role == "assistant"]
    assert results == cleared
    assert calls == inputs_cleared
    for action in actions:
        assert action.tokens_after < action.tokens_before
        if action.message.role == "tool":
            # the placeholder, then the note naming the original a history_read returns
            assert action.message.content == (
                f"{config.placeholder}\n{pruned_note(pruned_ref(action.seq))}")
            assert action.message.meta["cleared"] is True
            assert action.message.meta["recall"]["ref"] == f"r{action.seq}"
        else:
            assert action.message.tool_calls[0].arguments == "{}"


def test_the_clearing_keys_of_a_config_reach_the_clearing():
    # The keys as a config file gives them: the table above builds its configs directly.
    policy = parse_policy({"clear_tool_uses": {
        "enabled": True, "trigger": 1000, "keep": 0, "exclude_tools": ["read"],
        "clear_tool_inputs": True, "clear_at_least": 350, "placeholder": "[gone]"}})
    actions = clear_tool_uses(_clearing_surface(), policy.clear_tool_uses, COUNTER,
                              pressure_tokens=5000)
    assert [a.seq for a in actions if a.message.role == "tool"] == [3, 7]
    assert [a.seq for a in actions if a.message.role == "assistant"] == [2, 6]
    assert all(a.message.content.startswith("[gone]\n") for a in actions
               if a.message.role == "tool")


def test_clearing_skips_cleared_results_and_tiny_results():
    surface = nodes(ai("", ("c1", "x")), tool("c1", "ok"),
                    ai("", ("c2", "x")), tool("c2", "[cleared]", cleared=True),
                    ai("", ("c3", "x")), tool("c3", "kept"))
    config = ClearToolUsesConfig(enabled=True, trigger=1, keep=1)
    assert clear_tool_uses(surface, config, COUNTER, pressure_tokens=10) == []


def test_merged_actions_keep_first_tokens_before():
    surface = nodes(ai("", ("c1", "bash")), tool("c1", "word " * 5000), ai("done"))
    sized = prune_tool_results(surface, CONFIG, COUNTER)
    after = apply_actions(surface, sized)
    cleared = clear_tool_uses(after, ClearToolUsesConfig(enabled=True, trigger=1, keep=0),
                              COUNTER, pressure_tokens=10**6)
    [merged] = merge_actions(sized, cleared)
    assert merged.tokens_before == surface[1].tokens
    assert merged.edits == ("prune", "clear")
    assert merged.message.content == "[cleared]\n" + pruned_note(pruned_ref(2))
    assert merged.message.meta["recall"] == {"ref": "r2", "first": 2, "last": 2,
                                             "footer": pruned_note(pruned_ref(2))}
