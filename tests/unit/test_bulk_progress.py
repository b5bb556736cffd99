"""The recompact progress display: a bar on a terminal, JSON lines otherwise, on stderr."""

from __future__ import annotations

import datetime as dt
import io
import json

import pytest

from scheduler.bulk import Progress
from storage.records import BulkJob

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
    progress.show(job(enqueued=10, done=4, failed=1))
    progress.show(job(enqueued=10, done=4, failed=1))  # unchanged: not drawn again
    progress.show(job(enqueued=10, done=10))
    progress.close()
    frames = err.getvalue().split("\r")[1:]
    assert frames[0] == "[###############...............] 5/10 done=4 failed=1 enqueued=10"
    assert frames[1] == "[##############################] 10/10 done=10 failed=0 enqueued=10\n"
    assert len(frames) == 2


@pytest.mark.parametrize("as_json", [False, True])
def test_otherwise_json_lines(monkeypatch: pytest.MonkeyPatch, as_json: bool) -> None:
    err = Terminal() if as_json else io.StringIO()  # --json wins even on a terminal
    monkeypatch.setattr("sys.stderr", err)
    progress = Progress(job(), as_json=as_json)
    progress.show(job(pending=6, enqueued=4))
    progress.show(job(enqueued=10, done=3))
    progress.close()
    lines = [json.loads(line) for line in err.getvalue().splitlines()]
    assert lines == [
        {"job": "j1", "matched": 10, "enqueued": 4, "done": 0, "failed": 0},
        {"job": "j1", "matched": 10, "enqueued": 10, "done": 3, "failed": 0}]
