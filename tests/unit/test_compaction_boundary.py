"""Range selection tables: keep, tool-pair safety, rescued nodes, forced mode (step 4)."""

from __future__ import annotations

import pytest

from compactd.worker.compaction.boundary import (
    protected,
    resolve_keep,
    select_range,
    unsafe_boundaries,
)
from compactd.worker.compaction.policy import Clause, Policy
from tests.support.surfaces import ai, ckpt, nodes, sys, tool, user

M = Clause("messages", 2)


def _select(surface, keep, *, window=None, force=False, min_tokens=0, policy=None):
    policy = (policy or Policy()).resolve(window)
    sel = select_range(surface, keep=keep, policy=policy, force=force, min_tokens=min_tokens)
    if sel.nothing_to_do:
        return None
    return [n.seq for i, n in enumerate(surface[sel.start:sel.end], sel.start)
            if i not in sel.kept]


def _flat(*messages, tokens=100):
    return nodes(*messages, tokens=[tokens] * len(messages))


CASES = [
    # plain keep messages 2: system stays before the range, latest user request is in the tail
    ("keep messages", _flat(sys(), user("u1"), ai("a1"), user("u2"), ai("a2"), user("u3"),
                            ai("a3")), M, [2, 3, 4, 5]),
    # the cut falls between a call and its result: it moves toward the head; the latest
    # request u2 stays, the work before and after it goes
    ("cut inside a group", _flat(sys(), user("u1"), ai("a1"), user("u2"), ai("", ("c1", "t")),
                                 tool("c1"), ai("", ("c2", "t")), tool("c2"), ai("end")),
     Clause("messages", 2), [2, 3, 5, 6]),
    # parallel calls: the cut between two results of one assistant message moves before it
    ("parallel calls", _flat(user("u1"), ai("a1"), user("u2"), ai("", ("p1", "t"), ("p2", "t")),
                             tool("p1"), tool("p2")), Clause("messages", 1), [1, 2]),
    # interleaved groups (a partial overlap): every boundary inside either is unsafe
    ("interleaved groups", _flat(user("u1"), ai("a1"), user("u2"), ai("", ("i1", "t")),
                                 ai("", ("i2", "t")), tool("i2"), tool("i1"), ai("end")),
     Clause("messages", 3), [1, 2]),
    # keep tokens: the longest tail within the budget (2 x 100 <= 250)
    ("keep tokens", _flat(user("u0"), ai("a0"), user("u1"), ai("a1"), ai("a2")),
     Clause("tokens", 250), [1, 2]),
    # nothing fits: the whole surface is the head; the latest request u1 splits it, both
    # segments go in one range and u1 stays
    ("keep tokens, none fits", _flat(user("u0"), ai("a0"), user("u1"), ai("a1")),
     Clause("tokens", 50), [1, 2, 4]),
    # a reminder and the latest request between segments: one range, both stay
    ("rescued nodes split", _flat(sys(), user("u1"), ai("a1"),
                                  sys("today is Monday", dynamic_context_reminder=True),
                                  ai("a2"), user("u2"), ai("a3"), ai("a4"), ai("last")),
     Clause("messages", 1), [2, 3, 5, 7, 8]),
    # a pinned message inside the head splits it: what came before it stays before it, so
    # only the group with more tokens is replaced
    ("pinned splits", _flat(sys(), user("u1"), user("pin", pinned=True), ai("a1"), user("u2"),
                            ai("a2"), ai("a3"), user("u3"), ai("last")),
     Clause("messages", 1), [4, 5, 6, 7]),
    ("reminder rescued", _flat(user("u1"), ai("a1"), ai("a2"),
                               sys("today is Monday", dynamic_context_reminder=True),
                               user("u2"), ai("x")), Clause("messages", 1), [1, 2, 3]),
    # the latest real user request of a long first turn is rescued; its steps are compacted
    ("long first turn", _flat(sys(), user("the task"), ai("", ("s1", "t")), tool("s1"),
                              ai("", ("s2", "t")), tool("s2"), ai("", ("s3", "t")), tool("s3")),
     Clause("messages", 2), [3, 4, 5, 6]),
    # an earlier checkpoint at the head lies inside the range: summaries merge, never stack
    ("checkpoint merges", _flat(sys(), ckpt("before"), user("u1"), ai("a1"), user("u2"),
                                ai("a2")), M, [2, 3, 4]),
    # a lone checkpoint is not a candidate (the other segment is replaced even if smaller)
    ("lone checkpoint", _flat(sys(), ckpt("before"), user("pin", pinned=True), ai("a1"),
                              user("u2"), ai("a2")), M, [4]),
    # a pinned call keeps its results: they cannot be separated from it
    ("pinned call", _flat(user("u1"), ai("a1"), ai("", ("k1", "t"), pinned=True), tool("k1"),
                          ai("a2"), ai("a3"), ai("a4"), user("u2"), ai("z")),
     Clause("messages", 2), [5, 6, 7]),
    ("system in the middle", _flat(user("u1"), ai("a1"), sys("note"), ai("a2"), user("u2"),
                                   ai("z")), Clause("messages", 1), [1, 2]),
    # nothing to do
    ("all kept", _flat(sys(), user("u1"), ai("a1")), Clause("messages", 5), None),
    ("only protected", _flat(sys(), user("p", pinned=True), user("u"), ai("a")),
     Clause("messages", 1), None),
    ("one open step", _flat(user("u1"), ai("", ("o1", "t"))), Clause("messages", 1), None),
    # a call still waiting for a result keeps everything from it on (u1 is the latest request)
    ("open call pins", _flat(user("u1"), ai("a1"), ai("", ("o1", "t"), ("o2", "t")), tool("o1"),
                             ai("b")), Clause("messages", 1), [2]),
]


