"""The recompact progress display on stderr: JSON lines with --json, else a bar on a terminal and
lines of text elsewhere."""

from __future__ import annotations

import datetime as dt
import io
import json

import pytest

from compactd.scheduler.bulk import Progress
from compactd.storage.records import BulkJob

T0 = dt.datetime(2026, 11, 30, 12, 0, tzinfo=dt.UTC)


def job(**counts: int) -> BulkJob:
    return BulkJob(id="j1", filter={}, state="running", force=False, rate_per_s=20.0,
                   matched=10, created_at=T0, updated_at=T0, **counts)


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_gets_a_bar_redrawn_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    err = Terminal()
    monkeypatch.setattr("sys.stderr", err)
    progress = Progress(job(), as_json=False)
    progress.show(job(enqueued=10, done=3, skipped=1, failed=1))
    progress.show(job(enqueued=10, done=3, skipped=1, failed=1))  # unchanged: not drawn again
    progress.show(job(enqueued=10, done=10))
    progress.close()
    frames = err.getvalue().split("\r")[1:]
    assert frames[0] == ("[###############...............] 5/10 ended: 3 compacted, 1 skipped, "
                         "1 failed; 10 enqueued")
    assert frames[1] == ("[##############################] 10/10 ended: 10 compacted, 0 skipped, "
                         "0 failed; 10 enqueued\n")
    assert len(frames) == 2


def test_a_log_or_a_pipe_gets_lines_of_text_without_json(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    err = io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    progress = Progress(job(), as_json=False)
    progress.show(job(pending=6, enqueued=4))
    progress.show(job(enqueued=10, done=2, skipped=1))
    progress.close()
    assert err.getvalue().splitlines() == [
        "bulk job j1: 0/10 ended: 0 compacted, 0 skipped, 0 failed; 4 enqueued",
        "bulk job j1: 3/10 ended: 2 compacted, 1 skipped, 0 failed; 10 enqueued"]


@pytest.mark.parametrize("terminal", [False, True])
def test_json_lines_with_json(monkeypatch: pytest.MonkeyPatch, terminal: bool) -> None:
    err = Terminal() if terminal else io.StringIO()  # --json wins even on a terminal
    monkeypatch.setattr("sys.stderr", err)
    progress = Progress(job(), as_json=True)
    progress.show(job(pending=6, enqueued=4))
    progress.show(job(enqueued=10, done=3, skipped=2))
    progress.close()
    lines = [json.loads(line) for line in err.getvalue().splitlines()]
    assert lines == [
        {"job": "j1", "matched": 10, "enqueued": 4, "done": 0, "skipped": 0, "failed": 0},
        {"job": "j1", "matched": 10, "enqueued": 10, "done": 3, "skipped": 2, "failed": 0}]
