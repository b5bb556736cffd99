"""Policy settings on the paths users take: a keep override through a real Celery worker (the CLI
without ``--inline``, and ``compactd serve``), and configuration refused by the CLI at load."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest

from compactd.scheduler.client import Client
from compactd.scheduler.samples import coding_session
from compactd.worker.settings import load_config
from tests.support.api import TOKEN_A, bearer, start_api
from tests.support.stack import Stack, fake_models, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.redis]

MakeStack = Callable[..., Stack]

# No automatic runs (a pressure run holding the lease would make a manual one busy), and a
# policy keep far longer than the override, so the kept tail says which one the worker used.
MANUAL_ONLY = {"model_name": "fake-gpt", "trigger": [{"type": "tokens", "value": 10_000_000}],
               "keep": {"type": "messages", "value": 20}}


def _tail_after_checkpoint(messages: list[dict[str, Any]]) -> int:
    last = max(i for i, m in enumerate(messages) if (m.get("meta") or {}).get("checkpoint"))
    return len(messages) - last - 1


def test_queued_keep_override_reaches_the_worker_from_the_cli_and_the_api(
        make_stack: MakeStack) -> None:
    stack = make_stack(summarization=MANUAL_ONLY)
    messages = coding_session(steps=12, big_output_lines=30).messages
    stack.ingest("s1", messages)
    stack.start_worker("w1", concurrency=2)

    result = stack.cli_json("compact", "s1", "--keep", "messages:4", "--wait", "--timeout", "60")
    assert result["outcome"] == "committed", result
    tail = _tail_after_checkpoint(stack.cli_json("surface", "s1")["messages"])
    # Four kept, moved toward the head only as far as a whole tool-call group needs.
    assert 4 <= tail < 8, tail

    url = start_api(stack)
    with httpx.Client(base_url=url, headers=bearer(TOKEN_A), timeout=120) as http:
        assert http.put("/v1/sessions/s2", json={"run_model": "fake-gpt"}).status_code == 201
        assert http.post("/v1/sessions/s2/messages",
                         json={"messages": messages}).status_code == 200
        run = http.post("/v1/sessions/s2/compact",
                        json={"keep": "tokens:1000000", "wait": True, "timeout_s": 60})
        # A keep over the whole surface: the worker parsed it and kept everything.
        assert run.status_code == 200, run.text
        assert run.json()["outcome"] == "nothing_to_do", run.json()
        run = http.post("/v1/sessions/s2/compact",
                        json={"keep": "messages:4", "wait": True, "timeout_s": 60})
        assert run.status_code == 200, run.text
        assert run.json()["outcome"] == "committed", run.json()
        surface = http.get("/v1/sessions/s2/surface").json()["messages"]
        assert 4 <= _tail_after_checkpoint(surface) < 8
        bad = http.post("/v1/sessions/s2/compact", json={"keep": "messages:2.5"})
        assert bad.status_code == 422 and "must be an integer" in bad.text, bad.text

        # A per-session keep that the session's window makes fire the trigger again.
        override = {"trigger": {"type": "fraction", "value": 0.5},
                    "keep": {"type": "tokens", "value": 600}}
        refused = http.put("/v1/sessions/s3", json={"context_window": 1000, "policy": override})
        assert refused.status_code == 422, refused.text
        assert "policy.keep: keep tokens>=600 is not below trigger fraction>=0.5 of a " \
               "1000-token window" in refused.json()["message"], refused.text
        assert http.get("/v1/sessions/s3").status_code == 404
        assert http.put("/v1/sessions/s3", json={"context_window": 2000,
                                                 "policy": override}).status_code == 201


def test_bad_keep_override_is_refused_before_anything_is_queued(make_stack: MakeStack) -> None:
    stack = make_stack(summarization=MANUAL_ONLY)
    stack.ingest("s1", coding_session(steps=4).messages)
    out = stack.cli("compact", "s1", "--keep", "messages:0", check=False)
    assert out.returncode == 2 and "--keep: must be positive" in out.stderr, out.stderr


def test_a_call_never_answered_does_not_pin_the_session(make_stack: MakeStack) -> None:
    stack = make_stack(summarization=MANUAL_ONLY)
    call = {"id": "lost", "type": "function", "function": {"name": "read_file",
                                                           "arguments": "{}"}}
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are an agent."}, {"role": "user", "content": "go"},
        {"role": "assistant", "content": None, "tool_calls": [call]}]
    for i in range(15):
        messages += [{"role": "user", "content": f"question {i} " * 30},
                     {"role": "assistant", "content": f"answer {i} " * 30}]
    stack.ingest("s1", messages)
    stack.start_worker("w1", concurrency=2)

    result = stack.cli_json("compact", "s1", "--force", "--wait", "--timeout", "60")
    assert result["outcome"] == "committed", result
    assert 3 not in result["replaced_seqs"] and len(result["replaced_seqs"]) >= 20, result
    surface = stack.cli_json("surface", "s1")["messages"]
    assert [m["seq"] for m in surface][:3] == [1, 2, 3]  # the open call stays on the surface
    # Its result may still come, and finds its call.
    late = stack.home / "late.jsonl"
    late.write_text('{"role": "tool", "tool_call_id": "lost", "content": "file body"}\n')
    stack.cli("ingest", str(late), "--session", "s1")
    assert "ok   s1" in stack.cli("verify", "s1").stdout


def _old_call_then_plain_turns() -> list[dict[str, Any]]:
    """One tool call early on, then thirty plain turns: its group is history, not a step."""
    call = {"id": "c1", "type": "function", "function": {"name": "read_file",
                                                         "arguments": "{}"}}
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are an agent."}, {"role": "user", "content": "go"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "file body " * 20}]
    for i in range(30):
        messages += [{"role": "user", "content": f"question {i} " * 20},
                     {"role": "assistant", "content": f"answer {i} " * 20}]
    return messages


def test_force_and_overflow_reduce_a_session_whose_only_tool_call_is_old(
        make_stack: MakeStack, fake: Any) -> None:
    # The window puts the session near its end (over 90% of it), where an overflow comes.
    models = [{**m, "context_window": 4200} for m in fake_models(fake.url)]
    stack = make_stack(summarization=MANUAL_ONLY, models=models)
    messages = _old_call_then_plain_turns()
    stack.ingest("s1", messages)
    stack.ingest("s2", messages)
    before = stack.cli_json("surface", "s1")["tokens"]
    assert 0.9 * 4200 < before < 4200, before

    result = stack.cli_json("compact", "s1", "--force", "--inline")
    assert result["outcome"] == "committed", result
    # The old group (3, 4) goes with the turns; the last reply and the latest request stay.
    replaced = set(result["replaced_seqs"])
    assert {3, 4} <= replaced and {63, 64}.isdisjoint(replaced), result
    assert result["tokens_after"] < before / 4, result
    seqs = [m["seq"] for m in stack.cli_json("surface", "s1")["messages"]]
    assert seqs[0] == 1 and seqs[-2:] == [63, 64], seqs

    stack.start_worker("w1", concurrency=2)
    with Client(load_config(env=stack.env)) as client:
        overflow = client.get_session("s2").report_overflow(timeout_s=60)
    assert overflow.compacted, overflow.reason
    assert overflow.run is not None and overflow.run["outcome"] == "committed", overflow.run
    assert {3, 4} <= set(overflow.run["replaced_seqs"]), overflow.run
    assert overflow.tokens_after is not None and overflow.tokens_after < before / 4, overflow


def test_clearing_old_tool_results_runs_on_its_own_trigger(make_stack: MakeStack,
                                                           fake: Any) -> None:
    # clear_at_least 0: a clearing this small would otherwise wait to ride in a summary's
    # commit (tests/acceptance/test_cache_breaks.py); here it is the only run there is.
    stack = make_stack(summarization={**MANUAL_ONLY, "clear_at_least": 0, "clear_tool_uses": {
        "enabled": True, "trigger": 2000, "keep": 1}})
    stack.ingest("s1", coding_session(steps=12, big_output_lines=30).messages)
    before = stack.cli_json("surface", "s1")
    assert before["tokens"] > 2000
    stack.start_worker("w1", concurrency=2)

    signal = stack.cli_json("signal", "s1")
    assert signal["enqueued"] is True and "clear_tool_uses" in signal["reason"], signal

    def is_cleared(m: dict[str, Any]) -> bool:
        # the placeholder, then the note naming the original that history_read returns
        recall = (m.get("meta") or {}).get("recall") or {}
        return m["role"] == "tool" and m["content"] == f"[cleared]\n{recall.get('footer')}"

    def cleared() -> list[dict[str, Any]] | None:
        messages = stack.cli_json("surface", "s1")["messages"]
        return messages if any(is_cleared(m) for m in messages) else None

    messages = wait_until(cleared, timeout=60, what="old tool results to be cleared")
    results = [m for m in messages if m["role"] == "tool"]
    # Every earlier result is cleared but those already no larger than a cleared one (the
    # placeholder and its note would not save tokens); the note's seq may differ by a digit.
    cost = min(m["tokens"] for m in results[:-1] if is_cleared(m))
    assert all(is_cleared(m) or m["tokens"] <= cost + 1 for m in results[:-1]), results
    assert sum(is_cleared(m) for m in results[:-1]) > len(results) // 2
    assert not is_cleared(results[-1])
    # No summary: clearing is model-free and commits on its own.
    assert not any((m.get("meta") or {}).get("checkpoint") for m in messages)
    assert fake.requests == []

    # The runtime's next step, through the client, puts the session over 2000 tokens again: its
    # append alone wakes the clearing run.
    kept = results[-1]["tool_call_id"]
    call = {"id": "next", "type": "function", "function": {"name": "bash", "arguments": "{}"}}
    with Client(load_config(env=stack.env)) as client:
        session = client.create_session("s1", run_model="fake-gpt")
        step = session.append([{"role": "assistant", "content": None, "tool_calls": [call]},
                               {"role": "tool", "tool_call_id": "next", "content": "ok " * 1500}])
    assert step.fired and step.signalled, step

    def kept_cleared() -> bool:
        messages = stack.cli_json("surface", "s1")["messages"]
        return any(m.get("tool_call_id") == kept and is_cleared(m) for m in messages)

    wait_until(kept_cleared, timeout=60, what="the older result to be cleared after the append")
    assert fake.requests == []
    assert "1/1 sessions verified" in stack.cli("verify", "--all").stdout