@pytest.mark.parametrize(("surface", "keep", "replaced"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_select_range(surface, keep, replaced):
    assert _select(surface, keep) == replaced


FORCED = [
    # keeps the newest whole tool-call group and the latest user request, drops the rest on
    # both sides of the request, whichever side is larger
    ("newest group", nodes(sys(), user("u1"), ai("a1"), user("u2"), ai("", ("c1", "t")),
                           tool("c1"), ai("", ("c2", "t")), tool("c2"), ai("end"),
                           tokens=[10, 10, 10, 10, 300, 300, 10, 10, 10]), [2, 3, 5, 6]),
    ("newest group, earlier bigger", nodes(sys(), user("u1"), ai("a1"), user("u2"),
                                           ai("", ("c1", "t")), tool("c1"),
                                           ai("", ("c2", "t")), tool("c2"),
                                           tokens=[10, 300, 300, 10, 10, 10, 10, 10]),
     [2, 3, 5, 6]),
    ("plain chat", _flat(sys(), user("u1"), ai("a1"), user("u2"), ai("a2"), user("u3")),
     [2, 3, 4]),
    # a group of an earlier turn is history: the turns after it go with it, the latest
    # request and the last reply stay
    ("old group, later plain turns", _flat(sys(), user("u1"), ai("", ("c1", "t")), tool("c1"),
                                           ai("a1"), user("u2"), ai("a2"), user("u3"),
                                           ai("a3")), [2, 3, 4, 5, 6, 7]),
    # the newest group of the current turn stays whole, also when older turns hold groups
    ("group of the current turn", _flat(sys(), user("u1"), ai("", ("c1", "t")), tool("c1"),
                                        ai("a1"), user("u2"), ai("", ("c2", "t")), tool("c2")),
     [2, 3, 4, 5]),
    ("one indivisible group", _flat(ai("", ("g1", "t"), ("g2", "t")), tool("g1"), tool("g2")),
     None),
    ("one unclosed step", _flat(sys(), user("u"), ai("", ("o", "t"))), None),
]


@pytest.mark.parametrize(("surface", "replaced"), [c[1:] for c in FORCED],
                         ids=[c[0] for c in FORCED])
def test_forced_selection(surface, replaced):
    # forced mode ignores keep (and the trigger) unless an explicit override is given
    policy = Policy(keep=Clause("messages", 3))
    assert _select(surface, None, force=True, policy=policy) == replaced


def test_forced_with_keep_override_uses_it():
    surface = _flat(user("u1"), ai("a1"), user("u2"), ai("a2"), user("u3"), ai("a3"))
    assert _select(surface, Clause("messages", 4), force=True) == [1, 2]


@pytest.mark.parametrize(
    ("keep", "window", "expected"),
    [
        (None, 100_000, Clause("fraction", 0.16)),
        (None, None, Clause("messages", 20)),
        (Clause("fraction", 0.3), None, Clause("messages", 20)),
        (Clause("fraction", 0.3), 1000, Clause("fraction", 0.3)),
        (Clause("tokens", 10), None, Clause("tokens", 10)),
    ],
)
def test_resolve_keep(keep, window, expected):
    assert resolve_keep(Policy(keep=keep).resolve(window)) == expected


def test_keep_fraction_and_retain_ratio_use_the_window():
    surface = _flat(user("u0"), ai("a0"), user("u1"), ai("a1"), ai("a2"))
    # 0.25 of 1000 = 250 tokens: the last two nodes
    assert _select(surface, Clause("fraction", 0.25), window=1000) == [1, 2]
    # default: retain 0.16 of 1250 = 200 tokens
    assert _select(surface, None, window=1250) == [1, 2]
    # default without a window: the last 20 messages, so nothing here
    assert _select(surface, None) is None


def test_min_tokens_refuses_runs_no_larger_than_an_empty_checkpoint():
    surface = _flat(user("u1"), ai("a1"), user("u2"), ai("a2"), tokens=30)
    assert _select(surface, Clause("messages", 2), min_tokens=60) is None
    assert _select(surface, Clause("messages", 2), min_tokens=59) == [1, 2]


@pytest.mark.parametrize(
    ("surface", "unsafe"),
    [
        (_flat(user(), ai("", ("a", "t")), tool("a"), ai()), [0, 0, 1, 0, 0]),
        (_flat(ai("", ("a", "t"), ("b", "t")), tool("b"), tool("a")), [0, 1, 1, 0]),
        (_flat(ai("", ("a", "t")), ai("x"), tool("a")), [0, 1, 1, 0]),
        # Still waiting for its result: the call message is protected instead, and a result
        # can only come after everything on the surface, so nothing around it is unsafe.
        (_flat(ai("", ("a", "t")), user()), [0, 0, 0]),
        (_flat(ai("", ("a", "t"), ("b", "t")), user(), tool("a"), user()), [0, 1, 1, 0, 0]),
        (_flat(tool("orphan"), user()), [0, 0, 0]),
        # a reused id pairs with the nearest earlier call: two groups, not one long span
        (_flat(ai("", ("r", "t")), tool("r"), user(), ai("", ("r", "t")), tool("r")),
         [0, 1, 0, 0, 1, 0]),
    ],
)
def test_unsafe_boundaries(surface, unsafe):
    assert unsafe_boundaries(surface) == [bool(u) for u in unsafe]


def test_protected_marks_system_pinned_reminder_and_latest_request():
    surface = _flat(sys(), user("old"), user("pin", pinned=True), ckpt("s"),
                    user("r", dynamic_context_reminder=True), user("latest"), ai("a"),
                    user("hidden", hide_from_ui=True))
    assert protected(surface) == [True, False, True, False, True, True, False, False]
