"""Clearing old reasoning (``summarization.clear_thinking``): which turns lose it, which the
provider needs kept whole, and the policy key's load-time checks."""

from __future__ import annotations

from typing import Any

import pytest

from compactd.storage.messages import Message, ToolCall
from compactd.worker.compaction.planner import plan
from compactd.worker.compaction.policy import (
    ClearThinkingConfig,
    Policy,
    PolicyError,
    parse_policy,
)
from compactd.worker.compaction.reasoning import clear_thinking, loop_in_progress
from tests.support.surfaces import COUNTER, NOW, nodes, tool, user

THOUGHT = "weighing the options " * 200


def thinking(tag: str) -> dict[str, Any]:
    return {"type": "thinking", "thinking": f"{tag}: {THOUGHT}", "signature": f"sig-{tag}"}


def turn(tag: str, *calls: str, blocks: list[dict[str, Any]] | None = None) -> Message:
    content = [
        *(blocks if blocks is not None else [thinking(tag)]),
        {"type": "text", "text": f"answer {tag}"},
    ]
    return Message(
        role="assistant",
        content=content,
        tool_calls=tuple(ToolCall(id=c, name="bash") for c in calls),
    )


def session() -> list[Message]:
    """Two finished turns, then a tool-use loop in progress whose last call is open."""
    return [
        user("fix it"),
        turn("a1", "t1"),
        tool("t1", "ls output"),
        turn("a2"),
        user("and the tests"),
        turn("a3", "t2"),
        tool("t2", "pytest output"),
        turn("a4", "t3"),
    ]


def cleared_seqs(messages: list[Message], keep: int) -> list[int]:
    return [a.seq for a in clear_thinking(nodes(*messages), ClearThinkingConfig(keep), COUNTER)]


def test_older_turns_lose_their_reasoning_and_the_loop_in_progress_keeps_it() -> None:
    surface = nodes(*session())
    actions = clear_thinking(surface, ClearThinkingConfig(keep=0), COUNTER)
    assert [a.seq for a in actions] == [2, 4]  # a1 and a2; a3 and a4 are the loop in progress
    first = actions[0].message
    assert first.content == [{"type": "text", "text": "answer a1"}]
    assert first.tool_calls == surface[1].message.tool_calls  # the call itself stays
    assert first.meta["cleared_thinking"] is True and first.meta["pruned"] is True
    assert first.meta["recall"]["ref"] == "r2"  # the original, readable with history_read
    assert all(a.saved > 500 and a.edits == ("clear_thinking",) for a in actions)


@pytest.mark.parametrize(("keep", "cleared"), [(0, [2, 4]), (1, [2, 4]), (3, [2]), (4, [])])
def test_keep_counts_the_newest_turns_holding_reasoning(keep: int, cleared: list[int]) -> None:
    assert cleared_seqs(session(), keep) == cleared


def test_an_open_call_keeps_its_reasoning_even_outside_the_loop_in_progress() -> None:
    # t1 never answered, and the user has spoken since: only the open call protects it.
    messages = [user("go"), turn("a1", "t1"), user("meanwhile"), turn("a2")]
    assert cleared_seqs(messages, 0) == [4]


def test_a_loop_that_ended_on_a_reply_is_no_longer_in_progress() -> None:
    done = [user("go"), turn("a1", "t1"), tool("t1"), turn("a2")]
    assert loop_in_progress(nodes(*done)) == set()
    assert cleared_seqs(done, 0) == [2, 4]
    waiting = done[:3]  # the result is in, the model has not answered yet
    assert loop_in_progress(nodes(*waiting)) == {1}
    assert cleared_seqs(waiting, 0) == []


@pytest.mark.parametrize(
    "injected",
    [
        user("remember: run the linter", dynamic_context_reminder=True),
        user("(ui note)", hide_from_ui=True),
    ],
)
def test_a_user_message_that_is_no_request_does_not_end_the_loop_in_progress(
    injected: Message,
) -> None:
    # A reminder injected between a call's result and the next step is part of the tool-use
    # loop: the signed thinking of a3 (which made t2) must still go back whole.
    messages = [
        user("fix it"),
        turn("a1"),
        user("and the tests"),
        turn("a3", "t2"),
        tool("t2", "pytest output"),
        injected,
        turn("a4", "t3"),
    ]
    assert loop_in_progress(nodes(*messages)) == {3, 6}
    assert cleared_seqs(messages, 0) == [2]


