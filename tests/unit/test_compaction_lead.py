"""The lead (issue 27, item 1): its configuration, its measure, and the firing rule every
automatic decision shares: the append's signal, the sweep, the follow-up and the run's plan."""

from __future__ import annotations

import dataclasses
import datetime as dt
from typing import Any

import pytest
import yaml

from compactd.storage.errors import ConfigError
from compactd.storage.leads import ALL_POOLS, LeadRow
from compactd.storage.records import STEP_DECAY, SessionInfo, step_tokens_after
from compactd.storage.surface import SurfaceNode
from compactd.worker.compaction.lead import (
    FIRST_LEAD_S,
    LEAD_MAX_SHARE,
    early_wait_shrink,
    lead_tokens,
    parse_lead,
    percentile,
    step_lead_tokens,
)
from compactd.worker.compaction.planner import Outlook, plan
from compactd.worker.compaction.policy import PolicyError, parse_policy
from compactd.worker.compaction.refire import early_refire_growth
from compactd.worker.lead import measure_leads
from compactd.worker.pressure import (
    ahead_tokens,
    explain,
    lead_parts,
    over_trigger,
    session_policy,
    wants_run,
)
from compactd.worker.settings import Config, build_config
from tests.support.surfaces import ai, nodes, sys, tool, user

T0 = dt.datetime(2026, 12, 6, 4, 0, tzinfo=dt.UTC)
TRIGGER = {"trigger": {"type": "tokens", "value": 10_000},
           "keep": {"type": "messages", "value": 2}}


def config(**summarization: Any) -> Config:
    return build_config({"summarization": {**TRIGGER, **summarization}})


def session(tokens: int, rate: float, lead_s: float, **fields: Any) -> SessionInfo:
    values: dict[str, Any] = {
        "id": "s1", "tenant": "default", "run_model": "gpt-4o", "context_window": 128_000,
        "envelope": None, "envelope_tokens": 0, "policy": None, "surface_version": 1,
        "surface_tokens": tokens, "surface_messages": 10, "last_seq": 10, "last_position": 10,
        "reported_input_tokens": None, "reported_version": None,
        "reported_output_tokens": None, "reported_base_tokens": None, "signal_at": None,
        "lease_owner": None, "lease_run_id": None, "lease_expires_at": None, "lease_fence": 0,
        "cooldown_until": None, "flagged_reason": None, "flagged_at": None,
        "created_at": T0 - dt.timedelta(hours=1), "last_append_at": T0,
        "growth_rate": rate, "lead_s": lead_s}
    values.update(fields)
    return SessionInfo(**values)


# ---------------------------------------------------------------------------- configuration

@pytest.mark.parametrize(("value", "lead"), [("auto", None), (0, 0.0), (12, 12.0), (2.5, 2.5)])
def test_the_lead_is_auto_or_seconds(value: Any, lead: float | None) -> None:
    assert config(lead=value).lead == lead


def test_the_default_lead_is_auto() -> None:
    assert build_config({}).lead is None
    assert config().lead is None


@pytest.mark.parametrize(("value", "seconds"), [(0, 0.0), (2, 2.0), (0.5, 0.5)])
def test_the_first_lead_is_seconds(value: Any, seconds: float) -> None:
    assert config(first_lead_s=value).first_lead_s == seconds
    assert build_config({}).first_lead_s == FIRST_LEAD_S


@pytest.mark.parametrize("value", [-1, "auto", "5", True, None, float("nan"), float("inf")])
def test_a_bad_first_lead_is_a_load_time_error_naming_the_key(value: Any) -> None:
    with pytest.raises(ConfigError, match=r"^summarization\.first_lead_s: "):
        config(first_lead_s=value)
    with pytest.raises(PolicyError, match=r"^policy\.first_lead_s: unknown key"):
        parse_policy({"first_lead_s": 5}, path="policy")


def test_with_no_lead_stored_an_auto_session_fires_by_the_first_lead() -> None:
    # No row yet (a fresh deployment before any refresh): the append read 0.
    info = session(9_000, 100.0, 0.0)
    assert wants_run(info, config(first_lead_s=10), T0)  # 9,000 + 100 x 10
    assert not wants_run(info, config(first_lead_s=9.9), T0)
    assert not wants_run(info, config(first_lead_s=0), T0)  # as before the first lead
    assert not wants_run(info, config(lead=0, first_lead_s=10), T0)
    # a stored lead is what it says, whatever the first lead
    assert not wants_run(session(9_000, 100.0, 5.0), config(first_lead_s=10), T0)


