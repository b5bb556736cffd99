"""The worker with real processes: ``celery -A worker.app worker`` subprocesses, real Redis and
PostgreSQL, the fake provider over HTTP."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from scheduler.samples import coding_session

pytestmark = pytest.mark.slow

POLICY = {"trigger": [{"type": "tokens", "value": 8000}], "keep": {"type": "messages",
                                                                     "value": 6},
          "model_name": "fake-gpt"}


def test_two_workers_one_session_exactly_one_commits(make_stack, fake) -> None:  # type: ignore[no-untyped-def]
    stack = make_stack(summarization=POLICY)
    fake.latency_s = 1.0
    stack.ingest("s1", coding_session(steps=20, big_output_lines=30).messages)
    stack.start_worker("w1", concurrency=2)
    stack.start_worker("w2", concurrency=2)
    procs = [subprocess.Popen([sys.executable, "-m", "scheduler.cli", "compact", "s1",
                               "--wait", "--json"], env=stack.env, cwd=stack.home,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    results = [json.loads(p.communicate(timeout=120)[0]) for p in procs]
    outcomes = sorted((r["outcome"], r["failure_class"]) for r in results)
    assert outcomes.count(("committed", None)) == 1, outcomes
    other = next(o for o in outcomes if o != ("committed", None))
    assert other in (("failed", "busy"), ("nothing_to_do", None)), outcomes
    surface = stack.cli_json("surface", "s1")
    assert sum(1 for m in surface["messages"] if (m.get("meta") or {}).get("checkpoint")
               and m["role"] == "user") == 1
    assert "1/1 sessions verified" in stack.cli("verify", "--all").stdout
    assert fake.requests_for(model="fake-gpt"), "the summary came from the configured model"
