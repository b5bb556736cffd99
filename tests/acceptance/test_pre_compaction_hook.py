"""The pre-compaction hook (``events.pre_compaction``) in a real Celery worker (real PostgreSQL and
Redis, the fake provider over HTTP as the summarizer): it adds instructions that reach the summary
request, vetoes a run with its reason in the journal, and a hook that raises or hangs is bounded
(``events.hook_timeout_s``), the run goes on without it and the error is in the journal."""

from __future__ import annotations

import json

import pytest

from compactd.storage.errors import ConfigError
from compactd.storage.kinds import JournalKind, RunStatus
from compactd.worker.settings import load_config
from tests.support.db import Db
from tests.support.fake_provider import FakeProvider
from tests.support.stack import wait_until
from tests.support.worker_stack import db, redeliver_manual

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.redis]
__all__ = ["db"]  # the fixture (tests/support/worker_stack.py)

POLICY = {"trigger": [{"type": "tokens", "value": 10**9}],
          "keep": {"type": "messages", "value": 4}, "model_name": "fake-gpt",
          "trim_tokens_to_summarize": 100_000}
FOCUS = "Keep every table name the migration touched"
HOOK_MODULE = f'''
import pathlib
import time

def before(run):
    kind = run.session_id.split("-")[0]
    if kind == "focus":
        return {{"instructions": [{FOCUS!r}]}}
    if kind == "veto":
        return {{"veto": "tenant " + run.tenant + " is frozen for the audit"}}
    if kind == "raise":
        raise RuntimeError("the hook broke")
    if kind == "hang":
        time.sleep(60)
    if kind == "once":
        # Hangs on its first call only: its worker is killed while it waits.
        marker = pathlib.Path("hook-called")
        if not marker.exists():
            marker.write_text(run.run_id)
            time.sleep(60)
    return None
'''


def test_the_hook_adds_instructions_vetoes_and_is_bounded(make_stack, fake: FakeProvider,
                                                          db: Db) -> None:  # type: ignore[no-untyped-def]
    stack = make_stack(summarization=POLICY, extra_config={
        "events": {"pre_compaction": "compactd_test_hooks:before", "hook_timeout_s": 0.5}})
    (stack.home / "compactd_test_hooks.py").write_text(HOOK_MODULE)
    sessions = ("focus-1", "veto-1", "raise-1", "hang-1")
    for sid in sessions:
        stack.ingest(sid, [{"role": "user", "content": f"{sid} message {i} " * 40}
                           for i in range(12)])
    versions = {sid: db.session(sid).surface_version for sid in sessions}
    stack.start_worker("w1", concurrency=2)
    for sid in sessions:
        stack.cli("compact", sid, "--wait", check=False)

    def end_of(sid: str) -> dict:
        [end] = db.events(sid, [JournalKind.END])
        return end.payload

    # Instructions: on the run, in the journal, and at the provider.
    [focused] = db.runs("focus-1")
    assert focused.status == RunStatus.COMMITTED and focused.instructions == [FOCUS]
    assert end_of("focus-1")["hook"] == {"hook": "compactd_test_hooks:before",
                                         "instructions": [FOCUS]}
    requests = [json.dumps(r.body) for r in fake.requests_for(model="fake-gpt") if r.body]
    assert sum(FOCUS in r for r in requests) == 1
    # The veto: nothing done, the reason on the run and in the journal.
    [vetoed] = db.runs("veto-1")
    assert vetoed.status == RunStatus.NOTHING_TO_DO
    assert vetoed.error == ("vetoed by the pre-compaction hook: tenant default is frozen for "
                            "the audit")
    assert end_of("veto-1")["hook"]["veto"] == "tenant default is frozen for the audit"
    assert db.session("veto-1").surface_version == versions["veto-1"]
    # Raising and hanging: the run goes on without the hook, its error in the journal.
    for sid, error in (("raise-1", "RuntimeError: the hook broke"),
                       ("hang-1", "the hook did not answer within 0.5 s")):
        [run] = db.runs(sid)
        assert run.status == RunStatus.COMMITTED, (sid, run)
        assert db.session(sid).surface_version > versions[sid]
        assert end_of(sid)["hook"] == {"hook": "compactd_test_hooks:before", "error": error}


def test_a_hook_that_is_not_an_entry_point_is_refused_at_load(make_stack) -> None:  # type: ignore[no-untyped-def]
    for value in ("compactd_test_hooks", "a b:c", "mod:"):
        stack = make_stack(summarization=POLICY, extra_config={
            "events": {"pre_compaction": value}})
        out = stack.cli("status", check=False)
        assert out.returncode == 2, out
        assert "events.pre_compaction: " in out.stderr and repr(value) in out.stderr
        with pytest.raises(ConfigError, match=r"events\.pre_compaction"):
            load_config(env=stack.env)


def test_a_manual_run_killed_while_its_hook_is_waited_for_keeps_every_instruction(
        make_stack, fake: FakeProvider, db: Db) -> None:  # type: ignore[no-untyped-def]
    # The first delivery holds the lease and waits for the hook when its worker is killed:
    # its run row already holds the instructions of both requests the task stands for, and
    # the task's next delivery reads them there.
    asked, coalesced = "keep the open ticket's number", "and the failing test's name"
    stack = make_stack(summarization=POLICY, extra_config={
        "events": {"pre_compaction": "compactd_test_hooks:before", "hook_timeout_s": 60}})
    (stack.home / "compactd_test_hooks.py").write_text(HOOK_MODULE)
    stack.ingest("once-1", [{"role": "user", "content": f"message {i} " * 40}
                            for i in range(12)])
    first = stack.cli_json("compact", "once-1", "--instructions", asked)
    assert stack.cli_json("compact", "once-1", "--instructions", coalesced)["coalesced"]
    stack.start_worker("w1", concurrency=2)
    wait_until(lambda: (stack.home / "hook-called").exists(), timeout=60,
               what="the hook's first call")
    stack.kill("w1")
    run = redeliver_manual(stack, db, "once-1", first["task_id"], (asked,))
    assert (run.status, run.task_id) == (RunStatus.COMMITTED, first["task_id"]), run
    assert run.instructions == [asked, coalesced]
    request = json.dumps([r.body for r in fake.requests_for(model="fake-gpt") if r.body])
    assert coalesced in request
