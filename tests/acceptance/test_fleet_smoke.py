"""The fleet simulation, briefly: ``tests/bench/fleet.py`` as a user runs it (a subprocess with
real Celery workers, beat, PostgreSQL, Redis and the fake provider), on a small generated
transcript so it does not depend on ``../shared``, and its refusals of bad input."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from compactd.scheduler.samples import coding_session
from tests.bench import fleet as bench
from tests.support.fake_provider import input_tokens_of, openai_request_body
from tests.support.scripts import refusal

REPO = Path(__file__).resolve().parents[2]
FLEET = REPO / "tests" / "bench" / "fleet.py"
KEYS = ("agents", "workers", "overflows", "context_counts", "pressure_to_checkpoint_p50_s",
        "pressure_to_checkpoint_p99_s", "pickup_p99_s", "step_p99_ms", "step_p99_ms_at_rest",
        "compactions_per_s", "plots")


def fleet(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(FLEET), *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def transcripts(folder: Path) -> Path:
    """Two small coding transcripts of about 2.5k tokens each, ~220 tokens a step."""
    folder.mkdir()
    for seed in (3, 4):
        session = coding_session(steps=12, big_output_lines=20, seed=seed)
        (folder / f"coding-{seed}.jsonl").write_text(session.jsonl(), encoding="utf-8")
    return folder


@pytest.mark.slow
@pytest.mark.postgres
@pytest.mark.redis
def test_a_short_fleet_run_never_overflows_and_checkpoints_every_signalled_session(
        clean_pg: str, clean_redis: str, tmp_path: Path) -> None:
    out, plots = tmp_path / "fleet.json", tmp_path / "plots"
    # A 4000-token window (trigger 1600): every agent crosses it every few steps; think time
    # 0.1-0.5 s and a 0.2 s summary keep the whole run short.
    run = fleet("--agents", "4", "--workers", "1", "--duration", "8", "--latency", "0.2",
                "--window", "4000", "--think-scale", "0.1", "--loop-guard-compactions", "50",
                "--transcripts", str(transcripts(tmp_path / "corpus")),
                "--database-url", clean_pg, "--redis-url", clean_redis,
                "--json", str(out), "--plots", str(plots), "--home", str(tmp_path / "home"))
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(KEYS) <= set(report)
    assert report["agents"] == 4 and report["workers"] == 1
    assert report["overflows"] == 0
    # The agents count their context as the fake provider does, not with compactd's counter:
    # the usage they report and the overflows they detect come from a count of their own, so
    # a surface compactd counts smaller than it is would show. Were compactd's count used for
    # both, every step would agree.
    counts = report["context_counts"]
    assert counts["steps"] == report["steps"] > 0
    assert counts["equal_steps"] < counts["steps"] / 10, counts
    assert counts["ratio_p50"] != 1.0 and counts["provider_max"] > 0, counts
    assert report["signalled_sessions"] > 0
    assert report["checkpointed_sessions"] == report["signalled_sessions"]
    assert report["unserved_episodes"] == 0 and report["drained"] is True
    assert report["pressure_to_checkpoint_p99_s"] is not None
    assert report["compactions_per_s"] > 0
    # what --search judges a size by is in every report (8 s is too short to hold)
    assert report["criterion"] == bench.verdict(report)
    assert report["holds"] is (report["criterion"] == bench.HELD)
    assert report["runway_least_s"] > 0 and 0 < report["pace"] <= 1
    assert len(report["load_before"]) == len(report["load_after"]) == 3
    # the loop guard the workers ran with, and what it flagged
    config = yaml.safe_load((tmp_path / "home" / "fleet-4" / "compactd.yaml").read_text())
    assert config["worker"]["loop_guard"] == {"max_compactions": 50}
    assert report["loop_guard_max_compactions"] == 50 and report["loop_guard_flagged"] == []
    assert sorted(Path(p).name for p in report["plots"]) == ["context.png", "latency.png",
                                                              "queue.png"]
    assert all(Path(p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in report["plots"])


@pytest.mark.parametrize(("flag", "value", "says"), [
    ("--agents", "0", "expected a whole number from 1 to 2147483647, got '0'"),
    ("--workers", "-2", "expected a whole number from 1 to 2147483647, got '-2'"),
    ("--agents", "many", "expected a whole number, got 'many'"),
    ("--duration", "nan", "expected a finite number of seconds above 0, got 'nan'"),
    ("--duration", "0", "expected a finite number of seconds above 0, got '0'"),
    ("--latency", "-1", "expected a finite number of seconds above 0, got '-1'"),
    ("--latency", "inf", "expected a finite number of seconds above 0, got 'inf'"),
    ("--latency", "soon", "expected a number of seconds, got 'soon'"),
])
def test_bad_fleet_sizes_durations_and_latencies_are_refused_by_name(
        flag: str, value: str, says: str, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    # The script's own argument parsing, in process (the subprocess case is below).
    argv = [flag, value, "--transcripts", str(transcripts(tmp_path / "corpus"))]
    assert f"argument {flag}: {says}" in refusal(bench.main, argv, capsys)


def test_the_script_exits_2_naming_a_bad_fleet_size_or_a_missing_transcript_folder(
        tmp_path: Path) -> None:
    run = fleet("--agents", "-1", "--transcripts", str(transcripts(tmp_path / "corpus")))
    assert run.returncode == 2
    assert "argument --agents: expected a whole number from 1 to 2147483647, got '-1'" in (
        run.stderr)
    run = fleet("--transcripts", str(tmp_path / "absent"))
    assert run.returncode == 2
    assert f"no *.jsonl transcripts under {tmp_path / 'absent'}" in run.stderr


# ------------------------------------------------------------- what decides a size in --search


def args(*argv: str, corpus: Path) -> object:
    return bench.parse_args([*argv, "--transcripts", str(corpus)])


@pytest.mark.parametrize(("window", "envelope", "growth", "latency", "runway", "length"), [
    # trigger 3200: climb 1949 tokens at 15 t/s = 129.9 s; the runway (4800 / 15 = 320 s)
    # outlasts two more climbs (2 x (2 + 129.9)), so it decides.
    (8000, 1251, 15.0, 2.0, 320.0, 129.93 + 320.0),
    # an envelope of 3000 leaves a 200-token climb: the runway decides again
    (8000, 3000, 100.0, 1.0, 48.0, 2.0 + 48.0),
    # a window barely over the trigger: three crossings take longer than the runway
    (4000, 0, 100.0, 1.0, 24.0, 16.0 + 2 * (1.0 + 16.0)),
    # an envelope over the trigger: no climb at all, the runway alone
    (8000, 5000, 50.0, 2.0, 96.0, max(2 * 2.0, 96.0)),
])
def test_the_run_length_covers_three_crossings_or_the_whole_runway_whichever_is_longer(
        window: int, envelope: int, growth: float, latency: float, runway: float,
        length: float) -> None:
    room = bench.Headroom(window, int(window * bench.TRIGGER_FRACTION))
    assert room.runway_s(growth) == pytest.approx(runway)
    assert room.run_length_s(growth, envelope, latency) == pytest.approx(length, abs=0.01)
    assert room.run_length_s(0.0, envelope, latency) == float("inf")


def test_the_planned_run_is_set_by_the_slowest_transcript_the_agents_use(
        tmp_path: Path) -> None:
    corpus = transcripts(tmp_path / "corpus")
    slow = coding_session(steps=12, big_output_lines=0, seed=5)
    (corpus / "zz-slow.jsonl").write_text(slow.jsonl(), encoding="utf-8")
    loaded = bench.load_transcripts(corpus)
    assert [t.name for t in loaded] == ["coding-3", "coding-4", "zz-slow"]
    a = args("--window", "4000", "--latency", "0.5", corpus=corpus)
    by_growth = sorted(loaded[:2], key=lambda t: t.growth(1.0))
    two, growth_two = bench.planned_run_s(loaded, 2, a)
    three, growth_three = bench.planned_run_s(loaded, 3, a)
    assert growth_two == by_growth[0].growth(1.0)
    # the third agent replays the slow transcript: it sets the length
    assert growth_three == loaded[2].growth(1.0) < growth_two
    assert three > two
    room = bench.headroom(a)
    assert three == pytest.approx(bench.RUN_LENGTH_MARGIN * room.run_length_s(
        growth_three, loaded[2].envelope_tokens, 0.5))


def held() -> dict[str, object]:
    return {"overflows": 0, "pressure_to_checkpoint_p99_s": 4.0,
            "pressure_to_checkpoint_p99_projected_s": 4.5, "runway_least_s": 33.0,
            "unserved_episodes": 0, "drained": True, "pace": 0.99, "agents_short_of_run": 0}


@pytest.mark.parametrize(("change", "criterion"), [
    ({}, "held"),
    ({"overflows": 1, "pressure_to_checkpoint_p99_s": 90.0}, "overflow"),
    # no overflow in the run, but the wait outlasts the least runway: it would overflow
    ({"pressure_to_checkpoint_p99_s": 33.0}, "p2c_over_runway"),
    # under the runway now, but growing: as long again, it passes the runway
    ({"pressure_to_checkpoint_p99_projected_s": 33.0}, "queue_growing"),
    ({"pressure_to_checkpoint_p99_s": None,
      "pressure_to_checkpoint_p99_projected_s": None}, "held"),
    ({"unserved_episodes": 2}, "unserved"),
    # sessions answered nothing_to_do keep their mark (every sweep signals them again)
    ({"drained": False}, "held"),
    ({"pace": 0.85}, "agents_behind"),
    ({"pace": None}, "agents_behind"),
    ({"agents_short_of_run": 3}, "too_short"),
    # a decisive failure wins over a run too short to say the fleet held
    ({"agents_short_of_run": 3, "pressure_to_checkpoint_p99_s": 40.0}, "p2c_over_runway"),
    ({"pressure_to_checkpoint_p99_s": None, "pressure_to_checkpoint_p99_projected_s": None,
      "agents_short_of_run": 20}, "too_short"),
])
def test_a_size_holds_only_with_no_overflow_a_wait_under_its_runway_and_a_run_long_enough(
        change: dict[str, object], criterion: str) -> None:
    assert bench.verdict({**held(), **change}) == criterion


def test_an_agent_is_covered_by_three_crossings_or_by_a_wait_as_long_as_its_runway() -> None:
    room = bench.Headroom(8000, 3200)

    def log(fired_at: list[float], end: float) -> bench.AgentLog:
        # 100 tokens a second from t=0 to ``end``: runway 48 s
        out = bench.AgentLog("s", envelope_tokens=1000, began=0.0, thought_s=end * 0.99,
                             appended_tokens=int(100 * end))
        out.appends = [(t, t in fired_at) for t in sorted({*fired_at, end})]
        out.steps = [(t, t, 1.0) for t, _ in out.appends]
        return out

    def found(*waits: float, open_since: float | None = None) -> bench.Episodes:
        return bench.Episodes(latencies=list(waits), unserved=int(open_since is not None),
                              open_since=open_since)

    three = bench.coverage(log([20.0, 60.0, 100.0], 110.0), found(2, 2, 2), room, 2.0)
    assert three.covered and three.crossings == 3
    assert three.growth == pytest.approx(100.0) and three.runway_s == pytest.approx(48.0)
    # two crossings answered quickly: the run is too short, however long after the first
    assert not bench.coverage(log([20.0, 60.0], 90.0), found(2, 2), room, 2.0).covered
    # workers that do not keep up: a wait as long as the runway shows it (answered or not)
    assert bench.coverage(log([20.0], 90.0), found(50.0), room, 2.0).covered
    assert bench.coverage(log([20.0], 68.0), found(open_since=20.0), room, 2.0).covered
    assert not bench.coverage(log([20.0], 60.0), found(open_since=20.0), room, 2.0).covered
    assert not bench.coverage(log([], 30.0), found(), room, 2.0).covered


def test_the_search_counts_a_size_with_no_overflow_as_held_only_when_its_verdict_says_so(
        tmp_path: Path) -> None:
    # Sizes up to 50 hold; above, no overflow is seen but the wait passes the runway.
    tried: list[int] = []

    def trial(n: int) -> dict[str, object]:
        tried.append(n)
        criterion = "held" if n <= 50 else "p2c_over_runway"
        return {"agents": n, "overflows": 0, "holds": criterion == "held",
                "criterion": criterion}

    largest, trials = bench.search(args("--agents", "10", corpus=transcripts(tmp_path / "c")),
                                   trial)
    assert tried[:3] == [10, 20, 40] and tried[3] == 80
    assert largest is not None and 46 <= largest <= 50
    assert [t["agents"] for t in trials] == tried


def test_the_wait_trend_reads_a_growing_queue_and_not_a_steady_one() -> None:
    rng = random.Random(7)
    times = [100 + i * 0.5 for i in range(400)]
    steady = [2.0 + rng.uniform(-0.5, 0.5) for _ in times]
    growing = [2.0 + 0.1 * (t - 100) + rng.uniform(-0.5, 0.5) for t in times]
    flat = bench.wait_trend(times, steady, since=150.0)
    assert flat is not None and abs(flat) < 0.01
    rising = bench.wait_trend(times, growing, since=150.0)
    assert rising == pytest.approx(0.1, abs=0.01)
    # episodes before ``since`` (the first burst) are left out; too few points give no trend
    assert bench.wait_trend(times, growing, since=299.0) is None
    assert bench.wait_trend([1.0, 1.0, 1.0], [1.0, 2.0, 3.0], since=0.0) is None


def test_without_the_shared_corpus_the_fleet_replays_generated_coding_sessions(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    # A clone of its own has no ../shared/corpus: the README's command still runs.
    monkeypatch.setattr(bench, "DEFAULT_CORPUS", tmp_path / "absent")
    found, source = bench.fleet_transcripts(bench.parse_args([]))
    assert source == bench.GENERATED
    assert f"no transcripts under {tmp_path / 'absent'}" in capsys.readouterr().err
    assert len(found) == len(bench.GENERATED_OUTPUT_LINES) * bench.GENERATED_SEEDS
    assert all(len(t.steps) > 30 and t.envelope_tokens > 0 for t in found)
    # they cross the default trigger (0.4 of 16,000) within one replay
    assert all(sum(t.step_tokens) > 0.4 * bench.WINDOW_TOKENS for t in found)
    # a corpus that is there is used; an explicit folder wins
    corpus = transcripts(tmp_path / "corpus")
    monkeypatch.setattr(bench, "DEFAULT_CORPUS", corpus)
    assert bench.fleet_transcripts(bench.parse_args([]))[1] == str(corpus)
    other = transcripts(tmp_path / "other")
    found, source = bench.fleet_transcripts(bench.parse_args(["--transcripts", str(other)]))
    assert source == str(other) and [t.name for t in found] == ["coding-3", "coding-4"]


def test_the_agents_running_count_is_the_providers_count_of_their_whole_context() -> None:
    """The agents keep the provider's count step by step rather than encoding their whole
    context after each step: it must stay what the fake provider counts for that request."""
    [found] = bench.generated_transcripts()[:1]
    system = [{"role": "system", "content": found.system}]
    held: list[dict[str, object]] = [{"role": "user", "content": "caf\u00e9 \u2713", "name": None}]
    sent = bench.ProviderCount(bench.RUN_MODEL, system + held)
    steps = bench.replay(found)
    for n in range(len(found.steps) + 5):  # past the end: the replay's fresh tool-call ids
        step = next(steps)
        held.extend(step)
        sent.extend(step)
        assert sent.tokens == input_tokens_of(openai_request_body(bench.RUN_MODEL,
                                                                  system + held)), n
        if n == 10:  # a pickup: the agent holds the surface it read
            held = held[-3:]
            sent = bench.ProviderCount(bench.RUN_MODEL, system + held)
    assert bench.ProviderCount(bench.RUN_MODEL).tokens == input_tokens_of(
        openai_request_body(bench.RUN_MODEL, []))
