"""``compactd status`` and ``compactd lease release`` on real PostgreSQL and the embedded SQLite:
runs by outcome, failures by class with the last error, live leases with their age, loop-guard
flags, bulk jobs; a stuck lease released through the reaper's path."""

from __future__ import annotations

import datetime as dt
import json
import re
import subprocess
from pathlib import Path

from compactd.scheduler.status import render_status, session_status, status
from compactd.storage.errors import LeaseLost
from compactd.storage.kinds import JournalKind
from compactd.storage.messages import parse_openai
from compactd.storage.records import Claim, RunEnd, utcnow
from compactd.storage.store import Store
from tests.conftest import run_cli


async def _session(store: Store, sid: str) -> None:
    await store.create_session(sid, run_model="gpt-4o", context_window=128_000)
    await store.append(sid, [parse_openai({"role": "user", "content": f"hello {i}"})
                             for i in range(4)])


async def _claim(store: Store, sid: str, *, ago_s: float, lease_s: float = 60.0,
                 owner: str = "w1:100") -> Claim:
    claim = await store.claim(sid, owner=owner, trigger="pressure", lease_s=lease_s,
                              now=utcnow() - dt.timedelta(seconds=ago_s), task_id=f"task-{sid}")
    assert isinstance(claim, Claim)
    return claim


async def _failed(store: Store, sid: str, failure_class: str, error: str) -> None:
    claim = await _claim(store, sid, ago_s=0)
    assert await store.finish(sid, run_id=claim.run_id, fence=claim.fence,
                              end=RunEnd(outcome="failed", failure_class=failure_class,
                                         error=error))


async def test_status_reports_runs_failures_leases_flags_and_bulk_jobs(store: Store) -> None:
    for sid in ("done", "bad", "held", "dead", "loopy"):
        await _session(store, sid)
    claim = await _claim(store, "done", ago_s=5)
    assert await store.finish("done", run_id=claim.run_id, fence=claim.fence,
                              end=RunEnd(outcome="committed", tokens_before=900, tokens_after=300))
    await _failed(store, "bad", "summary", "every candidate failed on call 1 of 1 (older)")
    await _failed(store, "bad", "summary", "every candidate failed on call 2 of 2")
    await _failed(store, "bad", "commit", "committing the checkpoint failed: disk full")
    held = await _claim(store, "held", ago_s=30, lease_s=60)
    dead = await _claim(store, "dead", ago_s=120, lease_s=60, owner="w2:200")
    await store.flag_session("loopy", reason="4 compactions in 600 s without relief",
                             cooldown_until=utcnow() + dt.timedelta(minutes=15))
    job = await store.create_bulk_job(filter={"tenant": "default"}, session_ids=["done", "bad"],
                                      force=False, rate_per_s=2.0)

    body = await status(store)

    assert body["runs"]["committed"] == 1
    assert body["runs"]["running"] == 2
    assert body["runs"]["failed"] == {"summary": 2, "commit": 1}
    assert body["last_errors"]["summary"]["error"] == "every candidate failed on call 2 of 2"
    assert body["last_errors"]["commit"]["session"] == "bad"
    leases = {lease["session"]: lease for lease in body["leases"]}
    assert set(leases) == {"held", "dead"}
    live, gone = leases["held"], leases["dead"]
    assert live["run_id"] == held.run_id and live["owner"] == "w1:100"
    assert live["trigger"] == "pressure" and live["task_id"] == "task-held"
    assert 29 <= live["age_s"] <= 60 and 29 <= live["heartbeat_age_s"] <= 60
    assert 0 < live["expires_in_s"] <= 31 and live["expired"] is False
    assert gone["run_id"] == dead.run_id and gone["expired"] is True
    assert gone["age_s"] >= 119 and gone["expires_in_s"] <= -59
    assert [f["session"] for f in body["flagged"]] == ["loopy"]
    assert body["flagged"][0]["reason"].startswith("4 compactions")
    assert [(j["id"], j["matched"]) for j in body["bulk_jobs"]] == [(job.id, 2)]
    assert {r["session"] for r in body["recent"]} == {"done", "bad", "held", "dead"}

    text = render_status(body)
    assert "runs: 1 committed, 0 nothing to do, 3 failed, 0 partial, 2 running" in text
    assert "summary" in text and "last: every candidate failed on call 2 of 2" in text
    assert f"held: run {held.run_id} by w1:100, held 3" in text
    assert "EXPIRED" in text and "(the reaper will end it)" in text
    assert "loopy: 4 compactions in 600 s without relief" in text
    assert f"{job.id} running: 0/2 done" in text


