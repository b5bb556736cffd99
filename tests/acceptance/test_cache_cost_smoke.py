"""The prefix-cache cost benchmark, briefly: ``tests/bench/cache_cost.py`` as a user runs it (a
subprocess with a real Celery worker, PostgreSQL, Redis and the caching fake provider in a
process of its own), on a small generated session so it does not depend on ``../shared``; its
accounting; and its refusals of bad input."""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from compactd.scheduler.samples import coding_session
from compactd.storage.tokens import counter_for
from tests.bench import cache_cost as bench
from tests.support.fake_provider import SECTIONS
from tests.support.scripts import refusal

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "bench" / "cache_cost.py"
SIDE_KEYS = ("agent_input_tokens", "steps_over_trigger", "coverage", "final_context_tokens",
             "stall_s", "summarizer_input_tokens", "summarizer_output_tokens", "compactions",
             "cost_usd", "rules")
RULE_KEYS = ("cost_usd", "agent_cached_tokens", "agent_cache_write_tokens",
             "agent_uncached_tokens", "compaction_uncached_tokens",
             "compaction_uncached_per_compaction", "summarizer_cached_tokens")


def cache_cost(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def transcripts(folder: Path) -> Path:
    """One generated coding session of about 8k tokens in 42 steps, in the corpus's layout."""
    (folder / "coding").mkdir(parents=True)
    session = coding_session(steps=40, big_output_lines=20, seed=3)
    (folder / "coding" / "coding-3.jsonl").write_text(session.jsonl(), encoding="utf-8")
    return folder


def check_side(side: dict[str, Any]) -> None:
    assert set(SIDE_KEYS) <= set(side)
    for numbers in [side, *side["sessions"].values()]:
        assert 0 < numbers["final_context_tokens"] <= numbers["agent_input_tokens"]
        assert 0 <= numbers["steps_over_trigger"] <= numbers["requests"]
        for rule in bench.CACHE_RULES:
            r = numbers["rules"][rule]
            assert 0 <= r["agent_cached_tokens"] <= numbers["agent_input_tokens"]
            assert r["agent_cached_tokens"] + r["agent_cache_write_tokens"] <= (
                numbers["agent_input_tokens"])
            assert r["agent_uncached_tokens"] == (numbers["agent_input_tokens"]
                                                  - r["agent_cached_tokens"])
            assert 0 <= r["compaction_uncached_tokens"] <= r["agent_uncached_tokens"]
    for rule in bench.CACHE_RULES:
        assert set(RULE_KEYS) <= set(side["rules"][rule])
        assert side["cost_usd"][rule] == side["rules"][rule]["cost_usd"] > 0
    # OpenAI writes the cache for free; Anthropic charges its writes, so the rules differ.
    assert side["rules"]["openai"]["agent_cache_write_tokens"] == 0
    assert side["rules"]["anthropic"]["agent_cache_write_tokens"] > 0
    # Under Anthropic's rule the summary calls set no breakpoint: nothing of theirs is cached.
    assert side["rules"]["anthropic"]["summarizer_cached_tokens"] == 0
    # A 3,000-token trigger over 8k tokens compacts, and the cache serves the agent's loop.
    assert side["compactions"] > 0 and side["compaction_requests"] > 0
    assert side["rules"]["openai"]["compaction_uncached_tokens"] > 0
    assert side["rules"]["openai"]["agent_cached_tokens"] > 0
    assert side["summarizer_calls"] > 0 and side["summarizer_input_tokens"] > 0
    assert side["summarizer_output_tokens"] > 0
    assert 0 < side["coverage"] <= 1


@pytest.mark.slow
@pytest.mark.postgres
@pytest.mark.redis
def test_a_quick_run_reports_every_side_with_consistent_token_counts(
        clean_pg: str, clean_redis: str, tmp_path: Path) -> None:
    out = tmp_path / "cache.json"
    # 42 steps of 0.15 s: time for the worker's first runs to land while the agent still steps,
    # on a loaded machine too (the runs' summary calls take 0.02 s). A 1,000-token summarizer
    # budget under a 3,000-token trigger: LangChain reads only the end of each range.
    run = cache_cost("--quick", "--trigger", "3000", "--trim", "1000", "--think", "0.15",
                     "--latency", "0.02", "--transcripts", str(transcripts(tmp_path / "corpus")),
                     "--database-url", clean_pg, "--redis-url", clean_redis, "--json", str(out))
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    [result] = report["runs"]
    assert (result["profile"], result["trigger"]) == ("custom", 3000)
    sides = result["sides"]
    assert list(sides) == ["langchain", "before", "after"]
    for side in sides.values():
        check_side(side)
    langchain, before = sides["langchain"], sides["before"]
    # "before" turns the lead off (summarization.lead: 0), "after" keeps the default: the two
    # differ, so each is measured.
    assert "same_as" not in sides["after"]
    # Only a compaction changes what an agent sent before: LangChain's update, or a compactd
    # surface picked up; every other request extends the previous one.
    assert langchain["pickups"] == 0
    assert langchain["compaction_requests"] == langchain["compactions"]
    for side in sides.values():
        assert side["resent"]["requests"] == side["compaction_requests"] == sum(
            len(s["breaks"]) for s in side["sessions"].values())
    # Each committed compactd run says what it kept at its read and what arrived meanwhile.
    assert langchain["run_tails"] is None
    assert before["run_tails"]["runs"] == before["compactions"] == sum(
        len(s["runs"]) for s in before["sessions"].values())
    assert before["compaction_requests"] == before["pickups"] > 0
    # In band the agent waits for every summary; out of band it never does.
    assert langchain["stall_s"] > 0 and before["stall_s"] == 0
    # Every summary is the same size on both sides: they differ by mechanism.
    per_call = {name: s["summarizer_output_tokens"] / s["summarizer_calls"]
                for name, s in sides.items()}
    assert len(set(per_call.values())) == 1, per_call
    # compactd summarizes a range in budget-sized calls; LangChain reads its end only.
    assert before["coverage"] > langchain["coverage"]
    assert [r["side"] for r in report["ratios"]] == ["before", "after"]
    assert report["ratios"][0]["cost_openai"] > 0
    config = report["config"]
    assert (config["triggers_tokens"], config["keep_messages"], config["window_tokens"],
            config["summary_tokens"]) == ([3000], 6, 128_000, bench.SUMMARY_TOKENS)
    assert set(config["prices"]) == set(bench.CACHE_RULES)
    assert [s["name"] for s in report["sessions"]] == ["coding-3"]
    assert "compaction uncached / compaction" in run.stdout and "anthropic" in run.stdout


@pytest.mark.slow
def test_a_trigger_sweep_reports_cost_against_stall_per_trigger(tmp_path: Path) -> None:
    out = tmp_path / "sweep.json"
    run = cache_cost("--quick", "--sides", "langchain", "--triggers", "2000,4000",
                     "--transcripts", str(transcripts(tmp_path / "corpus")), "--json", str(out))
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert [(f["trigger"], f["side"]) for f in report["frontier"]] == [
        (2000, "langchain"), (4000, "langchain")]
    low, high = report["frontier"]
    # A lower trigger compacts more often: more in-band stall.
    assert low["stall_s"] > high["stall_s"] >= 0
    assert all(f["cost_openai"] > 0 and f["cost_anthropic"] > 0 for f in report["frontier"])
    assert "frontier: cost against the agent's stall" in run.stdout


@pytest.mark.parametrize(("uncached", "new", "extends", "expected"), [
    (300, 200, True, 0),      # an appended step: its block rounding is not a compaction's
    (5000, 200, False, 4800),  # a new checkpoint: all after it re-sent, less the step itself
    (150, 200, False, 0),     # a compaction that changed less than the step adds
    (0, 0, False, 0),
])
def test_compaction_uncached_counts_what_a_changed_prefix_re_sent(
        uncached: int, new: int, extends: bool, expected: int) -> None:
    assert bench.compaction_uncached(10_000, 10_000 - uncached, new,
                                     extends_previous=extends) == expected


def _chat(*names: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": n} for n in names]


@pytest.mark.parametrize(("previous", "sent", "new", "expected"), [
    # A new summary replaced everything after the system prompt: the summary and the two kept
    # messages are re-sent, the step is the request's own.
    (["sys", "a", "b", "c", "d"], ["sys", "S", "c", "d", "e"], 1,
     {"break_at": 0, "resent_messages": 3, "resent_tokens": 30, "step_messages": 1,
      "step_tokens": 10}),
    # The same summary as the last one (a fixed text): the break comes after it.
    (["sys", "S", "a", "b", "c"], ["sys", "S", "c", "d", "e"], 2,
     {"break_at": 1, "resent_messages": 1, "resent_tokens": 10, "step_messages": 2,
      "step_tokens": 20}),
    # A keep shorter than the step: nothing re-sent but what the step brings.
    (["sys", "a", "b"], ["sys", "S", "e"], 2,
     {"break_at": 0, "resent_messages": 0, "resent_tokens": 0, "step_messages": 2,
      "step_tokens": 20}),
])
def test_a_prefix_break_splits_what_was_re_sent_from_the_steps_own(
        previous: list[str], sent: list[str], new: int, expected: dict[str, int]) -> None:
    assert bench.prefix_break(_chat(*previous), _chat(*sent), [10] * len(sent), new,
                              1) == expected


def test_the_re_sent_summary_averages_per_request_and_per_message() -> None:
    breaks = [{"break_at": 0, "resent_messages": 4, "resent_tokens": 1200, "step_messages": 2,
               "step_tokens": 100},
              {"break_at": 1, "resent_messages": 2, "resent_tokens": 600, "step_messages": 2,
               "step_tokens": 700}]
    assert bench.resent_summary(breaks) == {
        "requests": 2, "messages_per_request": 3.0, "tokens_per_message": 300,
        "step_tokens_per_message": 200, "summary_reused": 1}
    assert bench.resent_summary([])["messages_per_request"] is None


def test_a_runs_tail_is_what_it_kept_at_its_read_and_what_arrived_while_it_ran() -> None:
    t0 = dt.datetime(2026, 12, 6, 18, 0, tzinfo=dt.UTC)
    at = [t0 + dt.timedelta(seconds=s) for s in range(8)]
    # Seqs 1-5 by second 4, the run's claim at 4.5 s, seqs 6-7 while it ran, 8 after; seq 9
    # (the last checkpoint's) is not an appended message.
    appended = [bench.Appended(seq, at[min(seq - 1, 7)] if seq < 6 else
                               at[4] + dt.timedelta(seconds=seq - 5.4), 100 * seq)
                for seq in range(1, 9)]
    got = bench.run_tail([9, 1, 2, 3], at[4] + dt.timedelta(seconds=0.5),
                         at[4] + dt.timedelta(seconds=2.0), appended)
    assert got == {"kept_at_read_messages": 2, "kept_at_read_tokens": 900,
                   "arrived_messages": 2, "arrived_tokens": 1300}
    agent = bench.Agent(None, "k", 1000, 100, 1)  # type: ignore[arg-type]
    agent.appended, agent.runs = appended, [got]
    assert bench.tail_summary([agent]) == {
        "runs": 1, "kept_at_read": {"messages_per_run": 2.0, "tokens_per_message": 450},
        "arrived_during_run": {"messages_per_run": 2.0, "tokens_per_message": 650},
        "appended_tokens_per_message": 450}
    assert bench.tail_summary([bench.Agent(None, "k", 1000, 100, 1)]) is None  # type: ignore[arg-type]


def test_summarizer_usage_counts_every_answered_call_but_the_agents() -> None:
    records = [
        {"headers": {bench.AGENT_HEADER: "agent"}, "status": 200, "input_tokens": 9000,
         "cached_tokens": 8000, "output_tokens": 5},
        {"headers": {}, "status": 200, "input_tokens": 4000, "cached_tokens": 1024,
         "output_tokens": 300},
        {"headers": {}, "status": 503, "input_tokens": None, "cached_tokens": None,
         "output_tokens": None},
    ]
    assert bench.summarizer_usage(records) == bench.Usage(1, 4000, 1024, 300)


def test_every_summary_is_the_fixed_size_on_every_side() -> None:
    text = bench.fixed_summary(400)
    count = counter_for(bench.AGENT_MODEL).count_text(text)
    assert 400 <= count < 480
    assert all(f"## {name}" in text for name in SECTIONS)


@pytest.mark.parametrize(("requests", "expected"), [
    # Breakpoints after the system prompt and on the last message: the next request reads the
    # whole previous one and writes its new step.
    ([(["s", "a", "b"], 0.0), (["s", "a", "b", "c"], 1.0)], [(0, 3300), (3300, 1100)]),
    # A compaction rewrote what followed the system prompt: only its breakpoint hits.
    ([(["s", "a", "b"], 0.0), (["s", "x", "c"], 1.0)], [(0, 3300), (1100, 2200)]),
    # An entry lives 5 minutes from its last use.
    ([(["s", "a"], 0.0), (["s", "a", "b"], 299.0), (["s", "a", "b", "c"], 700.0)],
     [(0, 2200), (2200, 1100), (0, 4400)]),
])
def test_anthropic_rule_reads_earlier_breakpoints_and_writes_the_rest(
        requests: list[tuple[list[str], float]], expected: list[tuple[int, int]]) -> None:
    cache = bench.AnthropicCache()
    got = []
    for names, now in requests:
        messages = [{"role": "user", "content": n} for n in names]
        got.append(cache.request(bench.prefix_keys(messages), [1100] * len(names),
                                 (1, len(names)), now))
    assert got == expected


def test_anthropic_rule_looks_back_twenty_blocks_and_caches_nothing_small() -> None:
    cache = bench.AnthropicCache()
    first = [{"role": "user", "content": str(i)} for i in range(2)]
    assert cache.request(bench.prefix_keys(first), [600, 600], [2], 0.0) == (0, 1200)
    far = first + [{"role": "user", "content": f"x{i}"} for i in range(21)]
    assert cache.request(bench.prefix_keys(far), [600] * 23, [23], 1.0) == (0, 23 * 600)
    small = bench.AnthropicCache()
    assert small.request(bench.prefix_keys(first), [100, 100], [2], 0.0) == (0, 0)


def test_coverage_weighs_removed_messages_found_in_what_reached_a_summarizer() -> None:
    found, lost, short = "a" * 60, "b" * 60, "ok"
    removed = [(found, 300), (lost, 100), (short, 1000)]
    assert bench.coverage(removed, f"<new_messages>{found}</new_messages>") == 0.75
    assert bench.coverage([(short, 5)], "") is None


@pytest.mark.parametrize(("flag", "value", "says"), [
    ("--latency", "0", "expected a finite number of seconds above 0, got '0'"),
    ("--latency", "-1", "expected a finite number of seconds above 0, got '-1'"),
    ("--latency", "nan", "expected a finite number of seconds above 0, got 'nan'"),
    ("--latency", "soon", "expected a number of seconds, got 'soon'"),
    ("--think", "0", "expected a finite number of seconds above 0, got '0'"),
    ("--triggers", "8000,0", "expected a whole number from 1 to 2147483647, got '0'"),
    ("--trigger", "0", "expected a whole number from 1 to 2147483647, got '0'"),
    ("--keep", "-6", "expected a whole number from 1 to 2147483647, got '-6'"),
    ("--trim", "many", "expected a whole number, got 'many'"),
    ("--window", "1.5", "expected a whole number, got '1.5'"),
    ("--concurrency", "0", "expected a whole number from 1 to 2147483647, got '0'"),
])
def test_bad_latencies_and_counts_are_refused_by_name(
        flag: str, value: str, says: str, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    argv = [flag, value, "--transcripts", str(transcripts(tmp_path / "corpus"))]
    assert f"argument {flag}: {says}" in refusal(bench.main, argv, capsys)


def test_an_unknown_session_name_is_refused_listing_the_sessions(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--sessions", "long-x-30k", "--transcripts", str(transcripts(tmp_path / "corpus"))]
    assert "--sessions: unknown session long-x-30k (available: coding-3)" in refusal(
        bench.main, argv, capsys)


def test_the_script_exits_2_naming_a_bad_latency_or_a_missing_folder(tmp_path: Path) -> None:
    run = cache_cost("--latency", "-0.5", "--transcripts", str(transcripts(tmp_path / "c")))
    assert run.returncode == 2
    assert "argument --latency: expected a finite number of seconds above 0, got '-0.5'" in (
        run.stderr)
    run = cache_cost("--corpus", str(tmp_path / "absent"))
    assert run.returncode == 2
    assert f"--corpus: no */*.jsonl transcripts under {tmp_path / 'absent'}" in run.stderr


def test_under_usage_both_runtimes_fire_on_the_providers_count(tmp_path: Path) -> None:
    """Usage (the default): LangChain's middleware fires on the usage its step carries though
    its own count is under the trigger, and the run says usage was reported."""
    from langchain.agents.middleware import SummarizationMiddleware

    from tests.bench.corpus import LCCounter
    from tests.bench.peers import to_langchain
    from tests.support.chat_models import fake_chat_openai

    step = to_langchain([{"role": "assistant", "content": "looking it up"},
                         {"role": "user", "content": "ok"}], ids=["m1", "m2"])
    middleware: SummarizationMiddleware[Any, Any] = SummarizationMiddleware(
        model=fake_chat_openai("http://127.0.0.1:9/v1", bench.SUMMARY_MODEL, api_key="k"),
        trigger=("tokens", 3000), keep=("messages", 1), token_counter=LCCounter())
    own = LCCounter()(step)
    assert not middleware._should_summarize(step, own)
    bench.carry_usage(step, 3000)
    assert step[0].usage_metadata is not None  # type: ignore[attr-defined]
    assert step[0].usage_metadata["total_tokens"] == 3000 + LCCounter()(step[:1])  # type: ignore[attr-defined]
    assert middleware._should_summarize(step, own)

    # Usage is the default (what a runtime's chat model reports); --no-usage turns it off.
    corpus = str(transcripts(tmp_path / "corpus"))
    for switch, reported in (((), True), (("--no-usage",), False)):
        out = tmp_path / "usage.json"
        run = cache_cost("--quick", "--sides", "langchain", *switch, "--transcripts", corpus,
                         "--json", str(out))
        assert run.returncode == 0, run.stderr[-3000:]
        assert json.loads(out.read_text())["config"]["usage_reports"] is reported


def test_every_summary_names_the_call_that_wrote_it() -> None:
    # Two summaries a model writes differ: a checkpoint that replaces an identical one would
    # otherwise be read from the prefix cache on both sides.
    assert bench.fixed_summary(400).startswith("Summary {request}\n")
