"""keep_at: pickup: the range a plan chooses given what the agent is expected to append before
it picks the checkpoint up, and what no expectation may ever make it summarize."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from compactd.storage.records import AppendedMessage
from compactd.worker.compaction.arrivals import (
    IDLE_INTERVALS,
    MEASURE_APPENDS,
    Arrivals,
    Cadence,
    Step,
    append_cadence,
    arrivals_at_cadence,
    claim_to_commit_s,
    expected_arrivals,
    keep_at_pickup,
    recent_step,
    tokens_per_message,
)
from compactd.worker.compaction.boundary import protected, unsafe_boundaries
from compactd.worker.compaction.planner import Outlook, plan
from compactd.worker.compaction.policy import Clause, Policy, PolicyError, parse_policy
from tests.support.surfaces import NOW, ai, nodes, sys, tool, user

TOKENS = 100  # every node's size, so a token budget is a count of nodes


def _policy(keep: Clause, keep_at: str = "pickup", trigger: int = 1_000) -> Policy:
    return Policy(trigger=((Clause("tokens", trigger),),), keep=keep, keep_at=keep_at,
                  trim_tokens_to_summarize=None)


def _steps(count: int, *, first: int = 0) -> list:
    """``count`` closed tool steps: an assistant call and its result each."""
    out = []
    for i in range(first, first + count):
        out += [ai("", (f"c{i}", "t")), tool(f"c{i}", f"result {i}")]
    return out


def _surface(*messages):
    return nodes(*messages, tokens=[TOKENS] * len(messages))


def _arrive(messages: int = 0, tokens: int = 0) -> Arrivals:
    return Arrivals(tokens=tokens, messages=messages, seconds=1.0, rate_tokens_per_s=tokens)


def _replaced(surface, policy: Policy, arrivals: Arrivals | None = None, **kw) -> list[int]:
    step = plan(surface, policy=policy, now=NOW, outlook=Outlook(arrivals=arrivals),
                **kw).summarize
    assert step is not None
    return list(step.replace_seqs)


def _kept_after(surface, replaced: list[int]) -> int:
    """Nodes after the replaced run: the tail the checkpoint is followed by at the read."""
    last = max(replaced)
    return sum(1 for n in surface if n.seq > last)


# system, the request, 12 closed steps (24 nodes): seqs 1, 2, 3..26
LONG = _surface(sys(), user("do the task"), *_steps(12))


@pytest.mark.parametrize(("keep", "arrivals", "kept"), [
    # messages 8: 8 kept at the read (the claim's range), fewer by the messages expected
    (Clause("messages", 8), None, 8),
    (Clause("messages", 8), _arrive(messages=0), 8),
    (Clause("messages", 8), _arrive(messages=2), 6),
    (Clause("messages", 8), _arrive(messages=4), 4),
    # an odd count would cut a step in two: the cut moves toward the head (one more kept)
    (Clause("messages", 8), _arrive(messages=3), 6),
    # more expected than the keep: nothing kept (never less than zero)
    (Clause("messages", 8), _arrive(messages=8), 0),
    (Clause("messages", 8), _arrive(messages=50), 0),
    # a token budget of 8 nodes less the tokens expected
    (Clause("tokens", 8 * TOKENS), _arrive(tokens=4 * TOKENS), 4),
    # 399 tokens hold 3 nodes, a cut inside a step: it moves toward the head
    (Clause("tokens", 8 * TOKENS), _arrive(tokens=4 * TOKENS + 1), 4),
    (Clause("tokens", 8 * TOKENS), _arrive(tokens=5 * TOKENS + 1), 2),
    (Clause("tokens", 8 * TOKENS), _arrive(tokens=100 * TOKENS), 0),
], ids=lambda v: repr(v) if not isinstance(v, Arrivals) else f"{v.messages}m{v.tokens}t")
def test_the_kept_tail_is_smaller_by_what_is_expected_to_arrive(keep, arrivals, kept) -> None:
    replaced = _replaced(LONG, _policy(keep), arrivals)
    assert _kept_after(LONG, replaced) == kept
    assert replaced[0] == 3  # head-anchored after the system message and the rescued request


def test_a_fraction_keep_is_a_token_budget_of_the_window() -> None:
    policy = Policy(trigger=((Clause("tokens", 1_000),),), keep=Clause("fraction", 0.008),
                    trim_tokens_to_summarize=None).resolve(100_000)  # 800 tokens: 8 nodes
    assert _kept_after(LONG, _replaced(LONG, policy)) == 8
    assert _kept_after(LONG, _replaced(LONG, policy, _arrive(tokens=4 * TOKENS))) == 4


def test_keep_at_claim_reproduces_the_range_without_an_expectation() -> None:
    for keep in (Clause("messages", 8), Clause("tokens", 800)):
        today = plan(LONG, policy=_policy(keep, "claim"), now=NOW)
        claimed = plan(LONG, policy=_policy(keep, "claim"), now=NOW,
                       outlook=Outlook(arrivals=_arrive(messages=4, tokens=400)))
        assert claimed.summarize == today.summarize
        assert claimed.summarize is not None


def test_an_explicit_override_is_smaller_too_but_a_forced_reduction_takes_no_expectation(
        ) -> None:
    policy = _policy(Clause("messages", 8))
    override = _replaced(LONG, policy, _arrive(messages=4), force=True,
                         keep_override=Clause("messages", 10))
    assert _kept_after(LONG, override) == 6
    forced = plan(LONG, policy=policy, now=NOW, force=True).summarize
    forced_expecting = plan(LONG, policy=policy, now=NOW, force=True,
                            outlook=Outlook(arrivals=_arrive(messages=4))).summarize
    assert forced_expecting == forced


def test_the_latest_user_request_is_never_summarized_however_much_is_expected() -> None:
    surface = _surface(sys(), user("old"), *_steps(6), user("the request now"),
                       *_steps(1, first=6))
    latest = surface[-3].seq
    replaced = _replaced(surface, _policy(Clause("messages", 4)), _arrive(messages=40))
    assert latest not in replaced
    # the steps before the request and the one taken on it go, in one checkpoint after it
    assert replaced == [n.seq for n in surface[1:-3]] + [n.seq for n in surface[-2:]]


def test_an_open_call_is_never_summarized_however_much_is_expected() -> None:
    # The open call sits before the last closed step: that step could be summarized, the open
    # call's message cannot, so the range stops before it.
    surface = _surface(sys(), user("go"), *_steps(5), ai("", ("open", "t")),
                       *_steps(2, first=5))
    opened = surface[12].seq
    replaced = _replaced(surface, _policy(Clause("messages", 4)), _arrive(messages=40))
    assert opened not in replaced
    assert max(replaced) < opened


def test_a_pinned_message_is_never_summarized_however_much_is_expected() -> None:
    pinned = user("remember: the deploy key is in vault", pinned=True)
    surface = _surface(sys(), user("go"), *_steps(3), pinned, *_steps(6, first=3))
    replaced = _replaced(surface, _policy(Clause("messages", 4)), _arrive(messages=40))
    assert surface[8].seq not in replaced


@settings(max_examples=150, deadline=None)
@given(steps=st.integers(1, 10), keep=st.integers(1, 12), expected=st.integers(0, 30),
       open_at=st.one_of(st.none(), st.integers(0, 9)), pin_at=st.one_of(st.none(),
                                                                        st.integers(0, 9)))
def test_no_expectation_makes_a_range_the_safety_rules_forbid(steps, keep, expected, open_at,
                                                               pin_at) -> None:
    messages = [sys(), user("go")]
    for i in range(steps):
        if i == open_at:
            messages.append(ai("", (f"open{i}", "t")))
        if i == pin_at:
            messages.append(user(f"pinned {i}", pinned=True))
        messages += _steps(1, first=i)
    surface = _surface(*messages)
    result = plan(surface, policy=_policy(Clause("messages", keep)), now=NOW,
                  outlook=Outlook(arrivals=_arrive(messages=expected,
                                                   tokens=expected * TOKENS)))
    if result.summarize is None:
        return
    index = {n.seq: i for i, n in enumerate(surface)}
    replaced = [index[s] for s in result.summarize.replace_seqs]
    kept = [index[s] for s in result.summarize.kept_inside]
    guard = protected(surface)
    unsafe = unsafe_boundaries(surface)
    assert not any(guard[i] for i in replaced)
    assert sorted(replaced + kept) == list(range(replaced[0], replaced[-1] + 1))
    assert not unsafe[replaced[0]] and not unsafe[replaced[-1] + 1]
    # Never more kept than the policy asked at the read: an expectation only takes away.
    claimed = plan(surface, policy=_policy(Clause("messages", keep)), now=NOW).summarize
    if claimed is not None:
        assert replaced[-1] >= index[claimed.replace_seqs[-1]]


@pytest.mark.parametrize(("durations", "seconds"), [
    ([], None),
    ([2.0], 2.0),
    ([1.0, 2.0, 3.0, 4.0], 3.0),
    ([4.0, 1.0, 3.0, 2.0], 3.0),  # any order
    ([1.0] * 9 + [60.0], 1.0),  # one straggler does not set the expectation
    ([1.0, float("nan"), -3.0], 1.0),  # nothing a clock could not have measured
])
def test_claim_to_commit_is_a_high_percentile_of_recent_durations(durations, seconds) -> None:
    assert claim_to_commit_s(durations) == seconds


def test_expected_arrivals_are_the_growth_to_the_commit_and_the_step_before_the_pickup(
        ) -> None:
    surface = nodes(sys("x" * 4000), *_steps(4), tokens=[5000] + [50] * 8)
    assert tokens_per_message(surface) == 50  # the system message is not what arrives
    assert recent_step(surface) == Step(tokens=100, messages=2)
    got = expected_arrivals(40.0, 3.0, surface)
    # 120 tokens to the commit (2.4 messages), then a step of 100 tokens, 2 messages
    assert (got.tokens, got.messages) == (220, 4)
    assert got.to_json()["pickup_step"] == {"tokens": 100, "messages": 2}
    # no time to the commit: the step the pickup comes after is still expected
    assert (expected_arrivals(40.0, 0.0, surface).tokens,
            expected_arrivals(40.0, 0.0, surface).messages) == (100, 2)
    assert expected_arrivals(float("nan"), 3.0, surface).tokens == 100
    assert expected_arrivals(40.0, 3.0, nodes(sys())).messages == 0
    assert expected_arrivals(40.0, 3.0, nodes(sys())).tokens == 120


def test_a_step_is_an_assistant_message_and_what_follows_it() -> None:
    # a tool step: the call and two results
    surface = nodes(sys(), user("go"), ai("", ("a", "t"), ("b", "t")), tool("a", "1"),
                    tool("b", "2"), ai("", ("c", "t"), ("d", "t")), tool("c", "3"),
                    tool("d", "4"), tokens=[10, 30, 10, 10, 10, 10, 10, 10])
    assert recent_step(surface) == Step(tokens=45, messages=3.5)  # the request rides along
    # a conversation with no assistant message steps a message at a time
    assert recent_step(nodes(user("a"), user("b"), tokens=[10, 30])) == Step(20, 1)
    assert recent_step(nodes(sys())) is None


def test_keep_at_pickup_never_keeps_less_than_zero() -> None:
    big = _arrive(messages=99, tokens=99_999)
    assert keep_at_pickup(Clause("messages", 6), big, None) == Clause("messages", 0)
    assert keep_at_pickup(Clause("tokens", 600), big, None) == Clause("tokens", 0)
    assert keep_at_pickup(Clause("fraction", 0.1), _arrive(tokens=300), 10_000) == Clause(
        "tokens", 700)


def test_keep_at_is_pickup_or_claim_and_anything_else_is_refused_by_name() -> None:
    assert Policy().keep_at == "pickup"
    assert parse_policy({"keep_at": "claim"}).keep_at == "claim"
    assert parse_policy(parse_policy({"keep_at": "claim"}).to_config()).keep_at == "claim"
    for bad in ("land", "", None, 1, ["pickup"]):
        with pytest.raises(PolicyError, match=r"^summarization\.keep_at: must be one of"):
            parse_policy({"keep_at": bad})


def _appended(*appends: tuple[float, Sequence[int]]) -> list[AppendedMessage]:
    """Messages as a runtime appended them: (seconds after NOW, each message's tokens) an
    append, oldest first."""
    out: list[AppendedMessage] = []
    for at, sizes in appends:
        for size in sizes:
            out.append(AppendedMessage(seq=len(out) + 1, at=NOW + dt.timedelta(seconds=at),
                                       tokens=size))
    return out


def _stepping(count: int, every_s: float = 0.1, sizes: Sequence[int] = (60, 75),
              start_s: float = 0.0) -> list[tuple[float, Sequence[int]]]:
    """``count`` appends of one step each (an assistant call and its result), ``every_s``
    apart."""
    return [(start_s + i * every_s, sizes) for i in range(count)]


def _cadence(*appends: tuple[float, Sequence[int]]) -> Cadence:
    cadence = append_cadence(_appended(*appends))
    assert cadence is not None
    return cadence


def test_the_cadence_is_the_median_interval_and_the_median_append() -> None:
    cadence = _cadence(*_stepping(16))
    assert cadence.interval_s == pytest.approx(0.1)
    assert cadence.append == Step(tokens=135, messages=2)
    assert (cadence.intervals, cadence.last_at) == (15, NOW + dt.timedelta(seconds=1.5))
    # The oldest append only starts the first interval (the read's limit may have cut it):
    # a window that begins inside an append measures the same.
    assert append_cadence(_appended((-0.1, [40]), *_stepping(16))) == append_cadence(
        _appended((-0.1, [900, 40]), *_stepping(16)))


def test_a_large_observation_in_the_window_does_not_shrink_the_expected_messages() -> None:
    # A SWE-agent session: steps of about 135 tokens, one of them a 9,000-token observation.
    steady = _stepping(16)
    observed = [*steady[:10], (steady[10][0], [60, 9_000]), *steady[11:]]
    plain = arrivals_at_cadence(_cadence(*steady), 0.3)
    large = arrivals_at_cadence(_cadence(*observed), 0.3)
    # Three appends to the commit and the one before the pickup, two messages each.
    assert plain.messages == large.messages == 8
    assert large.measure == MEASURE_APPENDS
    # Converted at the window's mean message size, the same growth gave fewer than half.
    window = [n.tokens for n in _appended(*observed)][-32:]
    grown = plain.rate_tokens_per_s * 0.3
    assert grown / (sum(window) / len(window)) + 2 < plain.messages / 2
    # A token keep expects the median append, not the observation spread over the window.
    assert large.tokens == plain.tokens == 4 * 135


def test_an_idle_gap_in_the_window_does_not_stretch_the_interval() -> None:
    # The user read for a minute between two runs of steps.
    cadence = _cadence(*_stepping(8), *_stepping(8, start_s=60.0))
    assert cadence.interval_s == pytest.approx(0.1)
    assert arrivals_at_cadence(cadence, 0.3).messages == 8


def test_a_runtime_appending_each_message_alone_is_read_at_its_step() -> None:
    # The model's reply, then its tool's result 0.1 s later, then 0.9 s to the next reply:
    # a message an append, two a second. An odd count of intervals, so their plain median
    # is the short one.
    appends = [(t, [70]) for i in range(7) for t in (i * 1.0, i * 1.0 + 0.1)]
    cadence = _cadence(*appends)
    assert cadence.intervals == 13
    assert cadence.interval_s == pytest.approx(0.5)
    assert cadence.append == Step(tokens=70, messages=1)
    # Two messages a second over 1.5 s, and the one before the pickup.
    assert arrivals_at_cadence(cadence, 1.5).messages == 4


def test_an_idle_gap_among_few_intervals_does_not_stretch_the_interval() -> None:
    # Too few intervals for adjacent means: one pause would move most of them.
    cadence = _cadence(*_stepping(3), *_stepping(3, start_s=60.0))
    assert cadence.intervals == 5 and cadence.interval_s == pytest.approx(0.1)


@pytest.mark.parametrize(("appends", "why"), [
    (_stepping(4), "three intervals"),
    ([(0.0, [50] * 20)], "one append"),
    ([(0.0, [50])] * 10, "an ingest: every append in one instant"),
    ([], "nothing appended"),
])
def test_too_few_appends_have_no_cadence(appends, why) -> None:
    assert append_cadence(_appended(*appends)) is None, why


def test_a_session_that_paused_for_several_intervals_is_not_stepping_at_its_cadence() -> None:
    cadence = _cadence(*_stepping(16))
    last = cadence.last_at
    assert cadence.stepping_at(last + dt.timedelta(seconds=0.05))
    assert cadence.stepping_at(last + dt.timedelta(seconds=IDLE_INTERVALS * 0.1 - 0.01))
    assert not cadence.stepping_at(last + dt.timedelta(seconds=IDLE_INTERVALS * 0.1 + 0.01))


def test_arrivals_at_the_cadence_are_the_appends_to_the_commit_and_one_before_the_pickup(
        ) -> None:
    cadence = Cadence(interval_s=0.5, append=Step(tokens=300, messages=3), intervals=9,
                      last_at=NOW)
    got = arrivals_at_cadence(cadence, 1.0)
    assert (got.tokens, got.messages, got.pickup_step) == (900, 9, Step(300, 3))
    assert got.rate_tokens_per_s == 600
    assert got.to_json() == {
        "tokens": 900, "messages": 9, "claim_to_commit_s": 1.0, "rate_tokens_per_s": 600.0,
        "pickup_step": {"tokens": 300, "messages": 3}, "measure": "appends",
        "append_interval_s": 0.5, "appends_measured": 9}
    # No time to the commit, or none a clock could measure: the pickup's append alone.
    for seconds in (0.0, -1.0, float("nan")):
        assert arrivals_at_cadence(cadence, seconds).messages == 3
    # The growth-rate estimate says which measure it is.
    assert expected_arrivals(40.0, 3.0, nodes(sys())).to_json()["measure"] == "growth_rate"
