"""``compactd recompact`` with a real Celery worker: a job whose runs fail while the fan-out is
still sending ends (nothing set back to enqueued), waiting for a job no worker consumes gives
up with a message that names the job and how to continue it, and sessions under their trigger
are skipped without --force and keep their policy's tail with it."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from compactd.storage.kinds import ItemState
from compactd.storage.messages import parse_openai
from compactd.storage.store import Store
from tests.support.stack_sessions import POLICY, many_sessions

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.redis]


@pytest.mark.timed
@pytest.mark.timeout(180)
async def test_items_that_fail_while_the_fan_out_sends_end_the_job(make_stack, fake) -> None:  # type: ignore[no-untyped-def]
    # Every model call is refused (401) and the local summarizer is off: each run fails within
    # a moment, long before the paced fan-out has sent the rest of its chunk.
    fake.script(status=401, times=-1)
    stack = make_stack(summarization=POLICY, worker={"local_fallback": False})
    store = Store.from_url(stack.database_url)
    try:
        # Six steps: more than the policy's tail of six messages, so each run calls a model.
        await many_sessions(store, 4, steps=6)
        stack.start_worker("w1", concurrency=4)
        started = time.monotonic()
        out = stack.cli("recompact", "--force", "--rate", "1/s", "--chunk", "10", "--json",
                        "--timeout", "60", check=False, timeout=120)
        took = time.monotonic() - started
        assert out.returncode == 1, out.stderr  # failed items: exit 1, not a hang
        job = json.loads(out.stdout)["job"]
        assert (job["matched"], job["done"], job["failed"], job["pending"]) == (4, 0, 4, 0)
        assert took < 50, f"the job took {took:.1f} s to end"
        runs = [r for sid in (f"bulk-{i:04d}" for i in range(4))
                for r in await store.session_runs(sid)]
        assert len(runs) == 4 and {r.failure_class for r in runs} == {"summary"}
    finally:
        await store.close()


@pytest.mark.timed
@pytest.mark.timeout(120)
async def test_waiting_for_a_job_no_worker_consumes_gives_up(make_stack) -> None:  # type: ignore[no-untyped-def]
    stack = make_stack(summarization=POLICY)
    store = Store.from_url(stack.database_url)
    try:
        await many_sessions(store, 3, steps=0)
        started = time.monotonic()
        out = stack.cli("recompact", "--force", "--timeout", "2", check=False, timeout=60)
        assert out.returncode == 1 and time.monotonic() - started < 30
        [job] = await store.list_bulk_jobs()
        assert f"bulk job {job.id}: no session finished within 2 s" in out.stderr
        assert "compaction.bulk" in out.stderr
        assert f"compactd recompact --resume {job.id}" in out.stderr
        assert "Traceback" not in out.stderr
        # Nothing is lost: the items stay enqueued for a worker or a resume.
        assert (job.matched, job.enqueued, job.done, job.failed) == (3, 3, 0, 0)
        assert len(await store.bulk_items(job.id, states=[ItemState.ENQUEUED], limit=10)) == 3
        for bad in ("nan", "-1", "0", "inf"):
            refused = stack.cli("recompact", "--force", "--timeout", bad, check=False)
            assert refused.returncode == 2, (bad, refused.stderr)
            assert "timeout" in refused.stderr
        assert len(await store.list_bulk_jobs()) == 1  # a refused command wrote nothing
    finally:
        await store.close()


def _turns(count: int, words: int, tag: str) -> list[Any]:
    """Plain user and assistant messages in turn, about ``words`` tokens each."""
    return [parse_openai({"role": ("user", "assistant")[i % 2],
                          "content": f"{tag} turn {i}: " + " ".join(["river stone"] * words)})
            for i in range(count)]


@pytest.mark.timeout(240)
async def test_recompact_skips_sessions_under_their_trigger_and_force_keeps_their_tail(
        make_stack) -> None:  # type: ignore[no-untyped-def]
    stack = make_stack(summarization={"trigger": [{"type": "tokens", "value": 4000}],
                                      "keep": {"type": "messages", "value": 6},
                                      "model_name": "fake-gpt"})
    store = Store.from_url(stack.database_url)
    try:
        for sid, words in (("over-1", 200), ("over-2", 200), ("under-1", 60), ("under-2", 60)):
            await store.create_session(sid, run_model="fake-gpt")
            await store.append(sid, _turns(12, words, sid))
        under = {sid: await store.read_surface(sid) for sid in ("under-1", "under-2")}
        stack.start_worker("w1", concurrency=4, queues=("compaction.bulk",))

        dry = stack.cli("recompact", "--dry-run")
        assert dry.stdout.splitlines()[:5] == [
            "4 sessions match; nothing enqueued (dry run)",
            "  over-1", "  over-2", "  under-1", "  under-2"], dry.stdout

        # Without --force: the two under their trigger are skipped, not "done"; progress on
        # stderr is text, not JSON, without --json.
        out = stack.cli("recompact", "--timeout", "120", timeout=180)
        job = (await store.list_bulk_jobs())[0]
        assert (job.matched, job.done, job.skipped, job.failed) == (4, 2, 2, 0)
        assert f"bulk job {job.id}: 4 matched, 2 compacted, 2 skipped" in out.stdout, out.stdout
        assert out.stderr.strip(), "no progress shown"
        assert not [line for line in out.stderr.splitlines() if line.lstrip().startswith("{")]
        assert f"bulk job {job.id}: 4/4 ended: 2 compacted, 2 skipped, 0 failed" in out.stderr
        for sid, surface in under.items():
            assert (await store.read_surface(sid)).seqs == surface.seqs  # untouched

        # With --force: compacted whatever the trigger, keeping the policy's six messages.
        ids = stack.home / "under.txt"
        ids.write_text("under-1\nunder-2\n")
        forced = stack.cli_json("recompact", "--force", "--session-file", str(ids),
                                "--timeout", "120", timeout=180)["job"]
        assert (forced["done"], forced["skipped"], forced["failed"]) == (2, 0, 0), forced
        for sid, surface in under.items():
            after = await store.read_surface(sid)
            kept = [n.seq for n in after.nodes if n.kind == "message"]
            assert kept == surface.seqs[-6:], (sid, kept)
            assert any(n.kind == "checkpoint" for n in after.nodes)
    finally:
        await store.close()
