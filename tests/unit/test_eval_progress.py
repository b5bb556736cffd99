"""``compactd eval``'s progress bar: drawn on a terminal, silent in a pipe or a log."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest

from compactd.scheduler.evaluate import EvalInputError, Progress, transcript_paths


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_bar_is_drawn_on_a_terminal_only() -> None:
    tty, pipe = Terminal(), io.StringIO()
    for stream in (tty, pipe):
        bar = Progress(4, stream)
        for n in range(4):
            bar.step(f"session {n}")
    assert pipe.getvalue() == ""
    frames = tty.getvalue().split("\r")[1:]
    assert len(frames) == 4
    assert frames[1].startswith("[" + "#" * 15 + "." * 15 + "] 2/4 session 1")
    assert frames[-1].rstrip().endswith("4/4 session 3")
    assert tty.getvalue().endswith("\n")


def test_a_folder_without_transcripts_or_a_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(EvalInputError, match=re.escape(f"{tmp_path}: a folder with no")):
        transcript_paths([str(tmp_path)])
    with pytest.raises(EvalInputError, match=re.escape("gone.jsonl: no such transcript")):
        transcript_paths([str(tmp_path / "gone.jsonl")])