async def test_session_status_shows_its_lease_age_and_runs_newest_first(store: Store) -> None:
    await _session(store, "s1")
    await _failed(store, "s1", "summary", "every candidate failed on call 1 of 1")
    claim = await _claim(store, "s1", ago_s=42)
    body = await session_status(store, "s1")
    assert body["lease"]["run_id"] == claim.run_id and body["lease"]["age_s"] >= 41
    # The lease's run started 42 s ago, the failed run just now: newest first.
    assert [r["status"] for r in body["runs"]] == ["failed", "running"]
    assert body["runs"][0]["failure_class"] == "summary"
    assert "leased: run " in render_status(body)


async def test_release_ends_a_live_lease_as_abandoned_and_fences_its_holder(store: Store
                                                                             ) -> None:
    await _session(store, "s1")
    claim = await _claim(store, "s1", ago_s=0, lease_s=600)

    assert await store.release_lease("s1", run_id="not-this-run") is None
    released = await store.release_lease("s1", run_id=claim.run_id, by="alice")

    assert released is not None and released.run_id == claim.run_id
    assert released.owner == "w1:100"
    info = await store.get_session("s1")
    assert info.lease_run_id is None and info.lease_owner is None
    run = await store.get_run(claim.run_id)
    assert run is not None and (run.status, run.failure_class) == ("failed", "abandoned")
    assert run.error == "lease of w1:100 released by alice"
    end = (await store.read_events("s1", kinds=[JournalKind.END]))[-1]
    assert end.run_id == claim.run_id and end.payload["failure_class"] == "abandoned"
    assert end.payload["closed_by"] == "alice"
    assert (await store.verify("s1")).ok
    # The holder, still running, can neither renew, nor commit, nor overwrite the record.
    assert not await store.renew("s1", run_id=claim.run_id, fence=claim.fence, lease_s=60)
    try:
        await store.commit("s1", run_id=claim.run_id, fence=claim.fence, replacements=[])
    except LeaseLost:
        pass
    else:
        raise AssertionError("the released holder could still commit")
    assert not await store.finish("s1", run_id=claim.run_id, fence=claim.fence,
                                  end=RunEnd(outcome="committed"))
    run = await store.get_run(claim.run_id)
    assert run is not None and run.failure_class == "abandoned"
    # Nothing left to release; the session can be claimed again.
    assert await store.release_lease("s1") is None
    assert isinstance(await _claim(store, "s1", ago_s=0), Claim)


def _cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return run_cli(env, *args, check=False, timeout=120)


async def test_cli_status_and_lease_release_on_the_embedded_database(
        cli_env: dict[str, str], tmp_path: Path) -> None:
    from compactd.storage.database import embedded_url

    store = Store.from_url(embedded_url(tmp_path))
    from compactd.storage.migrate import ensure_schema

    await ensure_schema(store.engine, embedded_url(tmp_path))
    try:
        await _session(store, "s1")
        claim = await _claim(store, "s1", ago_s=12, lease_s=600)
    finally:
        await store.close()

    out = _cli(cli_env, "status", "--json")
    assert out.returncode == 0, out.stderr
    body = json.loads(out.stdout)
    assert [lease["run_id"] for lease in body["leases"]] == [claim.run_id]
    assert body["leases"][0]["age_s"] >= 11
    text = _cli(cli_env, "status").stdout
    # The lease was claimed 12 s before; the two CLI calls since take seconds of their own.
    held = re.search(rf"s1: run {claim.run_id} by w1:100, held ([\d.]+) s", text)
    assert held is not None and float(held.group(1)) >= 11, text

    out = _cli(cli_env, "lease", "release", "s1", "--run", claim.run_id, "--json")
    assert out.returncode == 0, out.stderr
    released = json.loads(out.stdout)
    assert (released["released"], released["run_id"], released["owner"]) == (
        True, claim.run_id, "w1:100")
    again = _cli(cli_env, "lease", "release", "s1")
    assert again.returncode == 0 and "nothing released" in again.stdout
    body = json.loads(_cli(cli_env, "status", "--json").stdout)
    assert body["leases"] == [] and body["runs"]["failed"] == {"abandoned": 1}
    assert "released by operator" in body["last_errors"]["abandoned"]["error"]
    missing = _cli(cli_env, "lease", "release", "nope")
    assert missing.returncode == 2 and "does not exist" in missing.stderr