@pytest.mark.parametrize("value", [-1, -0.5, "soon", "10", True, False, None, [5], {"s": 1},
                                   float("nan"), float("inf")])
def test_a_bad_lead_is_a_load_time_error_naming_the_key(value: Any) -> None:
    with pytest.raises(ConfigError, match=r"^summarization\.lead: "):
        config(lead=value)


def test_the_lead_from_yaml_text() -> None:
    raw = yaml.safe_load("summarization:\n  lead: -3\n")
    with pytest.raises(ConfigError, match=r"summarization\.lead: .*not negative, got -3"):
        build_config(raw)


def test_a_session_cannot_set_its_own_lead() -> None:
    # The lead is the fleet's (measured per pool), not a session's override.
    with pytest.raises(PolicyError, match=r"^policy\.lead: unknown key"):
        parse_policy({"lead": 5}, path="policy")


def test_parse_lead_names_the_path_it_is_given() -> None:
    with pytest.raises(PolicyError, match=r"^x\.lead: "):
        parse_lead("never", "x.lead")


# ---------------------------------------------------------------------------- the measure

def test_the_percentile_is_the_nearest_rank() -> None:
    assert percentile([5.0]) == 5.0
    assert percentile([float(s) for s in range(1, 11)]) == 9.0
    assert percentile([float(s) for s in range(1, 11)], 0.5) == 5.0
    assert percentile([3.0, 1.0, 2.0], 0.9) == 3.0
    with pytest.raises(ValueError):
        percentile([])


def test_auto_measures_every_pool_from_one_run_and_a_pool_from_five() -> None:
    rows = measure_leads(config(), {"gpt-4o": [1.0, 2.0, 3.0], "m2": [1.0] * 4 + [9.0]}, T0)
    by_pool = {r.pool: r for r in rows}
    assert set(by_pool) == {ALL_POOLS, "m2"}
    assert by_pool["m2"].lead_s == 9.0 and by_pool["m2"].runs == 5
    assert by_pool[ALL_POOLS].runs == 8 and by_pool[ALL_POOLS].source == "auto"


def test_before_any_run_is_measured_auto_stores_the_first_lead() -> None:
    assert measure_leads(config(), {}, T0) == [
        LeadRow(ALL_POOLS, FIRST_LEAD_S, "first", 0, None, T0)]
    assert measure_leads(config(first_lead_s=5), {}, T0)[0].lead_s == 5.0
    # a configured lead is the lead from the start: the first lead is auto's only
    assert measure_leads(config(lead=7, first_lead_s=2), {}, T0)[0].lead_s == 7.0


@pytest.mark.parametrize(("lead", "source"), [(7, "configured"), (0, "off")])
def test_a_configured_lead_is_stored_for_every_pool(lead: float, source: str) -> None:
    rows = measure_leads(config(lead=lead), {"gpt-4o": [100.0] * 9}, T0)
    assert [(r.pool, r.lead_s, r.source) for r in rows] == [(ALL_POOLS, lead, source)]


# ---------------------------------------------------------------------------- the firing rule

@pytest.mark.parametrize(("rate", "lead_s", "threshold", "expected"), [
    (100.0, 10.0, 10_000, 1_000),
    (0.0, 10.0, 10_000, 0),        # no growth history: fires as it always did
    (100.0, 0.0, 10_000, 0),       # lead 0: today's rule
    (100.0, 10.0, None, 0),        # a messages-only trigger has no tokens to move
    (1_000.0, 60.0, 10_000, int(LEAD_MAX_SHARE * 10_000)),  # capped
])
def test_lead_tokens(rate: float, lead_s: float, threshold: float | None,
                     expected: int) -> None:
    assert lead_tokens(rate, lead_s, threshold) == expected


