"""When a model-free edit commits alone: the decision, the plan it shapes, and its keys."""

from __future__ import annotations

from datetime import timedelta

import pytest

from compactd.worker.compaction.cache_breaks import hold_edits
from compactd.worker.compaction.planner import Outlook, plan
from compactd.worker.compaction.policy import (
    DEFAULT_CACHE_TTL_S,
    DEFAULT_CLEAR_AT_LEAST,
    PolicyError,
    parse_policy,
)
from compactd.worker.compaction.refire import refire_growth, usual_step
from tests.support.surfaces import NOW, ai, nodes, sys, tool, user

WARM = NOW - timedelta(seconds=10)
COLD = NOW - timedelta(seconds=DEFAULT_CACHE_TTL_S + 1)
# A run whose edits may wait for a summary, with the agent's cache warm or cold.
WARM_WAITING = Outlook(edits_may_wait=True, last_append_at=WARM)
COLD_WAITING = Outlook(edits_may_wait=True, last_append_at=COLD)


def _policy(**raw):
    return parse_policy(raw).resolve(100_000)


@pytest.mark.parametrize(
    ("freed", "raw", "pressure", "last_append_at", "forced", "held"),
    [
        # under clear_at_least while the cache is warm: waits
        (DEFAULT_CLEAR_AT_LEAST - 1, {}, 50_000, WARM, False, True),
        # at or over it: commits alone
        (DEFAULT_CLEAR_AT_LEAST, {}, 50_000, WARM, False, False),
        (10, {"clear_at_least": 10}, 50_000, WARM, False, False),
        # 0: every edit commits alone (the behaviour before the rule)
        (1, {"clear_at_least": 0}, 50_000, WARM, False, False),
        # the cache is cold: edits are free
        (10, {}, 50_000, COLD, False, False),
        (10, {"cache_ttl_s": 5}, 50_000, NOW - timedelta(seconds=6), False, False),
        (10, {"cache_ttl_s": 5}, 50_000, NOW - timedelta(seconds=4), False, True),
        # no append known: nothing to keep warm
        (10, {}, 50_000, None, False, False),
        # safety first: a forced run, a session at or over its window
        (10, {}, 50_000, WARM, True, False),
        (10, {}, 100_000, WARM, False, False),
        (10, {}, 99_999, WARM, False, True),
    ],
)
def test_hold_edits(freed, raw, pressure, last_append_at, forced, held):
    why = hold_edits(freed, policy=_policy(**raw), pressure_tokens=pressure,
                     last_append_at=last_append_at, now=NOW, forced=forced)
    assert (why is not None) is held
    assert why is None or ("clear_at_least" in why and "warm" in why)


def _big_result_surface():
    return nodes(sys(), user("read it"), ai("", ("c1", "cat")), tool("c1", "data " * 6000),
                 ai("done"))


def test_a_held_prune_does_not_count_as_relief_so_the_summary_carries_it():
    surface = _big_result_surface()
    policy = parse_policy({"trigger": ["tokens", 3000], "keep": {"type": "messages", "value": 1},
                           "clear_at_least": 10**6}).resolve(None)
    alone = plan(surface, policy=policy, now=NOW)
    assert alone.summarize is None and alone.prune_held is None
    held = plan(surface, policy=policy, now=NOW, outlook=WARM_WAITING,
                defer_summary=True)
    assert held.prune_held is not None and held.prune and not held.summary_deferred
    assert held.summarize is not None and 4 in held.summarize.replace_seqs
    assert held.to_json()["prune_held"] == held.prune_held
    # Cold, or a run that never waits: committed alone and planned after, as before.
    for cold in (plan(surface, policy=policy, now=NOW, outlook=COLD_WAITING,
                      defer_summary=True),
                 plan(surface, policy=policy, now=NOW, outlook=Outlook(last_append_at=WARM),
                      defer_summary=True)):
        assert cold.prune_held is None and cold.summarize is None


def test_a_held_clearing_with_no_summary_due_waits_with_nothing_planned():
    surface = nodes(user("go"), ai("", ("c1", "s")), tool("c1", "one " * 200),
                    ai("", ("c2", "s")), tool("c2", "two " * 200), ai("done"))
    policy = parse_policy({"trigger": ["tokens", 10**6],
                           "clear_tool_uses": {"enabled": True, "trigger": 100, "keep": 1}}
                          ).resolve(None)
    result = plan(surface, policy=policy, now=NOW, outlook=WARM_WAITING)
    assert [a.seq for a in result.prune] == [3] and result.prune_held is not None
    assert not result.compacts