def test_every_reasoning_shape_is_dropped_whole_and_the_rest_kept_in_order() -> None:
    blocks = [
        {"type": "redacted_thinking", "data": "opaque" * 300},
        thinking("x"),
        {"type": "reasoning", "reasoning": THOUGHT, "id": "rs_1"},
    ]
    [action] = clear_thinking(
        nodes(user(), turn("x", blocks=blocks), user("next"), turn("y")),
        ClearThinkingConfig(keep=1),
        COUNTER,
    )
    assert action.message.content == [{"type": "text", "text": "answer x"}]


def test_a_reasoning_only_reply_is_left_whole() -> None:
    bare = Message(role="assistant", content=[thinking("only")])
    assert cleared_seqs([user(), bare, user("next"), turn("y")], 0) == [4]


def test_the_plan_carries_the_clearing_and_holds_it_under_clear_at_least() -> None:
    policy = Policy(trigger=(), clear_thinking=ClearThinkingConfig(keep=0), clear_at_least=100_000)
    surface = nodes(*session())
    forced = plan(surface, policy=policy, now=NOW, force=True)
    assert [a.seq for a in forced.prune] == [2, 4] and forced.prune_held is None
    from compactd.worker.compaction.planner import Outlook

    warm = plan(
        surface,
        policy=policy,
        now=NOW,
        force=True,
        outlook=Outlook(edits_may_wait=True, last_append_at=NOW),
    )
    assert forced.prune == warm.prune  # forced runs never wait
    off = plan(surface, policy=Policy(trigger=()), now=NOW, force=True)
    assert off.prune == ()


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        ({"keep": -1}, "non-negative"),
        ({"keep": 1.5}, "integer"),
        ({"keep": "two"}, ""),
        ({"keep": 1, "turns": 2}, "unknown key"),
        (3, "mapping"),
    ],
)
def test_bad_clear_thinking_is_a_load_time_error_naming_the_key(raw: Any, why: str) -> None:
    with pytest.raises(PolicyError) as caught:
        parse_policy({"clear_thinking": raw})
    assert caught.value.path.startswith("summarization.clear_thinking"), caught.value
    assert why in str(caught.value)


def test_clear_thinking_round_trips_through_the_config() -> None:
    policy = parse_policy({"clear_thinking": {"keep": 2}})
    assert policy.clear_thinking == ClearThinkingConfig(keep=2)
    assert parse_policy(policy.to_config()) == policy
    assert parse_policy({"clear_thinking": None}).clear_thinking is None
    assert parse_policy({"clear_thinking": {}}).clear_thinking == ClearThinkingConfig(keep=1)


def test_langchain_messages_mirrored_by_the_middleware_clear_the_same_way() -> None:
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage

    from compactd.scheduler.langchain import to_compactd, to_langchain
    from compactd.storage.messages import parse_openai

    def ai(tag: str, call: str | None = None) -> AIMessage:
        calls = [{"id": call, "name": "bash", "args": {}}] if call else []
        return AIMessage([thinking(tag), {"type": "text", "text": tag}], tool_calls=calls)

    state = [
        HumanMessage("go"),
        ai("a1", "c1"),
        ToolMessage("ok", tool_call_id="c1"),
        ai("a2"),
        HumanMessage("next"),
        ai("a3", "c2"),
    ]
    surface = nodes(*(parse_openai(m) for m in to_compactd(state)))
    actions = clear_thinking(surface, ClearThinkingConfig(keep=0), COUNTER)
    assert [a.seq for a in actions] == [2, 4]
    back = [to_langchain({**a.message.to_openai(), "seq": a.seq}) for a in actions]
    assert [m.content for m in back] == [
        [{"type": "text", "text": "a1"}],
        [{"type": "text", "text": "a2"}],
    ]
    assert back[0].tool_calls[0]["id"] == "c1"  # type: ignore[attr-defined]
    kept = to_langchain({**surface[-1].message.to_openai(), "seq": 6})
    assert kept.content == state[-1].content  # the open call's thinking, signature and all