# (tokens, rate per s, the pool's lead as the append stored it, summarization.lead, fires,
#  the run summarizes)
CASES = [
    (9_000, 100.0, 10.0, "auto", True, True),    # 9,000 + 100 x 10 reaches 10,000
    (8_999, 100.0, 10.0, "auto", False, False),
    (9_000, 100.0, 10.0, 0, False, False),       # lead 0: today's behaviour
    (10_000, 100.0, 10.0, 0, True, True),
    (9_000, 0.0, 10.0, "auto", False, False),    # no growth history: as today
    (10_000, 0.0, 10.0, "auto", True, True),
    (9_000, 100.0, 0.0, 10, True, True),         # configured, whatever the pool measured
    (9_000, 100.0, 60.0, 5, False, False),
    (4_000, 10_000.0, 60.0, "auto", False, False),  # the cap: never below half the trigger
    (5_000, 10_000.0, 60.0, "auto", True, True),
]


@pytest.mark.parametrize(("tokens", "rate", "stored", "lead", "fires", "summarizes"), CASES)
def test_every_automatic_decision_counts_the_lead(tokens: int, rate: float, stored: float,
                                                  lead: Any, fires: bool,
                                                  summarizes: bool) -> None:
    result = assert_every_decision(session(tokens, rate, stored), config(lead=lead), fires)
    assert (result.summarize is not None) is summarizes


