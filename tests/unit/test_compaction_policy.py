"""``parse_policy``: every silent misconfiguration is a load-time error naming its key path."""

from __future__ import annotations

import math

import pytest

from compactd.worker.compaction.policy import Clause, PolicyError, parse_policy


@pytest.mark.parametrize(
    ("raw", "path", "says"),
    [
        ({"trigger": {"type": "tokens", "value": math.nan}}, "summarization.trigger.value",
         "finite"),
        ({"trigger": {"type": "tokens", "value": math.inf}}, "summarization.trigger.value",
         "finite"),
        ({"trigger": [{"type": "fraction", "value": 80}]}, "summarization.trigger[0].value",
         "write 0.8"),
        ({"trigger": {"type": "fraction", "value": 0}}, "summarization.trigger.value",
         "(0, 1]"),
        ({"trigger": {"type": "messages", "value": 2.5}}, "summarization.trigger.value",
         "integer"),
        ({"trigger": {"type": "tokens", "value": 0}}, "summarization.trigger.value",
         "positive"),
        ({"trigger": {"type": "tokens", "value": -5}}, "summarization.trigger.value",
         "positive"),
        ({"trigger": {"type": "tokens", "value": True}}, "summarization.trigger.value",
         "number"),
        ({"trigger": [{}]}, "summarization.trigger[0]", "empty trigger mapping"),
        ({"trigger": {"type": "bytes", "value": 1}}, "summarization.trigger.type", "unknown"),
        ({"trigger": [{"tokens": 10, "lines": 3}]}, "summarization.trigger[0].lines",
         "unknown trigger kind"),
        ({"keep": {"type": "messages", "value": 0}}, "summarization.keep.value", "positive"),
        ({"keep": {"type": "fraction", "value": 30}}, "summarization.keep.value", "(0, 1]"),
        ({"summary_prompt": "Summarize it all."}, "summarization.summary_prompt",
         "{messages}"),
        ({"trim": 4000}, "summarization.trim", "unknown key"),
        ({"prune": {"head": 10}}, "summarization.prune.head", "unknown key"),
        ({"trigger": ["tokens", 4000], "keep": ["tokens", 4000]}, "summarization.keep",
         "not below trigger"),
        ({"trigger": [{"tokens": 100_000}, {"messages": 10}],
          "keep": {"type": "messages", "value": 12}}, "summarization.keep", "not below trigger"),
        ({"trim_tokens_to_summarize": 0}, "summarization.trim_tokens_to_summarize", "positive"),
        ({"max_summary_tokens": 1.5}, "summarization.max_summary_tokens", "integer"),
        ({"strategy": "truncate"}, "summarization.strategy", "one of"),
        ({"render": "xml"}, "summarization.render", "one of"),
        ({"prune": {"threshold_chars": 100, "head_chars": 80, "tail_chars": 30}},
         "summarization.prune", "below threshold_chars"),
        ({"clear_tool_uses": {"keep": -1}}, "summarization.clear_tool_uses.keep",
         "non-negative"),
        ([1, 2], "summarization", "mapping"),
    ],
)
def test_bad_configs_name_the_key_path(raw, path, says):
    with pytest.raises(PolicyError) as info:
        parse_policy(raw)
    assert info.value.path == path
    assert says in str(info.value)


@pytest.mark.parametrize(
    ("raw", "trigger"),
    [
        ({"type": "tokens", "value": 4000}, ((Clause("tokens", 4000),),)),
        (["tokens", 4000], ((Clause("tokens", 4000),),)),
        ([["tokens", 4000], ["messages", 50]],
         ((Clause("tokens", 4000),), (Clause("messages", 50),))),
        ({"tokens": 4000, "messages": 30}, ((Clause("tokens", 4000), Clause("messages", 30)),)),
        ([{"type": "fraction", "value": 0.8}], ((Clause("fraction", 0.8),),)),
        (None, ()),
    ],
)
def test_trigger_forms(raw, trigger):
    assert parse_policy({"trigger": raw}).trigger == trigger


def test_policy_round_trips_through_config():
    policy = parse_policy({"trigger": [{"tokens": 5000, "messages": 40}, ["fraction", 0.7]],
                           "keep": {"type": "tokens", "value": 1000}, "strategy": "shrink",
                           "clear_tool_uses": {"enabled": True, "keep": 2}})
    assert parse_policy(policy.to_config()) == policy
