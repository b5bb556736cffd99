"""A run's lifecycle tells the truth: what a worker, the CLI and the client report about a run is
what it committed, and every run ends within its deadline.

Real processes: ``celery -A worker.app worker`` subprocesses and the CLI against real PostgreSQL
and Redis, the fake provider over HTTP.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from scheduler.client import CompactdClient
from scheduler.enqueue import RunRequest
from scheduler.samples import coding_session
from storage.errors import ConfigError, SessionNotFound
from tests.acceptance.test_worker import db, enqueuer
from tests.conftest import REPO, run_cli
from tests.support.db import Db
from tests.support.stack import Stack, wait_until
from worker.settings import load_config

pytestmark = pytest.mark.slow
__all__ = ["db"]  # the fixture, shared with test_worker

MakeStack = Callable[..., Stack]

POLICY = {"trigger": [{"type": "tokens", "value": 3000}],
          "keep": {"type": "messages", "value": 6}, "model_name": "fake-gpt",
          "trim_tokens_to_summarize": 16000}
# Renewals back to back: one is in flight whenever the run commits, and every await after the
# commit (the loop guard's read) gives the next one a turn. Nothing else claims these sessions.
TINY_LEASE_S = 0.003


def run_ends(stack: Stack, worker: str) -> list[dict[str, Any]]:
    """The worker's ``compaction.end`` log lines: what it reported for each run."""
    lines = [json.loads(line) for line in stack.log(worker).splitlines()
             if line.startswith("{")]
    return [line for line in lines if line.get("action") == "compaction.end"]


# ------------------------------------------------------------------------------------------
# item 8: the renewer stops before the run's ending commit


def test_a_committed_run_is_reported_committed_while_renewals_race_it(
        make_stack: MakeStack, db: Db) -> None:
    sessions = [f"r{i}" for i in range(12)]
    stack = make_stack(summarization=POLICY, worker={"lease_s": TINY_LEASE_S})
    for i, sid in enumerate(sessions):
        db.ingest(sid, coding_session(steps=20, big_output_lines=30, seed=300 + i).messages)
    stack.start_worker("w1", concurrency=2)
    with enqueuer(stack) as enq:
        for sid in sessions:
            enq.send(RunRequest(sid, "pressure"))
        wait_until(lambda: len(run_ends(stack, "w1")) >= len(sessions), timeout=90,
                   what="every run to end")
    for sid in sessions:
        [run] = db.runs(sid)
        assert run.status == "committed", run
        assert db.session(sid).lease_run_id is None
    reported = [(e["outcome"], e["failure_class"]) for e in run_ends(stack, "w1")]
    assert reported == [("committed", None)] * len(sessions), reported
    assert "CompactionFailed" not in stack.log("w1")

    # The CLI's own runs (inline: its exit status is the outcome it saw).
    for i in range(3):
        db.ingest(f"cli{i}", coding_session(steps=20, big_output_lines=30,
                                            seed=390 + i).messages)
        out = stack.cli("compact", f"cli{i}", "--inline", "--json", check=False)
        result = json.loads(out.stdout)
        assert (out.returncode, result["outcome"]) == (0, "committed"), result


# ------------------------------------------------------------------------------------------
# item 16: summarization.lease_s is refused, naming where the lease is configured


def test_summarization_lease_s_is_refused_naming_worker_lease_s(
        cli_env: dict[str, str], tmp_path: Path) -> None:
    config = tmp_path / "compactd.yaml"
    config.write_text(yaml.safe_dump({"summarization": {"lease_s": 120}}))
    out = run_cli({**cli_env, "COMPACTD_CONFIG": str(config)}, "status", check=False)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "summarization.lease_s" in out.stderr and "worker.lease_s" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr

    # A session's own policy cannot set it either (the same parser), and nothing is created.
    async def create() -> None:
        config = load_config({"COMPACTD_HOME": str(tmp_path)})
        async with CompactdClient(config) as client:
            with pytest.raises(ConfigError, match=r"policy\.lease_s.*worker\.lease_s"):
                await client.create_session("s1", policy={"lease_s": 5})
            with pytest.raises(SessionNotFound):
                await client.get_session("s1")

    asyncio.run(create())

    # The example configuration sets the lease where it is read, and only there.
    example = yaml.safe_load((REPO / "ops" / "compactd.example.yaml").read_text())
    assert "lease_s" not in example["summarization"]
    assert example["worker"]["lease_s"] == 60