def assert_every_decision(info: SessionInfo, c: Config, fires: bool) -> Any:
    """The append's and the sweep's decisions fire as ``fires`` says, and the run's plan on a
    surface of the session's tokens accepts what fired (predicted tokens at pickup reach the
    trigger); the plan."""
    assert wants_run(info, c, T0) is fires
    assert over_trigger(info, c, T0) is fires
    policy = session_policy(info, c)
    nodes = [SurfaceNode(seq=i + 1, kind="message", message=user(f"m{i}"),
                         tokens=info.surface_tokens // 10) for i in range(10)]
    result = plan(nodes, policy=policy, now=T0, run_model="gpt-4o",
                  outlook=Outlook(lead_tokens=ahead_tokens(info, policy, c, T0)))
    assert result.fired is fires
    return result


def test_a_run_fired_early_is_refused_by_a_plan_that_ignores_the_lead() -> None:
    # What the plan did before the lead: an early signal would end as nothing to do.
    info = session(9_000, 100.0, 10.0)
    policy = session_policy(info, config())
    nodes = [SurfaceNode(seq=i + 1, kind="message", message=user(f"m{i}"), tokens=900)
             for i in range(10)]
    assert not plan(nodes, policy=policy, now=T0, run_model="gpt-4o").fired
    fired = plan(nodes, policy=policy, now=T0, run_model="gpt-4o",
                 outlook=Outlook(lead_tokens=1_000))
    assert fired.fired and "1000 tokens ahead of the checkpoint" in fired.reason


def test_an_idle_session_stops_counting_its_old_growth() -> None:
    # The stored rate decays with the time since the last append (records.decayed_growth_rate).
    info = session(9_000, 100.0, 10.0)
    assert wants_run(info, config(), T0)
    assert not wants_run(info, config(), T0 + dt.timedelta(minutes=10))


def test_explain_says_the_lead_was_counted() -> None:
    fired, why, pressure = explain(session(9_100, 100.0, 10.0, last_append_at=None,
                                           created_at=dt.datetime.now(dt.UTC)), config())
    assert fired and pressure.tokens == 9_100
    assert "tokens ahead of the checkpoint" in why


def test_the_reported_usage_counts_the_lead_too() -> None:
    info = dataclasses.replace(session(5_000, 100.0, 10.0), reported_input_tokens=9_000,
                               reported_output_tokens=0, reported_base_tokens=5_000)
    assert wants_run(info, config(), T0)
    assert not wants_run(info, config(lead=0), T0)


def test_a_young_sessions_rate_is_unbiased_up_to_a_bound() -> None:
    from compactd.storage.records import (
        GROWTH_WINDOW_S,
        YOUNG_GROWTH_MAX_FACTOR,
        next_growth_rate,
        unbiased_growth_rate,
    )

    # 100 tokens every second from creation: the stored rate climbs toward 100.
    rate = 0.0
    for _ in range(60):
        rate = next_growth_rate(rate, 100, 1.0)
    assert rate < 40
    assert unbiased_growth_rate(rate, 60.0) == pytest.approx(100, rel=0.02)
    # An old session's rate is taken as it is; an instant's history at most times the bound.
    assert unbiased_growth_rate(10.0, 20 * GROWTH_WINDOW_S) == pytest.approx(10.0)
    assert unbiased_growth_rate(10.0, 0.0) == 10.0 * YOUNG_GROWTH_MAX_FACTOR
    assert unbiased_growth_rate(10.0, 1.0) == 10.0 * YOUNG_GROWTH_MAX_FACTOR


def test_a_young_growing_session_fires_on_its_real_rate() -> None:
    # Sixty seconds old, stored rate 37 (about 94 a second in truth): 9,100 + 94 x 10 fires.
    info = session(9_100, 37.0, 10.0, created_at=T0 - dt.timedelta(seconds=60))
    assert wants_run(info, config(), T0)
    assert not wants_run(dataclasses.replace(info, created_at=T0 - dt.timedelta(hours=1)),
                         config(), T0)


def test_the_lead_moves_the_summary_trigger_not_clearings() -> None:
    # The plan judges clearing on the pressure as it is: waking a run for it early would end as
    # nothing to do.
    c = build_config({"summarization": {
        "trigger": {"type": "tokens", "value": 20_000}, "keep": {"type": "messages", "value": 2},
        "clear_tool_uses": {"enabled": True, "trigger": 9_000}}})
    assert not wants_run(session(8_500, 100.0, 10.0), c, T0)
    assert wants_run(session(9_001, 100.0, 10.0), c, T0)
    assert wants_run(session(19_000, 100.0, 10.0), c, T0)


def test_after_a_checkpoint_the_lead_counts_only_what_the_session_grew_since() -> None:
    # A checkpoint left 8,000 of a 10,000 trigger: the session fires no earlier than halfway
    # to the trigger from there (9,000), however fast it grows, so each compaction relieves it.
    assert lead_tokens(100.0, 30.0, 10_000, grown_tokens=0) == 0
    assert lead_tokens(100.0, 30.0, 10_000, grown_tokens=700) == 700
    assert lead_tokens(100.0, 5.0, 10_000, grown_tokens=700) == 500
    c = config()
    assert not wants_run(session(8_100, 100.0, 30.0, compacted_tokens=8_000), c, T0)
    assert not wants_run(session(8_999, 100.0, 30.0, compacted_tokens=8_000), c, T0)
    assert wants_run(session(9_000, 100.0, 30.0, compacted_tokens=8_000), c, T0)
    assert wants_run(session(8_100, 100.0, 30.0), c, T0)  # never compacted: the lead's cap


# ------------------------------------------------------------------------------------ steps

def test_the_largest_recent_step_decays_with_each_append_and_skips_the_first() -> None:
    # The first append brings a history at once: not a step.
    assert step_tokens_after(0.0, 50_000, first=True) == 0.0
    assert step_tokens_after(0.0, 300, first=False) == 300.0
    assert step_tokens_after(3_000.0, 300, first=False) == 3_000 * STEP_DECAY
    assert step_tokens_after(3_000.0, 4_000, first=False) == 4_000.0


@pytest.mark.parametrize(("step", "threshold", "expected"), [
    (2_000.0, 10_000, 2_000),
    (0.0, 10_000, 0),
    (2_000.0, None, 0),                                   # a messages-only trigger
    (9_000.0, 10_000, int(LEAD_MAX_SHARE * 10_000)),      # capped as the growth is
])
def test_step_lead_tokens(step: float, threshold: float | None, expected: int) -> None:
    assert step_lead_tokens(step, threshold) == expected
    assert step_lead_tokens(step, threshold, grown_tokens=0) == 0
    assert step_lead_tokens(step, threshold, grown_tokens=10**6) == expected


# (tokens, its largest recent step, summarization keys, fires): no growth lead (the pool has
# measured none), so only the step can fire it early.
STEP_CASES = [
    (8_000, 2_000.0, {}, True),                          # 8,000 + a 2,000 step reaches 10,000
    (7_999, 2_000.0, {}, False),
    (8_000, 2_000.0, {"lead_steps": False}, False),      # growth only
    (8_000, 2_000.0, {"lead": 0}, False),                # lead 0: at the trigger, steps too
    (4_999, 8_000.0, {}, False),                         # the cap: never below half the trigger
    (5_000, 8_000.0, {}, True),
    (8_000, 2_000.0, {"lead": 10}, True),                # a configured lead counts it too
]


@pytest.mark.parametrize(("tokens", "step", "keys", "fires"), STEP_CASES)
def test_a_session_one_large_step_from_its_trigger_fires_now(
        tokens: int, step: float, keys: dict[str, Any], fires: bool) -> None:
    assert_every_decision(session(tokens, 0.01, 0.0, step_tokens=step), config(**keys), fires)


def test_the_lead_is_the_larger_of_the_growth_and_the_step() -> None:
    c = config()
    policy = session_policy(session(1_000, 0.0, 0.0), c)
    growing = session(8_000, 100.0, 10.0, step_tokens=500.0)
    assert lead_parts(growing, policy, c, T0).tokens == 1_000  # the growth over 10 s
    stepping = session(8_000, 100.0, 10.0, step_tokens=1_500.0)
    parts = lead_parts(stepping, policy, c, T0)
    assert (parts.growth, parts.step, parts.tokens) == (1_000, 1_500, 1_500)
    # Held to what the session grew since its last checkpoint, as the growth is: a checkpoint
    # that left it within a step of its trigger does not fire it again at once.
    fresh = session(8_600, 100.0, 10.0, step_tokens=1_500.0, compacted_tokens=8_500)
    parts = lead_parts(fresh, policy, c, T0)
    assert (parts.growth, parts.step) == (100, 100)
    assert not wants_run(fresh, c, T0)
    # One step of its size later, it fires: the next one would cross.
    stepped = session(9_000, 100.0, 10.0, step_tokens=1_500.0, compacted_tokens=7_500)
    assert lead_parts(stepped, policy, c, T0).step == 1_500
    assert wants_run(stepped, c, T0)


@pytest.mark.parametrize("value", [0, 1, "true", "yes", None])
def test_a_bad_lead_steps_is_a_load_time_error_naming_the_key(value: Any) -> None:
    with pytest.raises(ConfigError, match=r"^summarization\.lead_steps: must be true or false"):
        config(lead_steps=value)
    with pytest.raises(PolicyError, match=r"^policy\.lead_steps: unknown key"):
        parse_policy({"lead_steps": True}, path="policy")


def test_lead_steps_is_on_by_default() -> None:
    assert build_config({}).lead_steps is True
    assert config(lead_steps=False).lead_steps is False


# ------------------------------------------------------------- an early run that frees little

EARLY_POLICY = {"trigger": {"type": "tokens", "value": 10_000},
                "keep": {"type": "messages", "value": 3}}
# Twenty usual messages, then a long observation the keep of 3 holds with the two before it.
USUAL, LONG = 200, 3_000


def _early_surface(after_long: int = 0) -> list[SurfaceNode]:
    count = 21 + after_long
    sizes = [USUAL] * 20 + [LONG] + [USUAL] * after_long
    return nodes(*(user(f"m{i}") for i in range(count)), tokens=sizes)


def _early_plan(surface: list[SurfaceNode], lead: int = 4_000, **raw: Any) -> Any:
    policy = parse_policy({**EARLY_POLICY, **raw}).resolve(128_000)
    return plan(surface, policy=policy, now=T0, run_model="gpt-4o",
                outlook=Outlook(lead_tokens=lead))


def test_a_run_fired_early_waits_for_a_long_message_to_leave_its_keep() -> None:
    # 7,000 tokens, fired by a lead of 4,000: the keep holds 3,400 of them, a summary frees
    # 3,600, and three usual steps let the 3,000-token message go from the tail.
    waiting = _early_plan(_early_surface())
    assert waiting.fired and waiting.summarize is None
    assert "fired early by its lead" in (waiting.nothing_to_do or ""), waiting.nothing_to_do
    # Three usual messages later the long one has left the keep: that growth is the wait.
    assert waiting.refire_growth == 3 * USUAL
    assert waiting.standing_tokens == waiting.pressure.tokens == 7_000
    # ... and then the run fired early summarizes it.
    later = _early_plan(_early_surface(after_long=3))
    assert later.summarize is not None and 21 in later.summarize.replace_seqs


def test_a_run_at_its_trigger_summarizes_whatever_it_frees() -> None:
    # The same surface over a trigger of 7,000: not early, summarized as before.
    over = _early_plan(_early_surface(), trigger={"type": "tokens", "value": 7_000})
    assert over.summarize is not None and over.refire_growth is None
    # Nor does an operator's run wait: forced, or with its own keep.
    policy = parse_policy(EARLY_POLICY).resolve(128_000)
    assert plan(_early_surface(), policy=policy, now=T0, force=True,
                outlook=Outlook(lead_tokens=4_000)).summarize is not None


def test_a_run_fired_early_does_not_wait_for_a_tail_that_lets_go_of_no_long_message() -> None:
    # A keep of 30 usual messages: until the trigger, its turnover adds a usual message to the
    # range for each that arrives, never half again what the run frees now: a later run frees
    # no more, and the run summarizes now.
    surface = nodes(*(user(f"m{i}") for i in range(41)), tokens=[USUAL] * 41)
    uniform = _early_plan(surface, keep={"type": "messages", "value": 30})
    assert uniform.summarize is not None and uniform.refire_growth is None


@pytest.mark.parametrize(("tail", "step", "to_trigger", "growth"), [
    ([200, 200, 3_000], 200, 3_000, 600),   # the long message leaves with the third
    ([3_000, 200, 200], 200, 3_000, 200),   # ... with the first
    ([200, 200, 3_000], 200, 600, None),    # the trigger comes first
    ([200] * 20, 200, 3_000, None),         # no long message: the tail keeps its size
])
def test_early_refire_growth(tail: list[int], step: int, to_trigger: int,
                             growth: int | None) -> None:
    # A run freeing 3,600 waits for its tail to shrink by 1,800.
    shrink = early_wait_shrink(3_600)
    assert shrink == 1_800
    assert early_refire_growth(tail, shrink=shrink, step=step, to_trigger=to_trigger) == growth


def test_the_status_of_a_session_waiting_after_an_early_run_says_so() -> None:
    # Under its trigger, waiting for growth: the early run's wait, not a low trigger's.
    info = session(7_000, 0.0, 0.0, refire_tokens=7_600, refire_version=None,
                   compacted_version=None)
    c = config()
    fired, why, _ = explain(dataclasses.replace(info, growth_rate=1_000.0, lead_s=10.0), c, T0)
    assert not fired and "fired early by its lead" in why, why
    over = dataclasses.replace(info, surface_tokens=10_500, refire_tokens=11_000)
    assert "could not bring it under its trigger" in explain(over, c, T0)[1]


def _held_surface(observation_words: int) -> list[SurfaceNode]:
    # A large old tool result, pruned but held for the summary's commit (clear_at_least, a warm
    # cache), usual messages, and an observation in the kept tail.
    return nodes(sys(), user("read it"), ai("", ("c1", "cat")), tool("c1", "data " * 6000),
                 ai("done"), *(user("word " * 100) for _ in range(6)),
                 user("a long observation " * observation_words), ai("reading"))


def _held_plan(surface: list[SurfaceNode], trigger: int) -> Any:
    policy = parse_policy({"trigger": ["tokens", trigger], "clear_at_least": 10**6,
                           "keep": {"type": "messages", "value": 3}}).resolve(128_000)
    warm = Outlook(edits_may_wait=True, last_append_at=T0 - dt.timedelta(seconds=10),
                   lead_tokens=6_000)
    return plan(surface, policy=policy, now=T0, outlook=warm)


def test_edits_held_for_the_summary_count_toward_what_its_commit_frees() -> None:
    # With the held prune the commit frees 6.5k; the observation's 1.5k leaving the keep would
    # not shrink the tail by half that, and the run summarizes. Counted without it (1.6k), it
    # would.
    result = _held_plan(_held_surface(500), 12_000)
    assert result.prune_held is not None and result.summarize is not None
    # A longer observation (4.5k) is worth the wait, with the prune still held: a run that
    # asks for no summary leaves the session at its pressure.
    small = _held_plan(_held_surface(1500), 14_000)
    assert small.summarize is None and small.prune_held is not None
    assert small.standing_tokens == small.pressure.tokens > small.tokens_after_prune
    assert small.refire_growth is not None
