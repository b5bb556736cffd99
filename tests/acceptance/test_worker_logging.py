"""The log level an operator gives Celery on the command line is the worker's: ``celery -A
compactd.worker.app worker --loglevel LEVEL`` on a real worker that runs a compaction."""

from __future__ import annotations

import json
from typing import Any

import pytest

from compactd.scheduler.samples import coding_session
from tests.support.stack import Stack, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.redis]

POLICY = {"trigger": [{"type": "tokens", "value": 100_000_000}],
          "keep": {"type": "messages", "value": 6}, "model_name": "fake-gpt"}


def _levels(stack: Stack, name: str) -> set[str]:
    """The levels of the worker's log lines (JSON; Celery's banner is plain text)."""
    found = set()
    for line in stack.log(name).splitlines():
        if line.startswith("{"):
            entry: dict[str, Any] = json.loads(line)
            found.add(entry["level"])
    return found


@pytest.mark.parametrize("level", ["WARNING", "DEBUG"])
def test_the_command_line_loglevel_is_the_workers(make_stack: Any, level: str) -> None:
    stack: Stack = make_stack(summarization=POLICY)
    stack.ingest("lv", coding_session(steps=12, big_output_lines=20).messages)
    worker = stack.start("w1", [stack.python, "-m", "celery", "-A", "compactd.worker.app", "worker",
                                "-Q", "compaction.urgent,compaction.pressure,compaction.bulk",
                                "--concurrency", "2", "--without-gossip", "--without-mingle",
                                "--loglevel", level])
    # The worker is up when it runs a compaction (at WARNING it says nothing to wait for).
    result = stack.cli_json("compact", "lv", "--wait", "--timeout", "90")
    assert result["outcome"] == "committed", result
    assert worker.poll() is None, stack.log("w1")[-3000:]
    if level == "WARNING":
        # The worker's and the run's INFO lines ("Connected to", "ready", "compaction
        # committed", the task's "succeeded") are all below the level asked for.
        assert _levels(stack, "w1") <= {"warning", "error", "critical"}, stack.log("w1")[-3000:]
    else:
        wait_until(lambda: "debug" in _levels(stack, "w1"), timeout=10,
                   what="a debug line from the worker")
        assert "info" in _levels(stack, "w1")
