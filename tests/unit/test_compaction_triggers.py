"""Pressure and trigger tables (pipeline steps 1 and 2)."""

from __future__ import annotations

import logging

import pytest

from compactd.worker.compaction.policy import parse_policy
from compactd.worker.compaction.triggers import Pressure, measure, should_compact
from tests.support.surfaces import ai, ckpt, nodes, sys, user


def _policy(trigger: object, window: int | None = None):
    return parse_policy({"trigger": trigger}).resolve(window)


@pytest.mark.parametrize(
    ("trigger", "window", "tokens", "messages", "fired"),
    [
        # one clause of each kind, at, under and over its threshold
        ({"type": "tokens", "value": 4000}, None, 3999, 10, False),
        ({"type": "tokens", "value": 4000}, None, 4000, 10, True),
        ({"type": "messages", "value": 50}, None, 10, 49, False),
        ({"type": "messages", "value": 50}, None, 10, 50, True),
        ({"type": "fraction", "value": 0.8}, 10_000, 7999, 1, False),
        ({"type": "fraction", "value": 0.8}, 10_000, 8000, 1, True),
        # a list is OR (DeerFlow items and LangChain tuples alike)
        ([{"type": "tokens", "value": 4000}, {"type": "messages", "value": 50}], None, 10, 50,
         True),
        ([["tokens", 4000], ["messages", 50]], None, 4000, 1, True),
        ([["tokens", 4000], ["messages", 50]], None, 3999, 49, False),
        # a mapping is AND (LangChain's TriggerClause)
        ({"tokens": 4000, "messages": 30}, None, 5000, 29, False),
        ({"tokens": 4000, "messages": 30}, None, 5000, 30, True),
        ([{"tokens": 4000, "messages": 30}, ["fraction", 0.5]], 8000, 4000, 1, True),
        # the fraction denominator is the run model's window: 0.8 of 64k is 51.2k, not 102k
        ({"type": "fraction", "value": 0.8}, 64_000, 51_200, 1, True),
        ({"type": "fraction", "value": 0.8}, 64_000, 51_199, 1, False),
        # without a window a fraction clause is dropped: auto compaction is off
        ({"type": "fraction", "value": 0.8}, None, 10**9, 10**6, False),
        ([["fraction", 0.8], ["tokens", 100]], None, 100, 1, True),
    ],
)
def test_should_compact(trigger, window, tokens, messages, fired):
    pressure = Pressure(tokens, messages, tokens / window if window else None)
    got, reason = should_compact(pressure, _policy(trigger, window))
    assert got is fired
    assert reason


def test_disabled_policy_never_fires():
    policy = parse_policy({"enabled": False, "trigger": ["tokens", 1]}).resolve(None)
    assert should_compact(Pressure(10, 10, None), policy) == (
        False, "automatic compaction is disabled")


def test_all_fraction_clauses_dropped_warns_and_turns_auto_off(caplog):
    with caplog.at_level(logging.WARNING):
        policy = _policy([["fraction", 0.8], {"fraction": 0.5, "tokens": 10}], None)
    assert policy.trigger == () and not policy.auto
    assert "fraction clauses dropped" in caplog.text
    fired, reason = should_compact(Pressure(10**9, 10**6, None), policy)
    assert not fired and "off" in reason


@pytest.mark.parametrize(
    ("envelope", "reported", "window", "expected_tokens"),
    [
        (0, None, None, "surface"),
        (500, None, None, "surface+500"),
        (500, 10, None, "surface+500"),  # our count is larger: it wins
        (0, 10**6, 2 * 10**6, 10**6),  # the provider's count is larger: it wins
    ],
)
def test_measure_counts_envelope_checkpoint_and_reported(envelope, reported, window,
                                                         expected_tokens):
    surface = nodes(sys(), ckpt("summary of earlier work"), user("hi"), ai("hello"))
    base = sum(n.tokens for n in surface)
    # the checkpoint node is counted as rendered, authority contract included
    assert surface[1].tokens > 60
    pressure = measure(surface, envelope_tokens=envelope, reported_input_tokens=reported,
                       context_window=window)
    want = {"surface": base, "surface+500": base + 500}.get(expected_tokens, expected_tokens)
    assert pressure.tokens == want
    assert pressure.messages == 4
    assert pressure.fraction == (want / window if window else None)
