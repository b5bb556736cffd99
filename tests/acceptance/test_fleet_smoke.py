"""The fleet simulation, briefly: ``tests/bench/fleet.py`` as a user runs it (a subprocess with
real Celery workers, beat, PostgreSQL, Redis and the fake provider), on a small generated
transcript so it does not depend on ``../shared``, and its refusals of bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from scheduler.samples import coding_session
from tests.bench import fleet as bench
from tests.support.scripts import refusal

REPO = Path(__file__).resolve().parents[2]
FLEET = REPO / "tests" / "bench" / "fleet.py"
KEYS = ("agents", "workers", "overflows", "pressure_to_checkpoint_p50_s",
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
                "--window", "4000", "--think-scale", "0.1",
                "--transcripts", str(transcripts(tmp_path / "corpus")),
                "--database-url", clean_pg, "--redis-url", clean_redis,
                "--json", str(out), "--plots", str(plots))
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(KEYS) <= set(report)
    assert report["agents"] == 4 and report["workers"] == 1
    assert report["overflows"] == 0
    assert report["signalled_sessions"] > 0
    assert report["checkpointed_sessions"] == report["signalled_sessions"]
    assert report["unserved_episodes"] == 0 and report["drained"] is True
    assert report["pressure_to_checkpoint_p99_s"] is not None
    assert report["compactions_per_s"] > 0
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
