"""The order pytest-xdist hands test files to its workers: the longest first.

``--dist loadfile`` queues files by their number of tests, most first. Here the many-test files
are quick (a parametrized table of pure cases) and the few-test ones are the slowest (a worker
killed and restarted in a loop, a venv built and installed), so they all came last: one worker
ran the last of them alone while the other had nothing left. Queued by their expected time,
longest first, the files that start last are short ones and both workers end together.

The expected time of a file is its figure in ``file_seconds.json`` (seconds per file from a
whole run); only the order matters, so a stale figure costs balance, never a result. A file
missing from it (a new one) is guessed from its directory and number of tests. A run with
``COMPACTD_TEST_FILE_SECONDS=PATH`` writes its own figures there (:class:`FileSeconds`):
``COMPACTD_TEST_FILE_SECONDS=$PWD/tests/support/file_seconds.json ops/test`` renews them.
"""

from __future__ import annotations

import json
import os
from collections import Counter, defaultdict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from xdist.scheduler import LoadFileScheduling
from xdist.workermanage import WorkerController

FIGURES = Path(__file__).with_name("file_seconds.json")
FIGURES_OUT_ENV = "COMPACTD_TEST_FILE_SECONDS"
# Seconds per test for a file without a figure, by its directory under tests/: the acceptance
# tests start processes, the unit tests do no I/O. A migration test may run whole releases (a
# worker per release, a walk down the chain): guessed as long as an acceptance test, since a
# long file guessed short is handed out last and runs alone at the end.
PER_TEST_GUESS = {"acceptance": 15.0, "migration": 15.0, "integration": 1.0, "unit": 0.05}


def load_figures(path: Path = FIGURES) -> dict[str, float]:
    return {str(name): float(seconds) for name, seconds in json.loads(path.read_text()).items()}


def expected_seconds(nodeids: Mapping[str, int], figures: Mapping[str, float]
                     ) -> dict[str, float]:
    """Each file's expected time: its figure, else a guess from its directory and its
    ``nodeids[file]`` tests."""
    out = {}
    for file, count in nodeids.items():
        if file in figures:
            out[file] = figures[file]
        else:
            parts = Path(file).parts
            kind = parts[1] if len(parts) > 2 and parts[0] == "tests" else ""
            out[file] = count * PER_TEST_GUESS.get(kind, 1.0)
    return out


def longest_first(files: list[str], expected: Mapping[str, float]) -> list[str]:
    """The files by expected time, longest first; ties keep their given order."""
    return sorted(files, key=lambda file: -expected[file])


class LongestFileFirst(LoadFileScheduling):
    """``--dist loadfile`` with its queue in :func:`longest_first` order."""

    _ordered = False

    def _assign_work_unit(self, node: WorkerController) -> None:
        # schedule() fills the whole queue before its first assignment: it is reordered there,
        # once; a file given back by a crashed worker is queued again at the end, as before.
        if not self._ordered:
            self._ordered = True
            counts = Counter({file: len(unit) for file, unit in self.workqueue.items()})
            expected = expected_seconds(counts, load_figures())
            for file in longest_first(list(self.workqueue), expected):
                self.workqueue.move_to_end(file)
        super()._assign_work_unit(node)


class FileSeconds:
    """A pytest plugin: each file's seconds in this run (its tests' setup, call and teardown),
    written to ``path`` at the end over the figures it held, so a run of some files renews
    theirs and keeps the others'. Registered on the process that sees every test's report:
    xdist's controller, or the only process without xdist."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.seconds: defaultdict[str, float] = defaultdict(float)

    def pytest_runtest_logreport(self, report: Any) -> None:
        self.seconds[report.nodeid.split("::", 1)[0]] += report.duration

    def pytest_sessionfinish(self) -> None:
        if not self.seconds:
            return
        figures = load_figures(self.path) if self.path.is_file() else {}
        figures.update({file: round(max(s, 0.1), 1) for file, s in self.seconds.items()})
        self.path.write_text(json.dumps(dict(sorted(figures.items())), indent=1) + "\n")


def register_file_seconds(config: pytest.Config) -> None:
    """:class:`FileSeconds` writing to ``$COMPACTD_TEST_FILE_SECONDS``, when it is set and the
    run is distributed, on the process that sees every report (an xdist worker sends its
    reports to the controller)."""
    out = os.environ.get(FIGURES_OUT_ENV)
    # The figures order xdist's queue: a run that does not distribute (ops/test's timed phase,
    # run alone) would write the times of a file's timed tests over its whole.
    distributed = config.pluginmanager.hasplugin("xdist") and config.getvalue("dist") != "no"
    if out and distributed and not hasattr(config, "workerinput"):
        config.pluginmanager.register(FileSeconds(Path(out)), "compactd-file-seconds")
