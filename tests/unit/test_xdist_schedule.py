"""The order ``--dist loadfile`` hands files to the xdist workers: longest expected time first
(tests/support/schedule.py), so the slow few-test files no longer come last."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.support.schedule import (
    FIGURES,
    FIGURES_OUT_ENV,
    expected_seconds,
    load_figures,
    longest_first,
)
from tests.support.stack import REPO


def test_files_are_queued_by_their_figure_longest_first_not_by_their_number_of_tests() -> None:
    counts = {"tests/unit/test_table.py": 200, "tests/acceptance/test_loop.py": 1,
              "tests/integration/test_store.py": 40}
    figures = {"tests/unit/test_table.py": 2.0, "tests/acceptance/test_loop.py": 90.0,
               "tests/integration/test_store.py": 12.0}
    expected = expected_seconds(counts, figures)
    assert longest_first(list(counts), expected) == [
        "tests/acceptance/test_loop.py", "tests/integration/test_store.py",
        "tests/unit/test_table.py"]


def test_a_file_without_a_figure_is_guessed_from_its_directory_and_its_tests() -> None:
    counts = {"tests/unit/test_many.py": 100, "tests/acceptance/test_new.py": 2,
              "tests/integration/test_known.py": 3}
    expected = expected_seconds(counts, {"tests/integration/test_known.py": 10.0})
    assert longest_first(list(counts), expected) == [
        "tests/acceptance/test_new.py", "tests/integration/test_known.py",
        "tests/unit/test_many.py"]
    # equal times keep the given order
    assert longest_first(["b", "a"], {"a": 1.0, "b": 1.0}) == ["b", "a"]


def test_every_figure_names_a_test_file_that_exists() -> None:
    figures = load_figures()
    assert figures, FIGURES
    missing = [name for name in figures if not (REPO / name).is_file()]
    assert missing == [], f"{FIGURES.name} names files that are gone: {missing}"
    assert all(seconds > 0 for seconds in figures.values())


def test_a_distributed_run_with_the_figures_path_set_writes_each_files_seconds_over_what_it_held(
        tmp_path: Path) -> None:
    # The real path: the repository's conftest under xdist, whose workers send their reports
    # to the controller, which alone writes. A figure of a file the run did not touch stays; a
    # run that does not distribute (ops/test's timed phase) writes nothing.
    out = tmp_path / "file_seconds.json"
    held = {"tests/unit/test_other.py": 7.5, "tests/unit/test_xdist_schedule.py": 999.0}
    out.write_text(json.dumps(held))
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_XDIST_WORKER"}

    def run(*options: str) -> None:
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", *options, "-p", "no:cacheprovider",
             "tests/unit/test_xdist_schedule.py::"
             "test_files_are_queued_by_their_figure_longest_first_not_by_their_number_of_tests"],
            cwd=REPO, env={**env, FIGURES_OUT_ENV: str(out)}, capture_output=True, text=True,
            timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr

    run("-p", "no:xdist")
    assert load_figures(out) == held
    run("-n", "1")
    figures = load_figures(out)
    assert figures["tests/unit/test_other.py"] == 7.5
    assert 0 < figures["tests/unit/test_xdist_schedule.py"] < 60