def test_with_no_summary_possible_the_edits_commit_alone():
    # Everything but the pruned result's own step is protected: no range to summarize.
    surface = nodes(sys(), user("read it"), ai("", ("c1", "cat")), tool("c1", "data " * 6000))
    policy = parse_policy({"trigger": ["tokens", 1000], "clear_at_least": 10**6}).resolve(None)
    result = plan(surface, policy=policy, now=NOW, outlook=WARM_WAITING)
    assert result.prune and result.summarize is None and result.prune_held is None


def test_under_the_recallable_layout_held_edits_ride_with_the_pass():
    policy = parse_policy({"trigger": ["tokens", 3000], "keep": {"type": "messages", "value": 1},
                           "layout": "recallable", "index_max_tokens": 400,
                           "clear_at_least": 10**6}).resolve(None)
    result = plan(_big_result_surface(), policy=policy, now=NOW, outlook=WARM_WAITING,
                  defer_summary=True)
    assert result.prune and result.prune_held is not None
    assert result.recall_pass is not None and not result.summary_deferred


@pytest.mark.parametrize(
    ("raw", "path"),
    [
        ({"clear_at_least": -1}, "summarization.clear_at_least"),
        ({"clear_at_least": "5000"}, "summarization.clear_at_least"),
        ({"clear_at_least": 1.5}, "summarization.clear_at_least"),
        ({"cache_ttl_s": -0.5}, "summarization.cache_ttl_s"),
        ({"cache_ttl_s": "300"}, "summarization.cache_ttl_s"),
        ({"cache_ttl_s": float("nan")}, "summarization.cache_ttl_s"),
        ({"cache_ttl_s": True}, "summarization.cache_ttl_s"),
    ],
)
def test_bad_values_are_load_time_errors_naming_the_key(raw, path):
    with pytest.raises(PolicyError) as err:
        parse_policy(raw)
    assert err.value.path == path


def test_the_keys_parse_and_round_trip():
    policy = parse_policy({"clear_at_least": 0, "cache_ttl_s": 3600})
    assert (policy.clear_at_least, policy.cache_ttl_s) == (0, 3600.0)
    assert parse_policy(policy.to_config()) == policy
    default = parse_policy({})
    assert (default.clear_at_least, default.cache_ttl_s) == (DEFAULT_CLEAR_AT_LEAST,
                                                               DEFAULT_CACHE_TTL_S)


# A trigger below the kept tail: a long observation among the kept messages.
def _stuck_surface():
    return nodes(sys(), user("fix the bug"), ai("looking " * 60), user("obs " * 100),
                 ai("next " * 60), user("a long observation " * 1500), ai("reading it"),
                 user("short obs"))


def _stuck_policy(**raw):
    return parse_policy({"trigger": ["tokens", 3000], "keep": {"type": "messages", "value": 3},
                         **raw}).resolve(100_000)


def test_a_summary_that_cannot_relieve_and_frees_little_is_not_asked_for_while_warm():
    surface, policy = _stuck_surface(), _stuck_policy()
    warm = plan(surface, policy=policy, now=NOW, outlook=WARM_WAITING)
    assert warm.summarize is None and warm.fired
    assert "clear_at_least" in (warm.nothing_to_do or "") and warm.refire_growth
    # The growth after which the observation has left the keep of 3 for usual steps.
    assert warm.refire_growth < 200
    # A cold cache, a run that never waits, clear_at_least 0: summarized, as before.
    for other in (plan(surface, policy=policy, now=NOW, outlook=COLD_WAITING),
                  plan(surface, policy=policy, now=NOW, outlook=Outlook(last_append_at=WARM)),
                  plan(surface, policy=_stuck_policy(clear_at_least=0), now=NOW,
                       outlook=WARM_WAITING)):
        assert other.summarize is not None and other.refire_growth is None
    # A keep that lets the observation go: the summary relieves, and is asked for.
    relieving = plan(surface, policy=_stuck_policy(keep={"type": "messages", "value": 1}),
                     now=NOW, outlook=WARM_WAITING)
    assert relieving.summarize is not None


@pytest.mark.parametrize(
    ("tail", "rest", "step", "growth"),
    [
        # the long message leaves the keep with the first arrival
        ([5000, 50, 50], 500, 50, 50),
        # ... with the third
        ([50, 50, 5000], 500, 50, 150),
        # no turnover of the tail gets under: the growth a summary needs to pay for a break
        ([50, 50, 50], 2950, 50, 6400),
        ([5000, 50, 50], 500, 10_000, 10_000),
    ],
)
def test_refire_growth(tail, rest, step, growth):
    assert refire_growth(tail, rest_tokens=rest, threshold=3000, step=step,
                         clear_at_least=6400) == growth


def test_usual_step_is_the_median():
    assert usual_step([40, 60, 6000]) == 60 and usual_step([]) == 1