async def test_cli_status_lists_only_sessions_growing_now_and_says_what_its_numbers_are(
        store: Store, db_url: str, cli_env: dict[str, str]) -> None:
    """Through ``compactd status``: a session that last appended minutes ago is idle, not
    "growing N tokens/s" on a rate that only decays; the runway section's header says that its
    count is of sessions and that the figures under it are seconds."""
    now = utcnow()
    for sid, ago_s in (("busy", 0.0), ("idle", 600.0)):
        await store.create_session(sid, run_model="gpt-4o", context_window=128_000)
        await store.append(sid, [parse_openai({"role": "user", "content": "word " * 400})],
                           now=now - dt.timedelta(seconds=ago_s))
    env = {**cli_env, "COMPACTD_DATABASE_URL": db_url}
    body = json.loads(_cli(env, "status", "--json").stdout)
    assert [r["session"] for r in body["runway"]] == ["busy"], body["runway"]
    text = _cli(env, "status").stdout
    header = next(line for line in text.splitlines() if "runway" in line)
    assert header.startswith("growing sessions: 1 "), header
    assert re.search(r"^  busy: runway [\d.]+ s, \d+/128000 tokens, growing [\d.]+ tokens/s$",
                     text, re.M), text
    assert "idle" not in text, text


async def _held_back(store: Store, sid: str) -> int:
    """A run that left ``sid`` over its trigger with nothing worth a run yet, as a pressure
    run's end records it (``RunEnd.refire``): the session waits for growth. The tokens it waits
    for."""
    await _session(store, sid)
    info = await store.get_session(sid)
    until = info.surface_tokens + info.envelope_tokens + 5_000
    claim = await _claim(store, sid, ago_s=0)
    assert await store.finish(sid, run_id=claim.run_id, fence=claim.fence,
                              end=RunEnd(outcome="nothing_to_do",
                                         refire=(until, info.compacted_version)))
    return until


async def test_cli_status_of_a_session_says_it_waits_for_growth(
        cli_env: dict[str, str], tmp_path: Path) -> None:
    from compactd.storage.database import embedded_url

    store = Store.from_url(embedded_url(tmp_path))
    try:
        until = await _held_back(store, "s1")
        await _session(store, "s2")
    finally:
        await store.close()
    body = json.loads(_cli(cli_env, "status", "s1", "--json").stdout)
    waiting = body["waiting_for_growth"]
    assert waiting is not None and waiting["until_tokens"] == until, body
    assert waiting["tokens"] < until
    text = _cli(cli_env, "status", "s1").stdout
    assert f"waiting for growth: {waiting['tokens']} tokens, fires again at {until}" in text
    other = json.loads(_cli(cli_env, "status", "s2", "--json").stdout)
    assert other["waiting_for_growth"] is None
    assert "waiting for growth" not in _cli(cli_env, "status", "s2").stdout


async def test_the_http_status_route_says_a_session_waits_for_growth(
        db_url: str, tmp_path: Path) -> None:
    from tests.support.asgi import A, api_config, serve_app

    async for api in serve_app(api_config(db_url, tmp_path)):
        await api.create("s1", A)
        await api.create("s2", A)
        store = Store.from_url(db_url)
        try:
            info = await store.get_session("s1")
            until = info.surface_tokens + 5_000
            claim = await _claim(store, "s1", ago_s=0)
            assert await store.finish("s1", run_id=claim.run_id, fence=claim.fence,
                                      end=RunEnd(outcome="nothing_to_do",
                                                 refire=(until, info.compacted_version)))
        finally:
            await store.close()
        body = (await api.http.get("/v1/sessions/s1", headers=A)).json()
        assert body["waiting_for_growth"]["until_tokens"] == until, body
        other = (await api.http.get("/v1/sessions/s2", headers=A)).json()
        assert other["waiting_for_growth"] is None
