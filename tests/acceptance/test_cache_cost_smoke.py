"""The prefix-cache cost benchmark, briefly: ``tests/bench/cache_cost.py`` as a user runs it (a
subprocess with a real Celery worker, PostgreSQL, Redis and the caching fake provider in a
process of its own), on a small generated session so it does not depend on ``../shared``; its
accounting; and its refusals of bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from scheduler.samples import coding_session
from tests.bench import cache_cost as bench
from tests.support.scripts import refusal

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "bench" / "cache_cost.py"
SIDE_KEYS = ("agent_input_tokens", "agent_uncached_tokens", "compaction_uncached_tokens",
             "summarizer_input_tokens", "summarizer_output_tokens", "final_context_tokens",
             "cost_usd")


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
        assert 0 <= numbers["agent_cached_tokens"] <= numbers["agent_input_tokens"]
        assert numbers["agent_uncached_tokens"] == (numbers["agent_input_tokens"]
                                                    - numbers["agent_cached_tokens"])
        assert 0 <= numbers["compaction_uncached_tokens"] <= numbers["agent_uncached_tokens"]
        assert 0 < numbers["final_context_tokens"] <= numbers["agent_input_tokens"]
    # A 3,000-token trigger over 8k tokens compacts, and the cache serves the agent's loop.
    assert side["compactions"] > 0 and side["compaction_requests"] > 0
    assert side["compaction_uncached_tokens"] > 0
    assert side["agent_cached_tokens"] > 0
    assert side["summarizer_calls"] > 0 and side["summarizer_input_tokens"] > 0
    assert side["summarizer_output_tokens"] > 0
    assert side["cost_usd"] > 0


@pytest.mark.slow
@pytest.mark.postgres
@pytest.mark.redis
def test_a_quick_run_reports_every_side_with_consistent_token_counts(
        clean_pg: str, clean_redis: str, tmp_path: Path) -> None:
    out = tmp_path / "cache.json"
    # 42 steps of 0.15 s: time for the worker's first runs to land while the agent still steps,
    # on a loaded machine too (the runs' summary calls take --quick's 0.02 s).
    run = cache_cost("--quick", "--trigger", "3000", "--think", "0.15", "--transcripts",
                     str(transcripts(tmp_path / "corpus")), "--database-url", clean_pg,
                     "--redis-url", clean_redis, "--json", str(out))
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert {"langchain", "merge", "recallable"} <= set(report)
    check_side(report["langchain"])
    check_side(report["merge"])
    # Only a compaction changes what an agent sent before: LangChain's update, or a compactd
    # surface picked up; every other request extends the previous one.
    assert report["langchain"]["pickups"] == 0
    assert report["langchain"]["compaction_requests"] == report["langchain"]["compactions"]
    assert report["merge"]["compaction_requests"] == report["merge"]["pickups"] > 0
    assert report["recallable"] is not None, report.get("not_available")
    check_side(report["recallable"])
    assert report["recallable"]["compaction_requests"] == report["recallable"]["pickups"] > 0
    config = report["config"]
    assert (config["trigger_tokens"], config["keep_messages"], config["window_tokens"]) == (
        3000, 6, 128_000)
    assert config["prices"]["model"] == bench.PRICE_MODEL
    assert [s["name"] for s in report["sessions"]] == ["coding-3"]
    assert "compaction uncached" in run.stdout and "merge" in run.stdout


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
    assert bench.cost_usd(1_000_000, 1_000_000, 1_000_000) == pytest.approx(
        sum(bench.PRICES.values()))


@pytest.mark.parametrize(("flag", "value", "says"), [
    ("--latency", "0", "expected a finite number of seconds above 0, got '0'"),
    ("--latency", "-1", "expected a finite number of seconds above 0, got '-1'"),
    ("--latency", "nan", "expected a finite number of seconds above 0, got 'nan'"),
    ("--latency", "soon", "expected a number of seconds, got 'soon'"),
    ("--think", "0", "expected a finite number of seconds above 0, got '0'"),
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
