"""Old reasoning cleared on the user's path: an Anthropic transcript with signed thinking blocks,
ingested by the CLI and compacted by a real Celery worker on SQLite and on PostgreSQL. The older
turns lose their reasoning, the tool-use loop in progress (its last call still open) keeps its
thinking byte for byte, and the originals stay in the log. A clearing too small to pay for
breaking the agent's cache waits, as any other model-free edit does."""

from __future__ import annotations

import json
from typing import Any

import pytest

from compactd.storage.kinds import JournalKind
from compactd.storage.records import EventRecord, RunRecord
from tests.support.probes import query
from tests.support.stack import Stack, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.redis]

THOUGHT = "Weighing which module owns the retry budget before touching it. " * 120


def thinking(turn: int) -> dict[str, Any]:
    return {"type": "thinking", "thinking": f"turn {turn}: {THOUGHT}",
            "signature": f"EqQBCkYIAxgCIkD{turn:04d}signed+/=="}


def assistant(turn: int, call: str | None = None) -> dict[str, Any]:
    content: list[dict[str, Any]] = [thinking(turn), {"type": "text", "text": f"step {turn}"}]
    if call is not None:
        content.append({"type": "tool_use", "id": call, "name": "bash",
                        "input": {"cmd": f"pytest -k case{turn}"}})
    return {"role": "assistant", "content": content}


def result(call: str, output: str = "2 passed") -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call,
                                         "content": output}]}


LOG = "collected 40 items; case 7 retried 3 times before passing\n" * 60


# Three finished turns, then a tool-use loop in progress whose last call has no result yet.
TRANSCRIPT = [
    {"role": "user", "content": "Fix the flaky retry test."},
    assistant(1, "toolu_1"), result("toolu_1", LOG), assistant(2),
    {"role": "user", "content": "Why did it flake?"}, assistant(3),
    {"role": "user", "content": "Now the timeout case."},
    assistant(4, "toolu_2"), result("toolu_2"), assistant(5, "toolu_3"),
]
# Each thinking block weighs about 2,300 tokens: clearing the three finished turns brings the
# session under the trigger. A summary keeps the last five messages: the third turn's reply is
# the one finished turn in its tail.
POLICY: dict[str, Any] = {
    "model_name": "fake-claude", "trigger": [{"type": "tokens", "value": 6500}],
    "keep": {"type": "messages", "value": 5}, "clear_thinking": {"keep": 0}}


@pytest.fixture(params=["sqlite", "postgres"])
def stack(request: pytest.FixtureRequest, clean_redis: str, tmp_path: Any, fake: Any) -> Any:
    url = request.getfixturevalue("sqlite_url" if request.param == "sqlite" else "clean_pg")

    def make(**policy: Any) -> Stack:
        made = Stack(url, clean_redis, tmp_path / "stack", fake_url=fake.url, claude=True,
                     summarization={**POLICY, **policy})
        stacks.append(made)
        path = made.home / "s1.jsonl"
        path.write_text("".join(json.dumps(m) + "\n" for m in TRANSCRIPT))
        made.cli("ingest", str(path), "--session", "s1", "--format", "anthropic",
                 "--run-model", "fake-claude")
        made.start_worker("w1", concurrency=2)
        return made

    stacks: list[Stack] = []
    yield make
    for made in stacks:
        made.close()


def _runs(stack: Stack) -> list[RunRecord]:
    def finished() -> list[RunRecord]:
        runs = query(stack.database_url, lambda store: store.session_runs("s1"))
        return runs if runs and all(r.finished for r in runs) else []
    return wait_until(finished, timeout=90, what="the run of s1 to finish")


def _prunes(stack: Stack) -> list[EventRecord]:
    return query(stack.database_url, lambda store: store.read_events(
        "s1", kinds=[JournalKind.PRUNE]))


def _assistants(stack: Stack) -> list[dict[str, Any]]:
    return [m for m in stack.cli_json("surface", "s1")["messages"] if m["role"] == "assistant"]


def _blocks(message: dict[str, Any]) -> list[dict[str, Any]]:
    return [b for b in message["content"] or () if b["type"] == "thinking"]


def test_older_turns_lose_their_reasoning_and_the_open_call_keeps_its_own(stack: Any,
                                                                          fake: Any) -> None:
    stack = stack(clear_at_least=0)
    before = stack.cli_json("surface", "s1")
    assert before["tokens"] > 6500, before["tokens"]
    assert stack.cli_json("signal", "s1")["enqueued"]
    [run] = _runs(stack)
    assert run.status == "committed" and run.stages is not None, run
    assert run.stages["stages"] == ["prune"], run.stages  # model-free: no summary needed
    assert fake.requests == []

    first, second, third, fourth, fifth = _assistants(stack)
    # The finished turns: reasoning gone, their text and calls as they were, the original named.
    for message, turn in ((first, 1), (second, 2), (third, 3)):
        assert _blocks(message) == [], message
        assert message["content"] == [{"type": "text", "text": f"step {turn}"}]
        assert message["meta"]["cleared_thinking"] is True
        assert message["meta"]["recall"]["ref"].startswith("r")
    assert [c["id"] for c in first["tool_calls"]] == ["toolu_1"]
    # The loop in progress, its last call open: every block byte for byte, signature included.
    _assert_loop_kept(fourth, fifth)
    after = stack.cli_json("surface", "s1")
    assert after["tokens"] < before["tokens"] - 3 * 1000, (before["tokens"], after["tokens"])

    # Committed like a prune: journaled with what it freed, the originals still in the log.
    journal = _prunes(stack)
    assert [e.payload["edits"] for e in journal] == [["clear_thinking"]] * 3, journal
    assert all(e.payload["saved"] > 1000 for e in journal), journal
    originals = [int(m["meta"]["recall"]["ref"][1:]) for m in (first, second, third)]
    logged = {e.seq: e for e in query(stack.database_url,
                                      lambda store: store.read_events("s1"))}
    for turn, seq in enumerate(originals, start=1):
        assert thinking(turn) in logged[seq].payload["content"], logged[seq]
    assert stack.cli_json("verify", "s1")["ok"]


def _assert_loop_kept(*loop: dict[str, Any]) -> None:
    """The loop in progress, its last call open: every block byte for byte, signatures
    included."""
    for message in loop:
        turn = int(message["content"][-1]["text"].split()[-1])
        assert json.dumps(_blocks(message)) == json.dumps([thinking(turn)]), message
        assert "cleared_thinking" not in (message.get("meta") or {})


def test_a_small_clearing_rides_in_the_summarys_commit_while_the_cache_is_warm(
        stack: Any, fake: Any) -> None:
    stack = stack(clear_at_least=100_000)
    assert stack.cli_json("signal", "s1")["enqueued"]
    [run] = _runs(stack)
    assert run.status == "committed" and run.stages is not None, run
    assert run.stages["stages"] == ["prune", "summary"], run.stages
    assert fake.requests, "the summary was written by the fake model"
    # The first two turns are in the summary's range; the third turn's clearing rides beside
    # it, written by the summary's transaction at its instant.
    [prune] = _prunes(stack)
    [summary] = query(stack.database_url, lambda store: store.read_events(
        "s1", kinds=[JournalKind.SUMMARY]))
    assert prune.payload["edits"] == ["clear_thinking"] and prune.created_at == summary.created_at
    third, fourth, fifth = _assistants(stack)
    assert _blocks(third) == [] and third["meta"]["cleared_thinking"] is True
    _assert_loop_kept(fourth, fifth)


def test_keep_spares_the_reasoning_of_that_many_newest_turns_holding_some(
        stack: Any, fake: Any) -> None:
    # The loop's two turns and the third turn's reply are the three newest holding reasoning:
    # keep 3 leaves the reply's, which keep 1 (a mapping without keep) would clear.
    stack = stack(clear_at_least=0, clear_thinking={"keep": 3})
    assert stack.cli_json("signal", "s1")["enqueued"]
    [run] = _runs(stack)
    assert run.status == "committed", run
    *older, third, fourth, fifth = _assistants(stack)
    assert all(_blocks(message) == [] for message in older), older
    _assert_loop_kept(third, fourth, fifth)
